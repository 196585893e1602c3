"""`andromeda up` watches the redis-server it started: killed, it is started again on its data with one line saying so;
killed again right after its restart (a crash loop), `up` stops with one line, exit 2; shut down (`redis-cli shutdown`,
exit status 0), `up` stops, exit 0. Until 2026-12-06 `up` did not notice.

`up` runs in process with its slow parts stubbed (the demo world, model and ads, and Ray: run_service waits on the stop
event it is given, as the real one does once it has printed the URL); its redis-server is real, in the test's folder."""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Callable

import pytest
import redis

from andromeda_cli import service
from andromeda_cli.main import main
from index_updater.local_redis import LocalRedis, free_port
from tests.conftest import wait_until


def pid_of(url: str) -> int | None:
    """The process id of the redis-server answering at `url`; None while none does."""
    try:
        return redis.Redis.from_url(url, socket_timeout=1).info("server")["process_id"]
    except redis.ConnectionError:
        return None


@pytest.fixture
def up(tmp_path, monkeypatch, capsys) -> Callable[[Callable], tuple[int, str]]:
    """up(serving) -> (exit status, stderr) of `andromeda up`, where `serving(config, stop, stderr)` stands for the
    service (stderr(): what up wrote to it so far)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("ANDROMEDA_WRITE_TOKEN", "up-test-token")
    monkeypatch.setattr(service, "REDIS_CHECK_S", 0.05, raising=False)
    monkeypatch.setattr(service, "demo_world", lambda ads: tmp_path / f"demo-{ads}")
    monkeypatch.setattr(service, "demo_model", lambda world: None)  # the untrained baseline
    monkeypatch.setattr(service, "publish_demo", lambda *args: None)
    monkeypatch.setattr(service, "publish_command", lambda *args: "andromeda publish ...")

    written = []

    def stderr() -> str:
        written.append(capsys.readouterr().err)
        return "".join(written)

    def run(serving: Callable) -> tuple[int, str]:
        monkeypatch.setattr(service, "run_service",
                            lambda config, world, note, stop=None: serving(config, stop or threading.Event(), stderr))
        code = main(["up", "--port", str(free_port()), "--demo-ads", "10"])
        return code, stderr()

    yield run
    LocalRedis(tmp_path / "var" / "redis").start().stop()  # up stopped its server: the data directory is free


def test_a_killed_redis_is_started_again_on_its_data_and_a_crash_loop_stops_up(up):
    def serving(config, stop, stderr) -> None:
        client = redis.Redis.from_url(config.redis_url)
        client.set("acknowledged", 1)
        first = pid_of(config.redis_url)
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: "started it again" in stderr())
        assert pid_of(config.redis_url) not in (None, first) and not stop.is_set()
        assert client.get("acknowledged") == b"1"  # its data: the AOF
        os.kill(pid_of(config.redis_url), signal.SIGKILL)  # at once again: a crash loop
        assert stop.wait(10)

    code, err = up(serving)
    lines = err.strip().splitlines()
    restarted = [line for line in lines if "started it again" in line]
    assert len(restarted) == 1 and "died (killed by SIGKILL)" in restarted[0] and "var/redis" in restarted[0], err
    assert code == 2 and lines[-1].startswith("error: redis-server at redis://127.0.0.1:"), err
    assert "died again (killed by SIGKILL)" in lines[-1] and "redis.log" in lines[-1], err


def test_a_redis_shut_down_stops_up(up):
    def serving(config, stop, stderr) -> None:
        redis.Redis.from_url(config.redis_url).shutdown()
        assert stop.wait(10)

    code, err = up(serving)
    assert code == 0 and "was shut down; stopping" in err and "started it again" not in err, err


def test_a_redis_killed_during_an_aof_rewrite_is_started_again(up):
    """SIGKILL (the OOM killer's) often lands during an AOF rewrite's fork: the rewrite child lived on holding the
    data directory's lock, and the restart failed ("in use by another redis-server"), exit 2."""
    def serving(config, stop, stderr) -> None:
        client = redis.Redis.from_url(config.redis_url)
        for i in range(20):
            client.set(f"k{i}", i)
        client.config_set("rdb-key-save-delay", 500_000)  # 0.5 s per key: the rewrite runs ~10 s
        client.bgrewriteaof()
        assert wait_until(lambda: client.info("persistence")["aof_rewrite_in_progress"] == 1)
        os.kill(pid_of(config.redis_url), signal.SIGKILL)
        assert wait_until(lambda: "started it again" in stderr() or stop.is_set())
        assert not stop.is_set(), stderr()
        assert client.get("k19") == b"19"
        stop.set()  # as Ctrl-C does

    code, err = up(serving)
    assert code == 0 and "started it again" in err, err


def test_up_stops_its_redis_when_interrupted(up):
    """The server runs in a process group of its own, out of the terminal's Ctrl-C: up's finally stops it."""
    pids = []

    def serving(config, stop, stderr) -> None:
        pids.append(pid_of(config.redis_url))
        raise KeyboardInterrupt

    code, _ = up(serving)
    assert code == 130 and pids[0] is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)


