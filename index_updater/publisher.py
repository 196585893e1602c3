"""Publisher: validate, compile and embed ad events, then XADD each to the stream of its shard.

A batch (and a whole file, by `publish_file`) is validated and compiled in full before anything is
written, so a bad event changes nothing. Each shard's part of the batch goes to its stream in one atomic Lua
script that also keeps the shard's owner registry (index_updater/owners.py: its keys share the stream's Redis
Cluster slot, so the shard streams may live on different nodes); on a connection error that part is sent again
(with backoff) until acknowledged, or, for a bounded publisher (`Publisher.bounded`: the router's), within about
`timeout_s` per call, in which a try that timed out is followed by one more. A resend after a lost reply carries the
first try's token, so it returns the ids that try appended and appends nothing twice (a token is kept for
owners.SENT_TTL_S). A batch that spans shards is not atomic across them; each shard's part is.
"""
from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import redis

from andromeda_core.config import Settings
from andromeda_core.errors import InvalidInput
from andromeda_core.ingest import compile_upserts, events_in, prepare_ops
from andromeda_core.models import Scorer
from andromeda_core.schema import Schema
from andromeda_core.sharding import shard_of
from andromeda_core.types import parse_event
from index_updater.clients import redis_client
from index_updater.owners import ADMIN, APPEND, Refused, Writer, claim_of, run_append
from index_updater.records import encode, layout_key, marked_batch, shard_stream, stream_layout, text

DEFAULT_STREAM = Settings.stream
TRANSIENT = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)
FIRST_DELAY_S = 0.05  # retry's first pause
TRY_SHARE = 0.45  # of a bound less FIRST_DELAY_S, one try's wait (try_wait): two tries and the pause between them
# take 0.9 of the bound and 5 ms, the rest is for a timed-out try's own work (the pool, sending, raising); at half the
# bound, a try that timed out never left room for the pause and a resend


def try_wait(timeout_s: float) -> float:
    """How long one try of a bounded publisher (`timeout_s` per call) waits for a connection or for a reply: so long
    that a try that timed out, the pause after it and one more try all fit in `timeout_s`."""
    return TRY_SHARE * (timeout_s - FIRST_DELAY_S)


def retry(call: Callable[[], Any], attempts: int = 60, first_delay: float = FIRST_DELAY_S, max_delay: float = 2.0,
          deadline: float | None = None, try_s: float = 0.0) -> Any:
    """Run `call`, retrying transient Redis errors with exponential backoff; the last error propagates. With a
    `deadline` (time.monotonic()), a try is made again only where the pause before it and the try itself (at most
    `try_s`) end by then."""
    delay = first_delay
    for attempt in range(attempts):
        try:
            return call()
        except TRANSIENT:
            if attempt == attempts - 1 or (deadline is not None and time.monotonic() + delay + try_s > deadline):
                raise
            time.sleep(delay)
            delay = min(max_delay, delay * 2)
    raise AssertionError("unreachable")


def client_wait(client: redis.Redis) -> float | None:
    """The longest `client` waits for a connection or a reply (None: without bound)."""
    kwargs = client.get_connection_kwargs()
    waits = [kwargs.get("socket_timeout"), kwargs.get("socket_connect_timeout")]
    return None if None in waits else max(waits)


