"""Per-replica stream consumer: XREAD its shard's stream (no consumer group: every replica of the
shard sees every entry) from the last applied id, apply each read as one atomic batch, idempotently.

Invalid entries go to the dead-letter stream with the reason (once, whichever replica of the shard meets them first)
and never stop the consumer; an allocation that fails while applying (a table that cannot grow) is no entry's fault,
and the read is applied again after a backoff. The background
loop never dies: every error (Redis, snapshot I/O, ...) is counted in the stats and followed by a
backoff. If the stream was trimmed past the last applied id (a gap), the consumer reloads the newest
snapshot and replays from there; when no snapshot covers the gap it applies what the stream still holds
and reports itself unhealthy until one does. If the stream went back behind what the consumer read (a Redis
that lost acknowledged writes took over, or the stream was recreated: new entries may then take ids at or
before the last applied one), it reads the stream again from its start: applying an entry twice changes
nothing. `health()` tells a replica's probes how the consumer is; `stats.stream_down()` whether it has been unable to
read its stream for longer than a bound (Redis down, hung or refusing it), which the replica reports without failing.
"""
from __future__ import annotations

import hashlib
import logging
from collections import deque
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import redis

from andromeda_core.config import redact, tls_hint
from andromeda_core.errors import out_of_memory
from andromeda_core.export import TableCopy
from andromeda_core.index import AdIndex
from andromeda_core.schema import Schema
from andromeda_core.writer import largest_stored
from index_updater.clients import redis_client
from index_updater.publisher import DEFAULT_STREAM, TRANSIENT, retry
from index_updater.records import (DecodedRead, Entry, EntryDecoder, InvalidRecord, applied_key, dead_letter_stream,
                                   layout_key, shard_stream, snapshot_writer_key, stream_layout, text, whole_batches)
from index_updater.snapshots import SnapshotStore, stream_id_key

log = logging.getLogger(__name__)
MIN_BACKOFF_S, MAX_BACKOFF_S = 0.05, 2.0
WHOLE_BATCH_MAX = 10_000  # a read that holds no batch's end reads on up to this many entries (read_batches): a shard's
# part of a longer batch is applied in parts (the router takes up to 10,000 events a request: max_events_per_request)
REPLY_TIMEOUT_S = 10.0  # consumer_client's bound on a connection or a reply (a read's is milliseconds; XREAD blocks
# for block_ms only)
LAYOUT_TTL_S = 10  # the layout record outlives the replica's last report (every second) by this much
SWEEP_GRACE_S = 3600  # the loop frees the slots of ads that ended this long before Redis's clock: a request as of
# an earlier time (context.ts) up to this much before it is matched exactly, whether or not its replica swept yet
DEAD_LETTERS_KEPT = 100_000  # the dead-letter stream keeps about this many of the newest (XADD MAXLEN ~)
# Dead-letter an entry once, whichever replicas of the shard meet it and however often. KEYS: the dead-letter stream,
# the shard's sorted set of the entries dead-lettered ("<source id> <entry digest>", scored by the id's
# milliseconds: the newest ARGV[2] kept); a key of another type, mangled, counts as none; ARGV: that member, the
# length kept, its score, the record's fields and values. The record is added before the entry is marked: Redis does
# not undo a script's writes when a later command fails, and a mark without its record would never be retried. The digest tells a new entry that a stream gone back
# (went_back) put at an id from the one dead-lettered there before, with nothing to forget at the reset, so a
# replica that notices the reset later adds nothing again.
DEAD_LETTER_ONCE = """
for i, want in ipairs({'stream', 'zset'}) do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= want and kind ~= 'none' then redis.call('DEL', KEYS[i]) end
end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then return false end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -tonumber(ARGV[2]) - 1)
return id
"""
RELEASE_ROUND = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# The stream's state, the entry at the last applied id and the entries after it, read at one moment (a script is
# atomic), for when a MULTI/EXEC cannot: Redis refuses every command queued in one, reads too, once its memory passes
# maxmemory, and a replica must still read (and start) then; and for a stream that does not exist, whose only reply is
# Redis's clock. Only then: converting the replies costs the script 5-8x the Redis time of the transaction.
READ = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {redis.call('TIME')} end
return {redis.call('XINFO', 'STREAM', KEYS[1]), redis.call('XRANGE', KEYS[1], ARGV[1], ARGV[1], 'COUNT', 1),
        redis.call('XREAD', 'COUNT', ARGV[2], 'STREAMS', KEYS[1], ARGV[1]), redis.call('TIME')}
"""


class StreamGap(RuntimeError):
    """Entries after the last applied id were trimmed away; the index must be reloaded from a snapshot."""


def no_stream(exc: Exception) -> bool:
    """Whether a Redis reply error says the stream does not exist (yet)."""
    return isinstance(exc, redis.ResponseError) and "no such key" in str(exc)


def trimmed_past(info: dict, last_id: str) -> str | None:
    """The id up to which a stream (its XINFO STREAM) was trimmed past last_id, or None when it was not.

    Conservative: when anything was removed and the oldest remaining entry is newer than last_id, it is a gap (at
    worst a needless reload from a snapshot, never a lost update). An entry deleted on purpose (XDEL) is not a
    trim: when it is the oldest, the next one counts, so delete only entries every replica has applied."""
    applied = stream_id_key(last_id)
    if info["entries-added"] <= info["length"]:
        return None  # nothing was ever removed
    first = info.get("first-entry")
    oldest = text(first[0] if first else info["last-generated-id"])
    return oldest if stream_id_key(oldest) > applied else None


def entry_digest(fields: dict) -> str:
    """A short hash of a stream entry's fields (bytes or str keys and values), whatever their order."""
    def raw(x: bytes | str) -> bytes:
        return x.encode() if isinstance(x, str) else x

    h = hashlib.blake2b(digest_size=8)
    for key, value in sorted((raw(key), raw(value)) for key, value in fields.items()):
        h.update(len(key).to_bytes(4, "big") + key + len(value).to_bytes(4, "big") + value)
    return h.hexdigest()


def entries_of(reply: list) -> list[Entry]:
    """Stream entries as a script returns them ([id, [field, value, ...]] each) -> [(id, {field: value})], as
    redis-py parses XRANGE and XREAD."""
    return [(entry_id, dict(zip(flat[::2], flat[1::2]))) for entry_id, flat in reply]