def test_a_redis_lost_for_good_while_publishing_stops_up_with_the_keepers_message(up, monkeypatch):
    """Before, the demo publisher's redis.ConnectionError traceback hid why."""
    def publish(config, *args) -> None:
        first = pid_of(config.redis_url)
        os.kill(first, signal.SIGKILL)
        assert wait_until(lambda: pid_of(config.redis_url) not in (None, first))
        os.kill(pid_of(config.redis_url), signal.SIGKILL)  # a crash loop
        redis.Redis.from_url(config.redis_url).ping()  # as the publisher's next write would

    monkeypatch.setattr(service, "publish_demo", publish)
    code, err = up(lambda *args: pytest.fail("served without its redis-server"))
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: redis-server at redis://127.0.0.1:"), err
    assert "died" in last and "`up` stopped" in last and "Traceback" not in err, err  # again, or during its restart


def test_up_never_empties_a_redis_it_did_not_start_and_says_what_it_serves(up, monkeypatch, tmp_path):
    """With REDIS_URL, streams holding ads another run published are served as they are, with a warning (until
    2026-12-06 up said nothing, and the printed curl returned no ads)."""
    server = LocalRedis(tmp_path / "theirs").start()
    try:
        client = redis.Redis.from_url(server.url)
        client.xadd("andromeda:ad-events:0", {"note": "not this demo's"})
        monkeypatch.setenv("REDIS_URL", server.url)
        code, err = up(lambda config, stop, stderr: None)
        assert code == 0 and "hold ads that this demo" in err and "ANDROMEDA_STREAM" in err, err
        assert client.xlen("andromeda:ad-events:0") == 1 and not (tmp_path / "var" / "redis").exists()
    finally:
        server.stop()


def test_up_without_redis_server_says_so_in_one_line(up, monkeypatch, tmp_path):
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path / "no-such-bin"))  # no redis-server to find
        code, err = up(lambda config, stop, stderr: None)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("error: redis-server is not installed (apt-get install redis-server), "
                                            "or set REDIS_URL")


def test_a_second_up_in_the_folder_refuses_before_any_work(up, monkeypatch, tmp_path):
    """Another up's redis-server holds var/redis: refused before the demo world and model (it made them first, half a
    minute at the default size, and refused only when starting its redis-server)."""
    made = []
    monkeypatch.setattr(service, "demo_world", lambda ads: made.append(ads))
    held = LocalRedis(tmp_path / "var" / "redis").lock()
    try:
        code, err = up(lambda config, stop, stderr: None)
    finally:
        os.close(held)
    assert code == 2 and made == [] and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: ") and "in use by another redis-server" in err, err
