"""`up`'s RedisKeeper against a fake server: whatever goes wrong in its watch ends in `failure` and `stopped` (before,
an unexpected exception ended its thread silently and `up` served on without a keeper)."""
from __future__ import annotations

import signal
from pathlib import Path

import redis

from andromeda_cli.service import RedisKeeper, signal_name
from tests.conftest import wait_until

REALTIME = signal.SIGRTMIN + 3  # not a member of signal.Signals: Signals(REALTIME) raises ValueError


class FakeProcess:
    def __init__(self, codes):
        self.codes = list(codes)

    def poll(self):
        code = self.codes.pop(0) if self.codes else None
        if isinstance(code, Exception):
            raise code
        return code


class FakeServer:
    """Stands for a LocalRedis: its process exits with `codes` in turn (None: running), `restart` runs `on_restart`."""

    def __init__(self, codes, on_restart=lambda: None):
        self.process, self.on_restart, self.restarts = FakeProcess(codes), on_restart, 0
        self.url, self.directory = "redis://127.0.0.1:1/0", Path("/nowhere/var/redis")

    def restart(self):
        self.restarts += 1
        self.on_restart()
        return self


def fail(exc: Exception):
    def raise_it():
        raise exc
    return raise_it


def keep(server) -> RedisKeeper:
    keeper = RedisKeeper(server, check_s=0.01, crash_loop_s=30).start()
    assert keeper.stopped.wait(5), "the keeper neither gave up nor stopped"
    keeper.stop()
    return keeper


def test_a_restart_failing_with_an_unexpected_error_stops_up_with_its_message():
    keeper = keep(FakeServer([-signal.SIGKILL], on_restart=fail(redis.TimeoutError("Timeout reading from socket"))))
    assert keeper.failure is not None and "TimeoutError: Timeout reading from socket" in keeper.failure
    assert "redis.log" in keeper.failure


def test_an_unexpected_error_checking_the_server_stops_up_with_its_message():
    keeper = keep(FakeServer([None, RuntimeError("poll broke")]))
    assert keeper.failure is not None and "RuntimeError: poll broke" in keeper.failure


def test_a_server_killed_by_a_realtime_signal_is_restarted(capsys):
    server = FakeServer([-REALTIME])
    keeper = RedisKeeper(server, check_s=0.01, crash_loop_s=30).start()
    try:
        assert wait_until(lambda: server.restarts == 1)
        assert not keeper.stopped.is_set() and keeper.failure is None
    finally:
        keeper.stop()
    err = capsys.readouterr().err
    assert f"died (killed by signal {int(REALTIME)} (" in err and "started it again" in err, err


def test_signal_name():
    assert signal_name(signal.SIGKILL) == "SIGKILL"
    assert signal_name(REALTIME).startswith(f"signal {int(REALTIME)} (")


def test_a_death_since_the_last_check_is_reported_when_the_keeper_stops():
    """up stops its keeper when a write fails; the server's death that failed it, not yet seen by the watch, is its
    failure (before, up ended on the write's redis.ConnectionError, a traceback), and it is not started again."""
    keeper = RedisKeeper(FakeServer([-signal.SIGKILL]), check_s=60, crash_loop_s=30).start()  # the watch never looks
    keeper.stop()
    assert keeper.stopped.is_set() and keeper.server.restarts == 0
    assert keeper.failure is not None and "died (killed by SIGKILL)" in keeper.failure and "redis.log" in keeper.failure
