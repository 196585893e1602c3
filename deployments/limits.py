"""Input limits, request rate and overload guards of the ingress (ServiceConfig.limits / rate_limit /
overload). Each refusal is an error naming the field (or header) and the limit."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import math
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Sequence, TypeVar

from andromeda_core.errors import InvalidInput, Overloaded
from andromeda_core.schema import attribute_values
from andromeda_core.types import RetrieveRequest
from deployments.config import Limits


def check_requests(limits: Limits, requests: Sequence[RetrieveRequest], where: str) -> None:
    """Raise InvalidInput (field path, limit name) for the first request past a limit; `where` formats the
    position of request i (e.g. "[{}]." for a batch)."""
    for i, r in enumerate(requests):
        at = where.format(i)
        if r.k > limits.k:
            raise InvalidInput(over_limit(limits, "k", "", r.k), f"{at}k")
        user = r.user
        for name, items in (("history", user.history), ("co_engagement", user.co_engagement),
                            ("cohorts", user.cohorts)):
            if len(items) > getattr(limits, name):
                raise InvalidInput(over_limit(limits, name, " entries", len(items)), f"{at}user.{name}")
        check_values(limits, user.attributes, f"{at}user.attributes")
        check_values(limits, r.context.targeting_values(), f"{at}context")
        for j, c in enumerate(user.co_engagement):
            check_chars(limits, c.surface, f"{at}user.co_engagement[{j}].surface")


def check_values(limits: Limits, values: dict, field: str) -> None:
    """Targeting values by category (`user.attributes`, or the request's `context`): string values of at most
    limits.string_chars characters, at most limits.values_per_category values per category. (A category name is
    checked against the schema, and an error echoes at most errors.ECHOED_CHARS of it.)"""
    for category, value in values.items():
        held = attribute_values(value)
        if len(held) > limits.values_per_category:
            raise InvalidInput(over_limit(limits, "values_per_category", " values", len(held)), f"{field}.{category}")
        for j, v in enumerate(held):
            check_chars(limits, v, f"{field}.{category}" + (f"[{j}]" if isinstance(value, list) else ""))


def check_chars(limits: Limits, value: object, field: str) -> None:
    if isinstance(value, str) and len(value) > limits.string_chars:
        raise InvalidInput(over_limit(limits, "string_chars", " characters", len(value)), field)


WIRE_BOUNDS = {("k", "less_than_equal"): ("k", ""), ("user.history", "too_long"): ("history", " entries"),
               ("user.cohorts", "too_long"): ("cohorts", " entries"),
               ("user.co_engagement", "too_long"): ("co_engagement", " entries"),
               ("body", "too_long"): ("batch_requests", " requests")}  # the only body with a bounded length
"""(field path, pydantic error type) -> (limit, unit): where the wire type's own bound is the largest that limit may be
set to, so a value past the bound is past the limit too."""


def past_wire_bound(limits: Limits, field: str, error_type: str, value: object) -> str | None:
    """The message naming the limit for a request field that failed its wire type's bound (`field` as error_field
    gives it, "[i]." first in a batch), or None when that bound is no limit's."""
    limit = WIRE_BOUNDS.get((re.sub(r"^\[\d+\]\.", "", field), error_type))
    if limit is None:
        return None
    return over_limit(limits, *limit, len(value) if isinstance(value, (list, dict)) else value)


def over_limit(limits: Limits, name: str, unit: str, got: object) -> str:
    """The message of a value past limits.<name>, e.g. "at most 256 characters (limits.string_chars), got 300"."""
    return f"at most {getattr(limits, name)}{unit} (limits.{name}), got {got}"


class TokenBuckets:
    """One token bucket per caller: `burst` requests at once, refilled at `rate` per second; the least
    recently seen callers are dropped past `callers` buckets (a dropped caller starts full again)."""

    def __init__(self, rate: float, burst: int, callers: int = 100_000):
        self.rate, self.burst, self.callers = rate, burst, callers
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # caller -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, caller: str, now: float | None = None) -> float:
        """0 when `caller` may go on (one token taken), else the seconds until a token is back."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, at = self._buckets.pop(caller, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - at) * self.rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            self._buckets[caller] = (tokens - 1 if wait == 0 else tokens, now)
            while len(self._buckets) > self.callers:
                self._buckets.popitem(last=False)
            return wait


class Admission(enum.Enum):
    """LatencyShedder.admit's answer; true when the request may start."""

    REFUSED = 0
    ADMITTED = 1
    PROBE = 2  # admitted while refusing others, to see whether the queue drained

    def __bool__(self) -> bool:
        return self is not Admission.REFUSED