def held_digest(reply: list) -> str | None:
    """entry_digest of the entry an XRANGE from one id to the same id replied; None when the stream holds none."""
    return entry_digest(reply[0][1]) if reply else None


def went_back(info: dict, last_id: str, entries_added: int | None, held: str | None, read: str | None) -> str | None:
    """Why a stream (its XINFO STREAM) no longer holds what was read from it up to last_id, or None: its newest id
    is before last_id; or it holds entries up to last_id but not the one read there (held: entry_digest of the
    entry it holds at last_id, None: none), which it did not delete (XDEL; a trim removes only entries before its
    first); or the entry it holds there is not the one read there (read: its entry_digest, None: unknown); or fewer
    entries were ever added to it than when it was last read (entries_added; None: unknown). Either way its entries
    may now take ids at or before last_id, which reading on after it would skip."""
    newest, at = text(info["last-generated-id"]), stream_id_key(last_id)
    if stream_id_key(newest) < at:
        return f"its newest id {newest} is before the last applied id {last_id}"
    first, deleted = info.get("first-entry"), text(info.get("max-deleted-entry-id") or "0-0")
    if first and held is None and stream_id_key(text(first[0])) <= at and stream_id_key(deleted) < at:
        return f"it holds entries up to the last applied id {last_id} but not that one, and deleted none since {deleted}"
    if held is not None and read is not None and held != read:
        return f"the entry it holds at the last applied id {last_id} is not the one read there"
    if entries_added is not None and info["entries-added"] < entries_added:
        return f"{info['entries-added']} entries were ever added to it, where a read saw {entries_added}"
    return None


@dataclass
class ConsumerStats:
    """Metrics hooks: read by the replica's Prometheus exporter and health checks."""

    applied: int = 0  # entries that changed the index
    stale: int = 0  # entries that were no-ops (not newer than the indexed version)
    dead_letters: int = 0  # poison entries met (each recorded once in the dead-letter stream), each counted once
    errors: int = 0  # failed turns of the background loop, each followed by a backoff
    last_error: str = ""
    gap_unrecovered: str = ""  # why the index misses trimmed entries that no snapshot covers; "" when it does not
    newest_published_ms: int = 0  # publish time of the newest applied entry of this shard
    applied_at: float = 0.0  # wall time (s) the newest entry of this shard became servable
    behind_since: float | None = None  # publish time (s) of the oldest entry known to be unapplied; None: caught up
    last_id: str = "0-0"  # in the shard's stream
    caught_up_to: str = ""  # "<ms>-0": Redis's clock, less 1 ms, at the newest read that held nothing past what it
    # applied; every entry with an id up to it is applied (an idle stream's watermark moves on); "" when unknown
    index_size: int = 0
    recoveries: int = 0
    stream_resets: int = 0  # times the stream went back behind what was read (went_back) and was read again
    apply_latency_ms: deque = field(default_factory=lambda: deque(maxlen=100_000))  # published -> servable, ms
    read_at: float = field(default_factory=time.monotonic)  # monotonic time of the last read Redis answered
    reading_since: float | None = None  # monotonic time the read now waiting on Redis began; None: none waits
    read_error: str = ""  # why the latest read of the stream failed; "" when it succeeded

    def watermark(self) -> str | None:
        """The stream id up to which this replica has applied every entry of its stream: the last applied id, or,
        where newer, caught_up_to; None when it knows neither, or misses entries (gap_unrecovered)."""
        if self.gap_unrecovered:
            return None
        marks = [m for m in (self.last_id, self.caught_up_to) if m and m != "0-0"]
        return max(marks, key=stream_id_key) if marks else None

    def lag_seconds(self, now: float | None = None) -> float:
        """How long the oldest entry known to be unapplied has waited; 0 when caught up, so an idle
        stream adds no lag. Entries the consumer cannot read are not known: see stream_down."""
        if self.behind_since is None:
            return 0.0
        return max(0.0, (time.time() if now is None else now) - self.behind_since)

    def read_age_s(self, now: float | None = None) -> float:
        """Seconds since the consumer last read its stream (time.monotonic() `now`): a turn's length while it follows
        the stream, growing while it cannot read it (entries published meanwhile are not applied)."""
        return max(0.0, (time.monotonic() if now is None else now) - self.read_at)

    def stream_down(self, bound_s: float, now: float | None = None) -> str:
        """Why the consumer cannot read its stream, once no read has succeeded for more than bound_s: the latest read
        failed (Redis down or refusing the replica), or one has waited longer than bound_s on Redis (hung, or a
        connection gone silent); "" otherwise, also for a long turn between two reads (a slow apply shows as lag, and
        a replica's start warms its kernels up between its catch-up and its loop's first read)."""
        now = time.monotonic() if now is None else now
        age, error, since = self.read_age_s(now), self.read_error, self.reading_since  # once: the loop's thread moves them
        if age <= bound_s:
            return ""
        if error:
            return f"stream unreachable for {age:.1f} s: {error}"
        if since is not None and now - since > bound_s:
            return f"stream unreachable for {age:.1f} s: a read has waited {now - since:.1f} s for Redis's reply"
        return ""


def describe(exc: Exception) -> str:
    """An error as the consumer's stats show it: its type and message, any credentials in a URL masked, with a hint
    where TLS failed."""
    return redact(f"{type(exc).__name__}: {exc}") + tls_hint(exc)


def index_rejected(exc: Exception) -> InvalidRecord:
    """The dead-letter reason of an entry the index rejected."""
    return InvalidRecord(f"index rejected it: {type(exc).__name__}: {exc}", "entry")


def consumer_client(url: str) -> redis.Redis:
    """The client of a replica's consumer: it waits at most REPLY_TIMEOUT_S for a connection or a reply, so that a hung
    Redis or a connection gone silent (a Redis moved to another address) ends in an error the loop counts and retries
    on a new connection. Set explicitly so that it holds whatever the redis-py version: the pinned 8.1 already gives
    from_url a 5 s socket timeout, but older versions that pyproject allows (redis>=5) have none, and there a silent
    connection would hold the consumer's thread for as long as TCP keeps trying."""
    return redis_client(url, REPLY_TIMEOUT_S)