class Publisher:
    def __init__(self, client: redis.Redis, schema: Schema, scorer: Scorer, shards: int = 1, stream: str = DEFAULT_STREAM,
                 attempts: int = 60, timeout_s: float | None = None):
        """`attempts`: tries per shard stream on connection errors (60 is about 2 minutes of backoff; an
        HTTP handler wants far fewer). `timeout_s`: each call's Redis work ends within about it (then the last
        redis.RedisError propagates; a hung Redis: redis.TimeoutError), reckoned with what `client` waits per
        connection or reply, which must be at most try_wait(timeout_s) (Publisher.bounded makes such a client); None:
        bounded by `attempts` alone."""
        if shards < 1:
            raise ValueError("shards must be >= 1")
        self.client, self.schema, self.scorer, self.shards, self.stream = client, schema, scorer, shards, stream
        self.attempts, self.timeout_s = attempts, timeout_s
        self.try_s = 0.0  # the longest one try waits, as its client does: what the deadline arithmetic reckons with
        if timeout_s is not None:
            self.try_s = client_wait(client)
            if self.try_s is None or self.try_s > try_wait(timeout_s):
                raise ValueError(f"a publisher bounded by {timeout_s:g} s needs a client that waits at most "
                                 f"{try_wait(timeout_s):.3g} s for a connection or a reply (Publisher.bounded makes "
                                 f"one), not {self.try_s}")
        self._append = client.register_script(APPEND)

    @classmethod
    def bounded(cls, url: str, schema: Schema, scorer: Scorer, timeout_s: float, **kwargs: Any) -> "Publisher":
        """A publisher of `url` each of whose calls ends its Redis work within about `timeout_s`, on a client that
        waits try_wait(timeout_s) for a connection or a reply: a try that found Redis hung is followed by one more."""
        return cls(redis_client(url, try_wait(timeout_s)), schema, scorer, timeout_s=timeout_s, **kwargs)

    def _retry(self, call: Callable[[], Any], deadline: float | None) -> Any:
        """`retry` within the call's deadline: not even a first try where it could end past it (a later shard's part,
        after an earlier one's tries took the time)."""
        if deadline is not None and time.monotonic() + self.try_s > deadline:
            raise redis.TimeoutError(f"the publisher's bound of {self.timeout_s:g} s ran out before this try")
        return retry(call, self.attempts, deadline=deadline, try_s=self.try_s)

    def _deadline(self) -> float | None:
        """The monotonic time by which a call that starts now must end its Redis work (None: no bound)."""
        return None if self.timeout_s is None else time.monotonic() + self.timeout_s

    def publish(self, events: Sequence[dict | str | Any], where: str = "events") -> list[str]:
        """Validate, compile and append events; returns their stream ids. Raises InvalidInput, writing nothing."""
        parsed = [e if hasattr(e, "op") else parse_event(e, f"{where}[{i}]") for i, e in enumerate(events)]
        return self.publish_ops(prepare_ops(self.schema, self.scorer, parsed))

    def publish_ops(self, ops: Sequence, writer: Writer = ADMIN, where: Sequence[str] | None = None,
                    checked: bool = False, on_appended: Callable[[int], None] | None = None) -> list[str]:
        """Append already prepared ops: one atomic script per shard stream (owners.APPEND: the entries and the
        owner registry), each retried until acknowledged. Returns the stream ids in the order of `ops`. For an
        advertiser (`writer`), every shard's part is checked first (check_writer; `checked`: the caller just did,
        before embedding the batch); owners.Refused names the event (`where[i]`, default "[i]") that touches
        another's ad. Only an ad claimed by another writer between that check and its shard's append, or a shard's
        stream failing after others took their parts, can leave the other shards' parts appended (a Refused then says how
        many events were): `on_appended`
        is called with each shard's count as it is acknowledged (what a metric of appended events counts)."""
        where = where or [f"[{i}]" for i in range(len(ops))]
        if writer.advertiser is not None and not checked:
            self.check_writer(ops, writer, where)
        now_ms = int(time.time() * 1000)
        entries = [encode(op, self.shards, self.schema, self.scorer.name, self.scorer.dim, now_ms) for op in ops]
        deadline = self._deadline()  # after the encoding: the bound is the Redis work's alone
        ids = [""] * len(entries)
        token = uuid.uuid4().hex  # the same on every resend of a shard's part (run_append)
        appended = 0
        for stream, positions in self._by_stream(ops).items():
            part = marked_batch([entries[i] for i in positions])  # its last entry ends the part (a replica's read)
            append = partial(run_append, self._append, stream, [ops[i] for i in positions], part, writer,
                             [where[i] for i in positions], token)
            try:
                for i, entry_id in zip(positions, self._retry(append, deadline)):
                    ids[i] = text(entry_id)
            except Refused as refused:
                if not appended:
                    raise
                raise Refused(f"{refused.message}; {appended} event(s) of the batch, on other shards, were appended "
                              "before this ad changed (another write to it since the batch was checked): re-send the "
                              "batch without this event (re-sent events are harmless: they apply by version)",
                              refused.field) from None
            appended += len(positions)
            if on_appended is not None:
                on_appended(len(positions))
        return ids

    def check_writer(self, events: Sequence, writer: Writer, where: Sequence[str]) -> None:
        """owners.Refused naming the first event (ad events or prepared ops) of each shard's part that `writer` may
        not touch; appends nothing. Cheap (no payloads): callers run it before embedding a batch."""
        deadline = self._deadline()
        for stream, positions in self._by_stream(events).items():
            self._retry(partial(run_append, self._append, stream, [events[i] for i in positions], None, writer,
                                [where[i] for i in positions]), deadline)

    def _by_stream(self, events: Sequence) -> dict[str, list[int]]:
        """Shard stream -> positions of the events (ad events or prepared ops) that go to it."""
        by_stream: dict[str, list[int]] = {}
        for i, event in enumerate(events):
            by_stream.setdefault(shard_stream(self.stream, shard_of(claim_of(event)[1], self.shards)), []).append(i)
        return by_stream

    def check_streams(self) -> None:
        """Raise InvalidInput when a shard stream's key holds another Redis type; a connection error is
        retried like a write."""
        names = [shard_stream(self.stream, s) for s in range(self.shards)]
        for name, kind in zip(names, self._retry(partial(self._types, names), self._deadline())):
            kind = text(kind)
            if kind not in ("none", "stream"):
                raise InvalidInput(f"the key {name} holds a Redis {kind}, not a stream", "stream")

    def layout_mismatch(self) -> dict[str, tuple[str, str]]:
        """{field: (what the replicas reading the stream recorded, what this publisher writes)} for each of
        shards, schema, model and dim that differ; {} when they agree or no replica has recorded its layout yet.
        A connection error is retried like a write."""
        recorded = self._retry(lambda: self.client.hgetall(layout_key(self.stream)), self._deadline())
        recorded = {text(k): text(v) for k, v in recorded.items()}
        ours = stream_layout(self.shards, self.schema, self.scorer.name, self.scorer.dim)
        return {field: (recorded[field], value) for field, value in ours.items()
                if field in recorded and recorded[field] != value}

    def _types(self, keys: list[str]) -> list:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.type(key)
        return pipe.execute()

    def publish_file(self, path: str | Path, batch_size: int = 1000,
                     on_batch: Callable[[int], None] | None = None) -> int:
        """Publish a JSONL file in batches. The whole file is validated first: a bad line writes nothing. Both passes
        read the same bytes: a regular file through one handle up to its size when opened (lines appended meanwhile are
        neither checked nor published), anything else (a pipe: `/dev/stdin`; a file that reports no size, as /proc's
        do, which was published as empty) from a private copy (until 2026-12-07 each pass opened the path: the check
        drained a pipe and nothing was published; appended lines went out unchecked)."""
        with open(path, "rb") as source:
            info = os.fstat(source.fileno())
            if stat.S_ISREG(info.st_mode) and info.st_size:
                events, size = source, info.st_size
            else:
                events, size = tempfile.TemporaryFile(), None
                shutil.copyfileobj(source, events)
            with events:
                events.seek(0)
                for batch in events_in(events, str(path), batch_size, limit=size):
                    compile_upserts(self.schema, batch, batch.where)
                events.seek(0)
                total = 0
                for batch in events_in(events, str(path), batch_size, limit=size):
                    total += len(self.publish_ops(prepare_ops(self.schema, self.scorer, batch, batch.where)))
                    if on_batch:
                        on_batch(len(batch))
        return total
