"""Input limits, request rate and overload guards of the ingress (ServiceConfig.limits / rate_limit /
overload). Each refusal is an error naming the field (or header) and the limit."""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from typing import Sequence

from andromeda_core.errors import InvalidInput
from andromeda_core.types import RetrieveRequest
from deployments.config import Limits


def check_requests(limits: Limits, requests: Sequence[RetrieveRequest], where: str) -> None:
    """Raise InvalidInput (field path, limit name) for the first request past a limit; `where` formats the
    position of request i (e.g. "[{}]." for a batch)."""
    for i, r in enumerate(requests):
        at = where.format(i)
        if r.k > limits.k:
            raise InvalidInput(f"at most {limits.k} (limits.k), got {r.k}", f"{at}k")
        user = r.user
        for name, items in (("history", user.history), ("co_engagement", user.co_engagement), ("cohorts", user.cohorts)):
            cap = getattr(limits, name)
            if len(items) > cap:
                raise InvalidInput(f"at most {cap} entries (limits.{name}), got {len(items)}", f"{at}user.{name}")
        for category, value in user.attributes.items():
            values = value if isinstance(value, list) else [value]
            if len(values) > limits.values_per_category:
                raise InvalidInput(f"at most {limits.values_per_category} values (limits.values_per_category), "
                                   f"got {len(values)}", f"{at}user.attributes.{category}")
            for j, v in enumerate(values):
                if isinstance(v, str) and len(v) > limits.string_chars:
                    field = f"{at}user.attributes.{category}" + (f"[{j}]" if isinstance(value, list) else "")
                    raise InvalidInput(f"at most {limits.string_chars} characters (limits.string_chars), got {len(v)}",
                                       field)
        for j, c in enumerate(user.co_engagement):
            if len(c.surface) > limits.string_chars:
                raise InvalidInput(f"at most {limits.string_chars} characters (limits.string_chars), got "
                                   f"{len(c.surface)}", f"{at}user.co_engagement[{j}].surface")


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


class LatencyShedder:
    """CoDel's signal on one router's requests: when every request completed over the last `interval_s` took
    longer than `target_s`, a queue stands in front of the work (a request that found none would have been
    fast), so new requests are refused (503) until one completes within the target or none is left in
    flight. Admitted requests then stay near the target instead of waiting out the queue. target_s 0: off."""

    def __init__(self, target_s: float, interval_s: float):
        self.target_s, self.interval_s = target_s, interval_s
        self.shedding = False
        self._slow_since: float | None = None  # first completion over the target since the last fast one

    def admit(self, inflight: int) -> bool:
        """Whether a new request may start (`inflight`: this router's requests now in flight)."""
        if inflight == 0:  # nothing queued: start over
            self.shedding, self._slow_since = False, None
        return not self.shedding

    def done(self, latency_s: float, now: float | None = None) -> None:
        """A request completed after latency_s seconds."""
        if not self.target_s:
            return
        now = time.monotonic() if now is None else now
        if latency_s <= self.target_s:
            self.shedding, self._slow_since = False, None
        elif self._slow_since is None:
            self._slow_since = now
        elif now - self._slow_since >= self.interval_s:
            self.shedding = True


def retry_after(seconds: float) -> str:
    """A Retry-After header value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
