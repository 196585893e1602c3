"""The CPU kernel builds where the cache folder cannot be written (a read-only home in a container)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_builds_in_the_temp_dir_when_the_cache_is_read_only():
    env = {**os.environ, "XDG_CACHE_HOME": "/proc/andromeda-cannot-write-here"}
    run = subprocess.run([sys.executable, "-c", "from kernels import cpu; print(cpu.library()._name)"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).parent == Path(tempfile.gettempdir()) / f"andromeda-{os.getuid()}"


def test_a_temp_folder_others_can_write_to_is_refused(tmp_path, monkeypatch):
    """The library is loaded from the temp folder: one made by another user first, or opened up, could hold their
    code. It was used whatever its owner and mode."""
    from kernels import cpu

    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/andromeda-cannot-write-here")
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    folder = tmp_path / f"andromeda-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # as another user would leave it: anyone may write
    with pytest.raises(cpu.BuildError, match="mode 777"):
        cpu._cache_folder()
    folder.chmod(0o700)
    assert cpu._cache_folder() == folder