class LatencyShedder:
    """CoDel's signal on one router's retrievals: when every retrieval completed over the last `interval_s` took
    longer than `target_s`, a queue stands in front of the work (a request that found none would have been
    fast), so new retrievals are refused (503) until one completes within the target or none is left in
    flight. Admitted requests then stay near the target instead of waiting out the queue. While it refuses, one
    retrieval an interval goes through as a probe: refused retrievals never complete, so without it a long one
    still in flight would keep the router refusing after the queue drained. target_s 0: off."""

    def __init__(self, target_s: float, interval_s: float):
        self.target_s, self.interval_s = target_s, interval_s
        self.shedding = False
        self._slow_since: float | None = None  # first completion over the target since the last fast one
        self._probed_at = -math.inf  # when the last probe went through (or the shedding began)

    def admit(self, inflight: int, now: float | None = None) -> Admission:
        """Whether a new retrieval may start (`inflight`: this router's retrievals now in flight)."""
        now = time.monotonic() if now is None else now
        if inflight == 0:  # nothing queued: start over
            self.shedding, self._slow_since = False, None
        elif self.shedding and now - self._probed_at >= self.interval_s:
            self._probed_at = now
            return Admission.PROBE
        return Admission.REFUSED if self.shedding else Admission.ADMITTED

    def probe_unused(self) -> None:
        """The probe ended without a latency to judge by (refused, or an error): the next retrieval may probe."""
        self._probed_at = -math.inf

    def done(self, latency_s: float, now: float | None = None) -> None:
        """A retrieval completed after latency_s seconds."""
        if not self.target_s:
            return
        now = time.monotonic() if now is None else now
        if latency_s <= self.target_s:
            self.shedding, self._slow_since = False, None
        elif self._slow_since is None:
            self._slow_since = now
        elif now - self._slow_since >= self.interval_s and not self.shedding:
            self.shedding, self._probed_at = True, now


T = TypeVar("T")


class ThreadLane:
    """Threads of one kind of blocking work of their own (the write path's Redis calls and ad towers), so that other
    work (the retrievals' user towers, in the event loop's default pool) never waits behind it: at most `threads`
    slots taken at once, each running one job on its own thread; one more waits up to `wait_s` for a slot to come free,
    then is refused (Overloaded, naming `setting`), never queued longer. A job holds its slot until it returns, even
    where its caller stopped waiting."""

    POLL_S = 0.005  # how often a caller waiting for a slot looks again (a threading count, shared with the threads that
    # free slots: nothing an event loop can await)

    def __init__(self, threads: int, name: str, setting: str, retry_after_s: float = 1.0, wait_s: float = 0.0):
        self.threads, self.name, self.setting = threads, name, setting
        self.retry_after_s, self.wait_s = retry_after_s, wait_s
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._free = threads
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Slots taken now: callers between slot() and their job, and jobs not yet returned."""
        with self._lock:
            return self.threads - self._free

    async def run(self, job: Callable[[], T]) -> T:
        """job() on a thread of the lane, in a slot taken as slot() takes one."""
        async with self.slot() as slot:
            return await slot.run(job)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator["LaneSlot"]:
        """A slot of the lane for the block (Overloaded when none came free within wait_s), for work that must hold
        one before its job starts (a write's owner lookups, so that a refused write costs nothing). Its job, if the
        block runs one, frees it on returning; otherwise the block's end does."""
        waited_until = time.monotonic() + self.wait_s
        while not self._take():
            if time.monotonic() >= waited_until:
                raise Overloaded(f"this router has {self.threads} {self.name} in flight ({self.setting} = "
                                 f"{self.threads}); retry after Retry-After", "request", self.retry_after_s)
            await asyncio.sleep(self.POLL_S)
        slot = LaneSlot(self)
        try:
            yield slot
        finally:
            if not slot.submitted:
                self._release()

    def _take(self) -> bool:
        with self._lock:
            if self._free == 0:
                return False
            self._free -= 1
            return True

    def _release(self) -> None:
        with self._lock:
            self._free += 1


class LaneSlot:
    """One taken slot of a ThreadLane (ThreadLane.slot), which runs one job."""

    def __init__(self, lane: ThreadLane):
        self.lane, self.submitted = lane, False

    async def run(self, job: Callable[[], T]) -> T:
        """job() on a thread of the lane; the slot is free again when it returns (or raises, or was cancelled before
        it ran), whether or not the caller still waits."""
        if self.submitted:
            raise RuntimeError("a lane slot runs one job")
        future = self.lane._pool.submit(contextvars.copy_context().run, job)  # as asyncio.to_thread: the request's
        # context (Serve's request id in log records) goes with it
        self.submitted = True
        future.add_done_callback(lambda _: self.lane._release())
        return await asyncio.wrap_future(future)


RETRY_AFTER_MAX_S = 86_400  # a day: what a wait longer than that (or not finite) is sent as


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1 and at most RETRY_AFTER_MAX_S."""
    return str(max(1, math.ceil(min(seconds, RETRY_AFTER_MAX_S))))