class ShardConsumer:
    def __init__(self, client: redis.Redis, index: AdIndex, model: str, shard: int = 0, shards: int = 1,
                 stream: str = DEFAULT_STREAM, snapshots: SnapshotStore | None = None, count: int = 2000,
                 block_ms: int = 50, snapshot_every_s: float = 60.0, sweep_every_s: float = 10.0, trim: bool = False,
                 on_applied: Callable[[str], None] | None = None, replica_id: str | None = None,
                 trim_keep_entries: int = 0, trim_every_s: float | None = None, replica_ttl_s: float = 60.0,
                 background_snapshots: bool = True, sweep_grace_s: float = SWEEP_GRACE_S):
        """`trim`: trim the shard's stream (after each snapshot, and every `trim_every_s`) below what the oldest
        kept snapshot covers, what every live replica has applied (`replica_id` registers this one: it reports
        its applied id to `applied_key(stream, shard)`; a report older than `replica_ttl_s` no longer counts)
        and the newest `trim_keep_entries` entries. With a `replica_id`, the background loop writes a snapshot
        only in the rounds (one per `snapshot_every_s`) it claims first among the shard's replicas, which share
        the directory. `background_snapshots`: a thread of their own copies the table (AdIndex.begin_export: the
        bulk while the loop goes on applying, then the rows written meanwhile, between two applies) and writes the
        copy (False: the loop writes them itself, from views of a CPU table, and applies nothing meanwhile; the
        copy costs little more memory, as the vectors' padded rows are copied to be written anyway)."""
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in [0, {shards})")
        reply_s = client.connection_pool.connection_kwargs.get("socket_timeout")
        if reply_s is not None and block_ms / 1000 >= reply_s:  # every idle read would end in a TimeoutError
            raise ValueError(f"block_ms {block_ms} must be shorter than the client's reply timeout ({reply_s} s)")
        self.client, self.index, self.model, self.shard, self.shards = client, index, model, shard, shards
        self.stream, self.source, self.dead_letter_stream = stream, shard_stream(stream, shard), dead_letter_stream(stream)
        self.dead_lettered = f"{self.dead_letter_stream}:{self.source}:once"  # DEAD_LETTER_ONCE's set
        self.snapshots, self.count, self.block_ms = snapshots, count, block_ms
        self.snapshot_every_s, self.sweep_every_s, self.trim = snapshot_every_s, sweep_every_s, trim
        self.sweep_grace_s = sweep_grace_s
        self.on_applied = on_applied
        self.replica_id, self.trim_keep_entries, self.replica_ttl_s = replica_id, trim_keep_entries, replica_ttl_s
        self.trim_every_s = trim_every_s
        self.applied_key, self.writer_key = applied_key(stream, shard), snapshot_writer_key(stream, shard)
        self.background_snapshots = background_snapshots
        self._writer: threading.Thread | None = None  # the snapshot being written in the background, if any
        self._copy: TableCopy | None = None  # the table's copy that writer takes (AdIndex.begin_export)
        self._taken = threading.Event()  # set once the consumer's thread has finished that copy (or dropped it)
        self._taken_state: tuple | None = None  # (state, stream id, metadata) the writer writes; None: nothing
        self._write_failure: Exception | None = None  # how the background write failed (read in the loop's thread)
        self._written: Path | None = None  # the file the background write wrote
        self._writer_resets = 0  # stats.stream_resets when the background write's copy was taken
        self._snapshot_now = False  # the stream went back: a snapshot is written at the next turn, claimed or not
        self._reset_pending = False  # the stream went back: what else that asks (settle_reset) is still to do
        self.trimmed = 0  # entries this consumer trimmed away
        self.stats = ConsumerStats(index_size=len(index))
        self._decoder = EntryDecoder(index.schema, model, index.dim, shard, shards,
                                     largest_stored(index.specs["embedding"].dtype))
        self._dead_letter_once = client.register_script(DEAD_LETTER_ONCE)
        self._release_claim = client.register_script(RELEASE_ROUND)
        self._read = client.register_script(READ)
        self._layout = stream_layout(shards, index.schema, model, index.dim)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._caught_up = False
        self._read_clock: int | None = None  # Redis's clock (ms) at the newest read; None: that read found no stream
        self._gap_snapshot: str | None = None  # newest snapshot when a gap was last found uncovered
        self._entries_added: int | None = None  # the stream's XINFO entries-added at the last read
        self._last_digest: str | None = None  # entry_digest of the entry at stats.last_id, as read; None: unknown
        self._held: tuple | None = None  # (stream id, entries added, digest) of the snapshot being loaded (recover)
        self._from_start = False  # reading the stream again from its start (went_back)
        self._reset_from = "0-0"  # the last id applied before the stream went back (while _from_start): what was
        # trimmed from it up to there this replica applied; what was trimmed past it, it may never have read
        self._met: dict[str, None] = {}  # the poison entries counted in stats.dead_letters (DEAD_LETTER_ONCE's members)

    @property
    def schema(self) -> Schema:
        return self.index.schema

    @property
    def alive(self) -> bool:
        """Whether the background thread is running."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def caught_up(self) -> bool:
        """True once a read came back with fewer than `count` entries (all that was in the stream is
        applied); stays True."""
        return self._caught_up

    def health(self, max_lag_s: float, stream_down_s: float | None = None) -> tuple[bool, str]:
        """(healthy, reason): unhealthy when the thread is not running, the index misses trimmed entries
        that no snapshot covers, or unapplied entries have waited longer than max_lag_s. With `stream_down_s`, a
        stream the consumer has not been able to read for longer (stream_down) is the reason, and the replica stays
        healthy, its lag too: it serves what it applied, and a replacement could not start (it must read the stream
        first)."""
        if not self.alive:
            return False, "consumer thread is not running" + (f"; last error: {self.stats.last_error}"
                                                               if self.stats.last_error else "")
        if self.stats.gap_unrecovered:
            return False, f"the index misses updates no snapshot covers: {self.stats.gap_unrecovered}"
        if stream_down_s is not None and (down := self.stats.stream_down(stream_down_s)):
            return True, down
        lag = self.stats.lag_seconds()
        if lag > max_lag_s:
            return False, f"unapplied entries have waited {lag:.1f}s (more than {max_lag_s:g}s)"
        return True, "ok"

    # -- recovery --------------------------------------------------------------------------------

    def foreign(self, meta: dict) -> dict:
        """What in a snapshot's metadata is not this replica's (model, shard, shard count, stream): such a snapshot is
        neither loaded nor kept nor trimmed to."""
        wanted = {"model": self.model, "shard": self.shard, "shards": self.shards, "stream": self.source}
        return {key: meta.get(key) for key, value in wanted.items() if meta.get(key) != value}

    def recover(self) -> bool:
        """Adopt the newest valid snapshot of this replica's model, shards and stream (others are skipped, and so
        are those of another storage that cannot be converted exactly) and continue from the stream id it covers.
        An index that has applied entries adopts it only when the stream still holds everything after it: a
        snapshot behind a gap would drop what the index applied and still miss the gap."""
        if self.snapshots is None:
            return False
        try:
            for restored, meta in self.snapshots.valid(self.schema, self.index.device, self.foreign, self._hold):
                # one the stream went back from is adopted too: the first read then finds it gone back and reads the
                # whole stream over it
                if restored.dim != self.index.dim:  # its model's name matched: a writer's bug, or a file made by hand
                    log.error("snapshot at %s holds vectors of %d dims, this replica's model %d; skipping it",
                              meta["stream_id"], restored.dim, self.index.dim)
                    continue
                converted = restored.in_storage_of(self.index)
                if converted is None:
                    log.error("snapshot at %s has storage %s, this replica stores %s; skipping it",
                              meta.get("stream_id"), restored.storage, self.index.storage)
                    continue
                if self.stats.last_id != "0-0" and (gap := self.gap_after(meta["stream_id"])):
                    log.error("the newest snapshot covers %s, but the stream lost entries up to %s after it; keeping "
                              "the index", meta["stream_id"], gap)
                    return False
                if stream_id_key(meta["stream_id"]) < stream_id_key(self.stats.last_id):  # searches read last_id as
                    self.stats.last_id = meta["stream_id"]  # the state they saw: never newer than it, before adopt or after
                self.stats.caught_up_to = ""  # nor this: the entries after the snapshot are not applied yet
                self.index.adopt(converted)
                self.stats.last_id, self.stats.index_size = meta["stream_id"], len(self.index)
                self._entries_added, self._from_start = meta.get("entries_added"), False  # as the stream was then
                self._last_digest = meta.get("entry_digest")
                self.stats.recoveries += 1
                return True
            return False
        finally:
            self._held = None

    def gap_after(self, last_id: str) -> str | None:
        """trimmed_past of the shard's stream now; None when there is no stream yet."""
        info = self.stream_info()
        return None if info is None else trimmed_past(info, last_id)

    def stream_info(self) -> dict | None:
        """XINFO STREAM of the shard's stream; None when there is no stream yet."""
        try:
            return self.client.xinfo_stream(self.source)
        except redis.ResponseError as exc:
            if no_stream(exc):
                return None
            raise

    # -- consuming -------------------------------------------------------------------------------

    def read_batches(self) -> tuple[list[Entry], bool]:
        """read(), ending at a published batch's end, so that one apply takes a batch's whole part of this shard and
        no search sees part of it: the entries after the read's last batch end wait for the next read, and a full read
        that holds none reads on from its last entry, as many entries again, until one ends a part or it holds
        WHOLE_BATCH_MAX. Returns (the entries, whether the stream held more than were read: a read short of what it
        asked took all there was, whole parts, as each is appended at once). Should the stream change under a read
        going on (trimmed, or gone back: the entry it goes on from is no longer there as read), what was read is
        returned as it is, and the next read() finds what happened."""
        entries, asked = self.read(), self.count
        while len(entries) == asked:
            if ended := whole_batches(entries):
                return entries[:ended], True
            if asked >= WHOLE_BATCH_MAX:
                return entries, True
            more = min(asked, WHOLE_BATCH_MAX - asked)
            fetched = self._fetch(text(entries[-1][0]), more)
            if fetched is None or held_digest(fetched[1]) != entry_digest(entries[-1][1]):
                return entries, True
            entries, asked = entries + fetched[2], asked + more
            self._read_clock = self._clock(fetched[3])
        return entries, False

    def _fetch(self, after: str, count: int) -> tuple[dict, list, list[Entry], list] | None:
        """(the stream's XINFO STREAM, the XRANGE reply at `after`, at most `count` entries after it, Redis's TIME),
        read at one moment: in one transaction, or, when Redis is full (it refuses MULTI then), one script (READ).
        None: there is no stream (self._read_clock is then Redis's clock)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xinfo_stream(self.source)
        pipe.xrange(self.source, min=after, max=after, count=1)
        pipe.xread({self.source: after}, count=count)
        pipe.time()
        with self._reading():
            try:
                info, at_last, reply, clock = pipe.execute()
            except redis.ResponseError as exc:  # Redis is full (its MULTI refused), or there is no stream
                if not isinstance(exc, (redis.exceptions.OutOfMemoryError, redis.exceptions.ExecAbortError)) \
                        and not no_stream(exc):
                    raise
                state = self._read(keys=[self.source], args=[after, count])  # Redis is full, or no stream:
                if len(state) == 1:  # READ, which also tells the clock of a stream that does not exist (holding
                    self._read_clock = self._clock(state[0])  # nothing unapplied; one created again later is a reset,
                    return None  # by its entries-added)
                info = {text(key): value for key, value in zip(state[0][::2], state[0][1::2])}  # as redis-py parses it
                at_last, reply = entries_of(state[1]), [(name, entries_of(read)) for name, read in state[2] or []]
                clock = state[3]
        return info, at_last, reply[0][1] if reply else [], clock

    def read(self) -> list[Entry]:
        """The next entries of the shard's stream after the last applied id, at most `count`, without waiting.
        Read with the stream's state at one moment (_fetch), so that no trim can slip between the two: StreamGap when
        entries after the last applied id were trimmed away before this read (unless the index already misses
        updates: it then applies what the stream still holds). When the stream went back (went_back), the read starts
        again from its first entry."""
        last_id = self.stats.last_id
        self._read_clock = None
        fetched = self._fetch(last_id, self.count)
        if fetched is None:
            return []
        info, at_last, entries, clock = fetched
        if reason := went_back(info, last_id, self._entries_added, held_digest(at_last), self._last_digest):
            log.error("shard %d: the stream went back (%s): reading it again from its start. Entries applied here "
                      "that it lost stay applied; other replicas may lack them: republish what was published just "
                      "before", self.shard, reason)
            self.stats.stream_resets += 1
            if not self._from_start:
                self._reset_from = last_id
            self.stats.last_id, self._entries_added, self._from_start = "0-0", None, True
            self.stats.caught_up_to, self._last_digest = "", None  # the stream may now hold new entries before it
            self._reset_pending = True  # settle_reset, at the end of catch_up and at each turn of the loop
            return self.read()
        self._entries_added = info["entries-added"]
        if not self.stats.gap_unrecovered:  # else it applies what the stream still holds
            if self._from_start:
                if gap := trimmed_past(info, self._reset_from):
                    self._missed_after_reset(gap)
            elif gap := trimmed_past(info, self.stats.last_id):
                raise self.gap_error(gap)
        self._read_clock = self._clock(clock)
        return entries

    @staticmethod
    def _clock(time_reply: list | tuple) -> int:
        """Redis's TIME (seconds, microseconds) in milliseconds: its clock as it made the read."""
        return int(time_reply[0]) * 1000 + int(time_reply[1]) // 1000

    def _missed_after_reset(self, gap: str) -> None:
        """The stream it went back to was trimmed up to `gap`, past the last id applied before: entries added since
        (a recreated stream's, say) may have been trimmed unread here. The index misses them until a snapshot newer
        than the newest now covers them (the newest may be one the stream went back from, set aside only after this
        read); meanwhile it applies what the stream holds and writes no snapshot."""
        self.stats.gap_unrecovered = (f"the stream went back, and was trimmed up to {gap}, past the last id applied "
                                      f"before ({self._reset_from})")
        self._gap_snapshot = self._newest_snapshot()
        log.error("shard %d: %s; the index misses those updates until a newer snapshot covers them", self.shard,
                  self.stats.gap_unrecovered)

    @contextmanager
    def _reading(self) -> Iterator[None]:
        """Around each read of the shard's stream: the stats tell whether it succeeded and since when one waits
        (stream_down)."""
        stats = self.stats
        stats.reading_since = time.monotonic()
        try:
            yield
        except Exception as exc:
            stats.read_error = describe(exc)
            raise
        else:
            stats.read_at, stats.read_error = time.monotonic(), ""
        finally:
            stats.reading_since = None

    def held_at(self, stream_id: str) -> str | None:
        """entry_digest of the entry the shard's stream holds at stream_id; None when it holds none."""
        return held_digest(self.client.xrange(self.source, min=stream_id, max=stream_id, count=1))

    def went_back_from(self, info: dict | None, stream_id: str, entries_added: int | None, digest: str | None) -> bool:
        """went_back of the shard's stream (info: its XINFO STREAM, None when there is none), for a position read at
        stream_id (a snapshot's, a replica's), the entry read there of entry_digest `digest` (None: unknown)."""
        return info is not None and went_back(info, stream_id, entries_added, self.held_at(stream_id),
                                              digest) is not None

    def settle_reset(self) -> None:
        """After the stream went back: set aside the snapshots it went back from (they claim ids its new entries may
        take) and ask for a snapshot. Retried at each turn until it succeeds; until then, and until that snapshot is
        written, nothing is trimmed."""
        if not self._reset_pending:
            return
        if self.snapshots is not None:
            info = self.stream_info()
            if stale := self.snapshots.set_aside(
                    lambda meta: not self.foreign(meta) and self.went_back_from(  # (another deployment's: not ours
                        info, meta["stream_id"], meta.get("entries_added"), meta.get("entry_digest"))):  # to judge)
                log.error("shard %d: set aside the snapshots the stream went back from: %s", self.shard, stale)
            self._snapshot_now = True
        self._reset_pending = False

    def _settle_reset_counted(self, retried: bool = False) -> None:
        """settle_reset (through retry when `retried`); a failure (an unwritable snapshot folder, say) is counted and
        left to the next turn of the loop, and what called it goes on."""
        try:
            retry(self.settle_reset) if retried else self.settle_reset()
        except Exception as exc:
            self._count_error(exc, "setting the stale snapshots aside again next turn")

    def gap_error(self, gap: str) -> StreamGap:
        """The StreamGap of a stream trimmed up to `gap`, past what this replica applied."""
        return StreamGap(f"stream trimmed up to {gap}, past the last applied id {self.stats.last_id}")

    def poll(self, block_ms: int | None = None) -> int:
        """Read the next whole batches of the shard's stream (read_batches; waiting up to block_ms for one) and apply
        them; returns how many entries were applied."""
        block = self.block_ms if block_ms is None else block_ms
        entries, more = self.read_batches()
        if not entries and block:
            with self._reading():
                waited = self.client.xread({self.source: self.stats.last_id}, count=1, block=block)
            if waited:
                entries, more = self.read_batches()  # the wait's own reply is not checked for a gap: read again
        newest = self._apply_read(entries) if entries else None
        if not more:  # the stream held no more than this read
            self.stats.behind_since, self._caught_up = None, True
            if self._read_clock is not None and not self.stats.gap_unrecovered:  # a later entry's id is past the
                # read's clock (Redis ids entries by its clock, assumed not to step back): up to 1 ms before it, every
                # entry was in the read
                self.stats.caught_up_to = f"{self._read_clock - 1}-0"
        else:  # more may wait, published no earlier than this read's newest (None: read again, not lag)
            self.stats.behind_since = newest
        return len(entries)

    def _apply_read(self, entries: list[Entry]) -> float | None:
        """Decode, dead-letter and apply one read; returns the newest publish time (s) among its entries, None for a
        read of a stream gone back that ends at or before the last id applied before (read again: not lag)."""
        read = self._decoder.decode(entries)
        now_ms = time.time() * 1000
        reset = stream_id_key(self._reset_from)  # entries up to it, read again after the stream went back, are not
        # lag (every replica re-reads at once after a failover: counted, it made them all unhealthy, and Serve
        # replaced them all)
        again = stream_id_key(text(entries[-1][0])) <= reset
        fresh = [ms for i, ms in zip(read.positions, read.published_ms) if stream_id_key(text(entries[i][0])) > reset]
        self.stats.behind_since = None if again else min(fresh, default=now_ms) / 1000  # these wait until applied
        results, rejected = self._apply(read)
        for position, exc in sorted([*read.dead, *rejected], key=lambda dead: dead[0]):  # in stream order
            self._dead_letter(entries[position], exc)
        servable_ms = time.time() * 1000
        last = entries[-1][0]
        self.stats.last_id, self._from_start = text(last), False
        self._last_digest = entry_digest(entries[-1][1])
        self.stats.applied += sum(results)
        self.stats.stale += len(results) - sum(results)
        self.stats.index_size = len(self.index)
        if read.published_ms:
            self.stats.newest_published_ms = max(self.stats.newest_published_ms, max(read.published_ms))
            self.stats.applied_at = servable_ms / 1000
            self.stats.apply_latency_ms.extend(servable_ms - p for p in read.published_ms)
        if self.on_applied:
            self.on_applied(self.stats.last_id)
        return None if again else max(fresh, default=now_ms) / 1000

    def _apply(self, read: DecodedRead) -> tuple[list[bool], list[tuple[int, InvalidRecord]]]:
        """Apply the read as one atomic batch. Should the index reject it, the entries whose rows it refuses are set
        aside and the rest applied as one batch, so that scans see no part of a part (a batch of the publisher's); should
        that fail too, or no row be refused, its entries are applied one by one. Returns the results and (position in
        the read, why) of the entries the index rejected (a rejected op changes nothing). Memory running out
        (out_of_memory) is no entry's fault: it is raised, so the read is applied again after the loop's backoff
        (what was applied of it, again: that changes nothing), its entries waiting meanwhile (the replica turns
        unhealthy once they have waited longer than its lag allows)."""
        if not len(read.batch):
            return [], []
        try:
            return self.index.apply(read.batch), []
        except Exception as exc:  # a decoded entry the index still cannot take must not stop the consumer
            if out_of_memory(exc):
                raise
            log.exception("batch apply failed; applying it without the entries the index refuses")
        refused = self.index.refusals(read.batch)
        rejected = [(read.positions[i], index_rejected(exc)) for i, exc in refused.items()]
        if refused:
            try:
                return self.index.apply(read.batch.take([i for i in range(len(read.batch)) if i not in refused])), rejected
            except Exception as exc:
                if out_of_memory(exc):
                    raise
                log.exception("batch apply failed without the entries the index refuses; applying them one by one")
        results, rejected = [], []
        for i, position in enumerate(read.positions):
            try:
                results.extend(self.index.apply(read.batch.take([i])))
            except Exception as exc:
                if out_of_memory(exc):
                    raise
                rejected.append((position, index_rejected(exc)))
        return results, rejected

    def _dead_letter(self, entry: Entry, exc: InvalidRecord) -> None:
        entry_id, fields = entry
        entry_id = text(entry_id)
        record = {"source_id": entry_id, "stream": self.source, "reason": exc.message, "field": exc.field or "",
                  "shard": self.shard, "event": fields.get(b"event", b"")}
        member = f"{entry_id} {entry_digest(fields)}"
        args = [member, DEAD_LETTERS_KEPT, stream_id_key(entry_id)[0], *(x for item in record.items() for x in item)]
        try:
            retry(lambda: self._dead_letter_once(keys=[self.dead_letter_stream, self.dead_lettered], args=args))
        except redis.exceptions.OutOfMemoryError as full:  # a full Redis takes no record: the entry is still set
            self._count_error(full, f"{entry_id} is set aside without a dead-letter record")  # aside, the read
            # goes on (a record it could not write would otherwise stop the replica at the entry)
        if member not in self._met:  # read again (the stream went back, say), it is not a new one: the metric and
            self._met[member] = None  # its alert count each once
            if len(self._met) > DEAD_LETTERS_KEPT:
                del self._met[next(iter(self._met))]
            self.stats.dead_letters += 1
        log.warning("dead-lettered %s: %s", entry_id, exc)

    def catch_up(self) -> None:
        """Apply everything already in the stream (returns once a read comes back empty); StreamGap when entries
        it needed were trimmed away."""
        while retry(lambda: self.poll(block_ms=0)):
            pass
        self._settle_reset_counted(retried=True)  # the index is complete: a failure here waits for the loop's turn
        try:
            retry(self.report_applied)  # registered before it serves: trimming now waits for this replica
        except redis.exceptions.OutOfMemoryError as exc:  # a full Redis refuses the report: serve what was read, and
            self._count_error(exc, "reporting again each second")  # report from the loop once it takes writes

    def snapshot(self) -> None:
        """Write a snapshot now (then, with `trim`, trim the shard's stream up to what the oldest kept one covers).
        Not while the index misses updates after an uncovered gap: it must not pass for a complete index."""
        taken = self._snapshot_state()
        if taken is not None:
            self._write_snapshot(*taken)

    def _snapshot_state(self, copy: TableCopy | None = None) -> tuple[tuple, str, dict] | None:
        """(the index's exported state: views of a CPU table, or `copy` finished; the stream id it covers; the
        snapshot's metadata), or None when no snapshot is to be written. Called in the consumer's thread, so
        that the two agree."""
        if self.snapshots is None:
            return None
        if self.stats.gap_unrecovered:
            log.warning("shard %d: no snapshot while the index misses updates", self.shard)
            return None
        state = self.index.export_state() if copy is None else self.index.finish_export(copy)
        return None if state is None else (state, self.stats.last_id, {
            "shard": self.shard, "shards": self.shards, "model": self.model, "stream": self.source,
            "entries_added": self._entries_added, "entry_digest": self._last_digest})

    def _write_snapshot(self, state: tuple, stream_id: str, metadata: dict) -> None:
        """Write it, then trim with `trim`; a failure gives the round back (another replica may write it) and raises."""
        try:
            self.snapshots.write_state(state, stream_id, metadata, self.foreign)
        except Exception:
            self._give_back_round()
            raise
        self._snapshot_written()

    def _snapshot_written(self) -> None:
        """A snapshot of the stream as it is now was written: the one a reset asked for is done; with `trim`, trim."""
        self._snapshot_now = False
        if self.trim:
            self.trim_stream()

    def _give_back_round(self) -> None:
        if self.replica_id is not None:
            retry(lambda: self._release_claim(keys=[self.writer_key], args=[self.replica_id]))

    def _snapshot_round(self, claim: bool = True) -> None:
        """The background loop's snapshot: none while the last one is still being written, or (with `claim`) when
        another replica of the shard claimed this round; in a thread of its own with background_snapshots."""
        if self._writer is not None:
            log.warning("shard %d: the last snapshot is still being written; skipping this round", self.shard)
            return
        if self.snapshots is None or self.stats.gap_unrecovered or self._stop.is_set():
            return  # would write none: the round stays for a replica that can
        if claim and self.replica_id is not None and not self.client.set(
                self.writer_key, self.replica_id, nx=True, px=max(1, int(self.snapshot_every_s * 1000))):
            return  # another replica of the shard writes this round's
        if not self.background_snapshots:
            self.snapshot()
            return
        try:
            self._copy, self._taken, self._taken_state = self.index.begin_export(), threading.Event(), None
            self._writer = threading.Thread(target=self._write_in_background, args=(self._copy, self._taken),
                                            daemon=True, name=f"snapshot-shard-{self.shard}")
            self._writer.start()
        except BaseException:
            self._writer = None
            self._drop_background_copy()
            self._give_back_round()
            raise

    def _write_in_background(self, copy: TableCopy, taken: threading.Event) -> None:
        """The writer thread: the table's bulk copy, then (once the consumer's thread has finished the copy,
        take_background_copy, and set `taken`) the file; the consumer's thread does the rest
        (finish_background_write)."""
        try:
            copy.copy_bulk()
            taken.wait()
            if self._taken_state is not None:
                self._written = self.snapshots.write_state(*self._taken_state, self.foreign)
        except Exception as exc:
            self._write_failure = exc

    def _drop_background_copy(self) -> None:
        """The writer writes nothing (if it waits for the copy) and the index stops noting slots for it."""
        if self._copy is not None:
            self.index.cancel_export(self._copy)
        self._copy = None
        self._taken.set()

    def take_background_copy(self) -> None:
        """In the consumer's thread, between two applies, once the background copy's bulk is copied: finish it
        (only the rows written since are copied, under the table's lock: the pause of the updates) with the
        stream id and metadata it covers, for the writer thread to write; nothing to write when the index misses
        updates now or was replaced (recovered) meanwhile."""
        if self._writer is None or self._taken.is_set() or not (self._copy.bulk_done or not self._writer.is_alive()):
            return
        taken = None
        try:  # once: a second finish would miss the batches applied after the first
            taken = self._snapshot_state(self._copy) if self._copy.bulk_done else None
        finally:
            self._taken_state, self._writer_resets = taken, self.stats.stream_resets
            self._drop_background_copy()

    def finish_background_write(self) -> None:
        """In the consumer's thread: take_background_copy, then once the background write is over what
        _snapshot_written does; if it failed, the round given back and the failure raised (the loop counts it in
        stats.errors); if nothing was to be written, the round given back; if the stream went back since its copy
        was taken, the snapshot set aside (it covers the stream as it was)."""
        self.take_background_copy()
        if self._writer is None or self._writer.is_alive():
            return
        self._writer, failure, self._write_failure = None, self._write_failure, None
        written, self._written, self._taken_state = self._written, None, None
        if failure is not None:
            self._give_back_round()
            raise RuntimeError(f"writing a snapshot failed: {type(failure).__name__}: {failure}") from failure
        if written is None:
            self._give_back_round()
            return
        if self.stats.stream_resets != self._writer_resets:
            self.snapshots.set_aside_file(written)
            log.error("shard %d: the stream went back while a snapshot was written; set it aside: %s", self.shard,
                      written.name)
            return
        self._snapshot_written()

    def report_applied(self) -> None:
        """Tell the shard's other replicas (and their trimming) how far this one has applied (while it loads a
        snapshot, the position that snapshot covers: what it will go on from)."""
        if self.replica_id is not None:
            position, entries_added, digest = self._held or (self.stats.last_id, self._entries_added, self._last_digest)
            self.client.hset(self.applied_key, self.replica_id,
                             f"{position} {self._redis_now():.3f} {entries_added or ''} {digest or ''}")

    def clock_s(self) -> int:
        """Redis's clock (s) as this replica last read its stream (its own where it has not read yet): what a shard
        judges ads' ends by, one clock for every replica."""
        return self._read_clock // 1000 if self._read_clock is not None else int(time.time())

    def _redis_now(self) -> float:
        """Redis's clock (s): reports are stamped and judged by it, one clock for every replica (by their own, a
        replica a minute slow counted as gone, and the stream was trimmed past what it still needed)."""
        return self._clock(self.client.time()) / 1000

    def _hold(self, meta: dict) -> None:
        """Before a snapshot (its caller metadata) is loaded: report its position, so that no running replica trims
        what this one will replay after it; until the load ends (recover)."""
        self._held = (meta["stream_id"], meta.get("entries_added"), meta.get("entry_digest"))
        try:
            self.report_applied()
        except redis.RedisError as exc:  # the load goes on; the start's heartbeat (starting) reports again
            self._count_error(exc, "reporting the snapshot loaded again within a second")

    @contextmanager
    def starting(self) -> Iterator[None]:
        """Around a replica's start (recover, catch_up and whatever precedes its loop, which then reports): report
        every second how far it has come, so that the running replicas trim nothing it still needs. A start longer
        than their snapshot rounds (a large snapshot on a slow volume) was trimmed past, failed, and failed again."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(1.0):
                try:
                    self.report_applied()
                except Exception as exc:  # Redis down: the start itself will meet it
                    log.warning("shard %d: reporting the start's position failed: %s", self.shard, describe(exc))

        beating = threading.Thread(target=beat, name=f"start-report-{self.shard}", daemon=True)
        beating.start()
        try:
            yield
        finally:
            stop.set()
            beating.join()

    def record_layout(self) -> None:
        """Tell publishers what this replica applies (stream_layout), for LAYOUT_TTL_S: a service that stopped
        (or changed its layout) no longer binds them once that passes."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(layout_key(self.stream), mapping=self._layout)
        pipe.expire(layout_key(self.stream), LAYOUT_TTL_S)
        pipe.execute()

    def trim_point(self) -> str | None:
        """The stream id below which no index needs the shard's entries: the least of what the oldest kept
        snapshot covers, what this and every live registered replica has applied, and the first of the
        newest `trim_keep_entries`; None when nothing may be trimmed: no snapshot yet, or the stream went back
        and not every live replica has read it again (its applied id is of the stream as it was) or this one has
        not yet written the snapshot that asks."""
        oldest = self.snapshots.oldest_stream_id(self.foreign) if self.snapshots is not None else None
        if oldest is None or self.stats.last_id == "0-0" or self._reset_pending or self._snapshot_now:
            return None
        points = [oldest, self.stats.last_id]
        now, info = self._redis_now(), self.stream_info()
        for replica, value in self.client.hgetall(self.applied_key).items():
            last_id, at, entries_added, digest = (value.decode().split(" ") + ["", "", ""])[:4]
            if now - float(at or 0) > self.replica_ttl_s:  # gone: a replica that comes back loads a snapshot
                self.client.hdel(self.applied_key, replica)
            elif self.went_back_from(info, last_id, int(entries_added) if entries_added else None, digest or None):
                return None
            else:
                points.append(last_id)
        if self.trim_keep_entries:
            kept = self.client.xrevrange(self.source, count=self.trim_keep_entries)
            if len(kept) < self.trim_keep_entries:
                return None
            first = kept[-1][0]
            points.append(text(first))
        return min(points, key=stream_id_key)

    def trim_stream(self) -> int:
        """XTRIM MINID the shard's stream to `trim_point()`; returns the entries removed."""
        point = retry(self.trim_point)
        if point is None:
            return 0
        removed = retry(lambda: self.client.xtrim(self.source, minid=point, approximate=False))
        self.trimmed += removed
        if removed:
            log.info("shard %d: trimmed %d entries below %s", self.shard, removed, point)
        return removed

    # -- background loop -------------------------------------------------------------------------

    def run(self) -> None:
        """Consume until stop(): poll, sweep expired ads, snapshot periodically. Never dies: a failed turn
        is counted (stats.errors, stats.last_error) and the loop goes on after a backoff."""
        now = time.monotonic()
        due = {"sweep": now + self.sweep_every_s, "snapshot": now + self.snapshot_every_s, "report": now,
               "trim": now + (self.trim_every_s or self.snapshot_every_s)}
        backoff = MIN_BACKOFF_S
        while not self._stop.is_set():
            try:
                self._turn(due)
                backoff = MIN_BACKOFF_S
            except Exception as exc:
                self._count_error(exc, f"retrying in {backoff:.2f}s")
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _count_error(self, exc: Exception, then: str) -> None:
        """A failure the loop recovers from: counted in stats.errors, shown by /readyz (stats.last_error), logged."""
        self.stats.errors += 1
        self.stats.last_error = describe(exc)
        log.warning("shard %d consumer: %s; %s", self.shard, self.stats.last_error, then,
                    exc_info=not isinstance(exc, TRANSIENT))

    def _turn(self, due: dict[str, float]) -> None:
        """One turn of the loop: poll (recovering from a gap), and the sweep and snapshot when due."""
        # a replica that misses updates tries again once a new snapshot appears (a healthy replica wrote one, say)
        if self.stats.gap_unrecovered and self._newest_snapshot() != self._gap_snapshot:
            self._recover_from(StreamGap(self.stats.gap_unrecovered))
        try:
            self.poll()
        except StreamGap as gap:
            self._recover_from(gap)
        now = time.monotonic()
        if now >= due["sweep"]:
            due["sweep"] = now + self.sweep_every_s  # first: a sweep that fails waits for its next turn
            if self._read_clock is not None:  # by Redis's clock, one for every replica: a replica's own, an hour
                # fast, freed live ads, and its snapshots spread the loss to every replica that loaded them
                self.index.sweep_expired(int(self._read_clock // 1000 - self.sweep_grace_s))
        self._settle_reset_counted()
        self.finish_background_write()
        if self.snapshots is not None and (now >= due["snapshot"] or (self._snapshot_now and self._writer is None)):
            due["snapshot"] = now + self.snapshot_every_s
            due["trim"] = now + (self.trim_every_s or self.snapshot_every_s)
            try:
                self._snapshot_round(claim=not self._snapshot_now)  # a reset's stays asked for until one is written
            except redis.exceptions.OutOfMemoryError as exc:  # a full Redis refuses the claim: trimming, next, frees memory
                self._count_error(exc, "the snapshot waits for its next round")
        if self.trim and now >= due["trim"]:
            due["trim"] = now + (self.trim_every_s or self.snapshot_every_s)
            self.trim_stream()
        if now >= due["report"]:
            due["report"] = now + 1.0
            self.report_applied()
            self.record_layout()

    def _recover_from(self, gap: StreamGap) -> None:
        """Reload the newest snapshot; if none covers the gap, go on with what the stream still holds and
        stay unhealthy (stats.gap_unrecovered) until one does."""
        log.error("shard %d: %s; reloading the newest snapshot", self.shard, gap)
        self._gap_snapshot = self._newest_snapshot()
        if self.recover():
            still = self.gap_after(self.stats.last_id)
            if not still:
                self.stats.gap_unrecovered = ""
                return
            gap = self.gap_error(still)
        self.stats.gap_unrecovered = str(gap)  # (no watermark meanwhile: ConsumerStats.watermark)
        log.error("shard %d: no snapshot covers the gap; the index misses those updates until one does", self.shard)

    def _newest_snapshot(self) -> str | None:
        """The name of the newest of this replica's own snapshots (another deployment's do not count); None: none."""
        paths = self.snapshots.own(self.foreign) if self.snapshots is not None else []
        return paths[0].name if paths else None

    def start(self) -> "ShardConsumer":
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=f"consumer-shard-{self.shard}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        self._drop_background_copy()  # a copy the loop will not finish: its writer writes nothing
        if self._writer:
            self._writer.join(timeout=10)
