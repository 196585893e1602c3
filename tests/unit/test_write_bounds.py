"""The write path's bounds, without Redis: the publisher's tries end by their deadline, with room for one resend after
a try that timed out (index_updater.publisher.retry, try_wait), and the write path's thread lane refuses past its
threads after a short wait instead of queueing (deployments.limits.ThreadLane).
tests/integration/test_hung_redis.py holds the router to both against a hung redis-server."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import redis

from andromeda_core.errors import Overloaded
from andromeda_core.ingest import prepare_ops
from andromeda_core.sharding import shard_of
from andromeda_core.types import parse_event
from deployments.limits import ThreadLane
from index_updater import publisher
from index_updater.publisher import Publisher, retry
from tests.conftest import upsert


@pytest.fixture
def clock(monkeypatch) -> SimpleNamespace:
    """publisher's monotonic clock, moved only by its sleeps and by the tries (no wall time)."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(publisher, "time", SimpleNamespace(monotonic=lambda: clock.now, time=time.time,
                                                           sleep=lambda s: setattr(clock, "now", clock.now + s)))
    return clock


@pytest.mark.parametrize("try_s", [0.0, 1.0, 2.5])
def test_the_tries_end_by_the_deadline_and_the_last_error_propagates(clock, try_s):
    """Each try fails after try_s (a hung Redis: its socket timeout; 0: refused at once). No try starts that, with the
    pause before it, could end past the deadline; the tries stop there with the last error, though attempts are left."""
    tries = []

    def call():
        tries.append(clock.now)
        clock.now += try_s
        raise redis.TimeoutError(f"try {len(tries)}")

    with pytest.raises(redis.TimeoutError) as raised:
        retry(call, attempts=1000, deadline=clock.now + 5.0, try_s=2.5)
    assert clock.now <= 105.0 and raised.value.args[0] == f"try {len(tries)}"
    assert len(tries) == {0.0: 6, 1.0: 3, 2.5: 1}[try_s]  # at 0 s: after pauses of 0.05, 0.1, ..., 0.8 s


def test_without_a_deadline_the_attempts_alone_bound_the_tries(clock):
    calls = []

    def call():
        calls.append(1)
        if len(calls) < 4:
            raise redis.ConnectionError("refused")
        return "ok"

    assert retry(call, attempts=4) == "ok" and len(calls) == 4
    calls.clear()
    with pytest.raises(redis.ConnectionError):
        retry(call, attempts=3)
    assert len(calls) == 3


def stand_in_client(script, wait_s: float) -> SimpleNamespace:
    """A client whose every script is `script`, waiting at most wait_s for a connection or a reply (as its socket
    timeouts say)."""
    return SimpleNamespace(register_script=lambda _: script,
                           get_connection_kwargs=lambda: {"socket_timeout": wait_s, "socket_connect_timeout": wait_s})


def ops_of_shards(small_schema, scorer, shards: tuple[int, ...], of: int) -> list:
    """One upsert of an ad of each of `shards` (of `of` shards)."""
    ads = {shard_of(ad_id, of): ad_id for ad_id in range(1, 400)}
    return prepare_ops(small_schema, scorer, [parse_event(upsert(ads[s])) for s in shards])


def test_a_publishers_call_ends_its_redis_work_by_its_bound_across_shards(clock, small_schema, scorer):
    """Bound 5 s, a try waiting at most try_wait(5) = 2.23 s: shard 0's part is refused twice and then taken, at
    103.05 s; shard 1's part is not even tried then (its one try could end past 105 s): redis.TimeoutError, shard 0's
    part appended (as the router's 503 says: some of the batch may have been)."""
    tried = []

    def append(keys, args):
        tried.append((keys[0], clock.now))
        if len(tried) < 3:
            raise redis.ConnectionError("refused")
        clock.now += 2.9
        return [b"ok", [b"1-0"] * args[2]]

    bounded = Publisher(stand_in_client(append, publisher.try_wait(5.0)), small_schema, scorer, shards=2, stream="s",
                        attempts=60, timeout_s=5.0)
    appended = []
    with pytest.raises(redis.TimeoutError, match="bound of 5 s ran out"):
        bounded.publish_ops(ops_of_shards(small_schema, scorer, (0, 1), 2), on_appended=appended.append)
    assert [stream for stream, _ in tried] == ["s:0"] * 3 and appended == [1] and clock.now <= 105.0


