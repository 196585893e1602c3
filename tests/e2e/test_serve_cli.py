"""`andromeda serve` as a user runs it: a subprocess against a real redis-server, answering over HTTP,
stopped with Ctrl-C."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from index_updater.local_redis import LocalRedis, free_port


def test_serve_publishes_a_demo_corpus_answers_and_stops_on_ctrl_c(tmp_path):
    server = LocalRedis(tmp_path / "redis").start()
    port = free_port()
    env = {**os.environ, "REDIS_URL": server.url, "ANDROMEDA_WRITE_TOKEN": "e2e-token"}
    process = subprocess.Popen([sys.executable, "-m", "andromeda_cli", "serve", "--port", str(port), "--demo-ads", "300",
                                "--shards", "2"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        output = ""
        deadline = time.monotonic() + 300
        while "Ctrl-C stops it." not in output:
            line = process.stdout.readline()
            assert line or process.poll() is None, output
            output += line
            assert time.monotonic() < deadline, output
        assert f"http://127.0.0.1:{port}" in output and "/openapi.json" in output
        printed = Path(re.search(r"-d @(\S+)", output).group(1))  # the curl it prints works from any folder
        assert printed.is_absolute() and printed == (tmp_path / "var" / "demo-300" / "example.json").resolve()
        body = json.loads(printed.read_text())
        answer = requests.post(f"http://127.0.0.1:{port}/v1/retrieve", json=body, timeout=30).json()
        assert answer["eligible"] > 0 and 0 < len(answer["ads"]) <= 5 and len(answer["shard_watermarks"]) == 2
        assert requests.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        try:
            rest, _ = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            rest = process.communicate()[0] + "\n(killed: did not stop within 120 s)"
        server.stop()
    assert process.returncode == 0 and "stopping" in rest


def test_serve_without_redis_url_says_how_to_get_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    result = subprocess.run([sys.executable, "-m", "andromeda_cli", "serve"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "REDIS_URL is not set" in result.stderr and "Traceback" not in result.stderr
