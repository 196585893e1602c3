"""Cluster-wide rate limits (`rate_limit.shared`): the token bucket of deployments/limits.py kept in Redis,
so every router replica takes from one bucket per caller. One Lua script refills and takes atomically, on
Redis's clock (routers' clocks need not agree); a bucket idle until it is full again expires.

Failure mode: when Redis does not answer within `rate_limit.store_timeout_s`, the router decides with its
own in-process bucket (per replica, as without `shared`) for `retry_s` before it asks Redis again; it
logs each failed try (so at most one line per `retry_s`) and counts every decision made without Redis.
Fail open, not closed: the read path must not go down because the limiter's store did."""
from __future__ import annotations

import logging
import time
from typing import Callable

import redis

from andromeda_core.config import redact
from deployments.limits import TokenBuckets

log = logging.getLogger(__name__)

# KEYS[1]: the caller's bucket {tokens, at}. ARGV: rate (tokens/s), burst, now in s ("": Redis's TIME).
# Returns the seconds until a token is back ("0": one was taken), as a string (Lua numbers become integers).
TAKE = """
local rate, burst, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if now == nil then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
tokens = math.min(burst, tokens + math.max(0, now - (tonumber(state[2]) or now)) * rate)
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.min(86400000, math.ceil(1000 * burst / rate) + 1000))
return tostring(wait)
"""


class SharedTokenBuckets:
    """Token buckets per caller in Redis under `prefix` (`take` as TokenBuckets.take), on a `client` that gives up after
    one try of store_timeout_s (index_updater.clients.redis_client); `local` decides while Redis fails, and `on_fallback` is called for each such decision. A key expires when its bucket would be
    full again (idle for burst / rate s; at most a day, which refills a slower bucket early)."""

    def __init__(self, client: redis.Redis, prefix: str, local: TokenBuckets, retry_s: float = 1.0,
                 on_fallback: Callable[[], None] = lambda: None):
        self.rate, self.burst, self.prefix, self.local = local.rate, local.burst, prefix, local
        self.retry_s, self.on_fallback = retry_s, on_fallback
        self._take = client.register_script(TAKE)
        self._down_until = 0.0  # monotonic; until then Redis is not asked

    def take(self, caller: str, now: float | None = None) -> float:
        """0 when `caller` may go on (one token taken), else the seconds until a token is back. `now`: seconds
        on a clock every router shares (tests); None: Redis's clock."""
        if time.monotonic() >= self._down_until:
            try:
                return float(self._take(keys=[self.prefix + caller],
                                        args=[repr(self.rate), self.burst, "" if now is None else repr(now)]))
            except redis.RedisError as exc:
                self._down_until = time.monotonic() + self.retry_s
                log.warning("rate limiter: Redis failed (%s); this router limits on its own for %.0f s",
                            redact(exc), self.retry_s)
        self.on_fallback()
        return self.local.take(caller, now)