@pytest.mark.parametrize("second", ["answers", "times out"])
def test_a_timed_out_try_is_retried_once_within_the_bound(clock, small_schema, scorer, second):
    """A try that found Redis hung ends when its client's wait does (a little after: the try's own work), and one more
    try fits in the bound after it: the resend that, carrying the first try's token, recovers a write that Redis took
    late. With each try waiting half the bound (before 2026-12-06's review) a timed-out try was never resent, and a
    stall of more than half the bound was a 503 for a write that Redis had applied."""
    wait_s, tried = publisher.try_wait(5.0), []

    def append(keys, args):
        tried.append(clock.now)
        clock.now += wait_s + 0.01
        if len(tried) == 1 or second == "times out":
            raise redis.TimeoutError("Timeout reading from socket")
        return [b"ok", [b"7-0"] * args[2]]

    bounded = Publisher(stand_in_client(append, wait_s), small_schema, scorer, stream="s", attempts=5, timeout_s=5.0)
    ops = ops_of_shards(small_schema, scorer, (0,), 1)
    if second == "answers":
        assert bounded.publish_ops(ops) == ["7-0"]
    else:
        with pytest.raises(redis.TimeoutError, match="Timeout reading"):
            bounded.publish_ops(ops)
    assert len(tried) == 2 and clock.now <= 105.0


def test_the_bound_starts_after_the_batch_is_encoded(clock, small_schema, scorer, monkeypatch):
    """Encoding a large batch (3 s here) is not Redis's time: the append is still tried, with the whole bound."""
    encode = publisher.encode

    def slow_encode(*args):
        clock.now += 3.0 / 2  # two entries
        return encode(*args)

    monkeypatch.setattr(publisher, "encode", slow_encode)
    tried = []

    def append(keys, args):
        tried.append(clock.now)
        return [b"ok", [b"1-0"] * args[2]]

    bounded = Publisher(stand_in_client(append, publisher.try_wait(5.0)), small_schema, scorer, shards=1, stream="s",
                        timeout_s=5.0)
    assert bounded.publish_ops(ops_of_shards(small_schema, scorer, (0, 0), 1)) == ["1-0"] * 2 and tried == [103.0]


@pytest.mark.parametrize("wait_s", [None, 2.5])
def test_a_bounded_publisher_refuses_a_client_that_waits_too_long_for_a_resend(small_schema, scorer, wait_s):
    """The deadline arithmetic reckons with what the client waits: a client without a bound, or one whose timed-out
    try leaves no time for another within the publisher's, is refused where it is made."""
    with pytest.raises(ValueError, match=r"waits at most 2.23 s for a connection or a reply"):
        Publisher(stand_in_client(None, wait_s), small_schema, scorer, timeout_s=5.0)


def test_the_lane_refuses_past_its_threads_and_frees_one_when_its_job_ends():
    """Two threads: a third job is refused at once (naming the setting), never queued. A caller that stops waiting
    (cancelled, as a client gone) leaves its job its thread until the job returns; then the lane takes one again."""
    lane, release = ThreadLane(2, "writes", "overload.write_inflight", retry_after_s=3), threading.Event()

    async def scenario() -> None:
        held = [asyncio.create_task(lane.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert lane.in_flight == 2
        with pytest.raises(Overloaded) as refused:
            await lane.run(lambda: "never run")
        assert "2 writes in flight (overload.write_inflight = 2)" in refused.value.message
        assert refused.value.retry_after == 3
        held[0].cancel()
        await asyncio.sleep(0.05)
        with pytest.raises(Overloaded):  # the cancelled caller's job still runs on its thread
            await lane.run(lambda: "never run")
        release.set()
        assert await held[1] is True
        for _ in range(200):  # the cancelled caller's job frees its slot on its own thread, when it returns
            if lane.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert lane.in_flight == 0
        assert await lane.run(lambda: "ran") == "ran"
        assert await asyncio.gather(lane.run(lambda: 1), lane.run(lambda: 2)) == [1, 2]

    try:
        asyncio.run(scenario())
    finally:  # a failed assert must not leave the lane's threads waiting (the interpreter's exit joins them)
        release.set()


def test_a_caller_waits_up_to_wait_s_for_a_slot_then_is_refused():
    """One thread, wait_s 0.5: a second job waits for the first to end and runs (it was refused at once before); a
    slot taken for longer than wait_s refuses it after that wait. A block that takes a slot and runs no job (a write
    refused by its owner lookups) frees it at its end."""
    lane, release = ThreadLane(1, "writes", "overload.write_inflight", wait_s=0.5), threading.Event()

    async def scenario() -> None:
        first = asyncio.create_task(lane.run(release.wait))
        await asyncio.sleep(0.05)
        asyncio.get_running_loop().call_later(0.05, release.set)
        assert await lane.run(lambda: "waited") == "waited" and await first is True
        release.clear()
        held = asyncio.create_task(lane.run(release.wait))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(Overloaded):
            await lane.run(lambda: "never run")
        assert time.monotonic() - started >= 0.5
        release.set()
        await held
        with pytest.raises(KeyError):
            async with lane.slot():
                assert lane.in_flight == 1
                raise KeyError("refused before its job")
        assert lane.in_flight == 0

    try:
        asyncio.run(scenario())
    finally:
        release.set()
