"""The CPU kernel builds where the cache folder cannot be written (a read-only home in a container)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_builds_in_the_temp_dir_when_the_cache_is_read_only():
    env = {**os.environ, "XDG_CACHE_HOME": "/proc/andromeda-cannot-write-here"}
    run = subprocess.run([sys.executable, "-c", "from kernels import cpu; print(cpu.library()._name)"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).parent == Path(tempfile.gettempdir()) / f"andromeda-{os.getuid()}"
