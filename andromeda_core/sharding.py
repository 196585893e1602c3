"""Which index shard owns an ad: a stable 64-bit mix of the ad id modulo the shard count."""
from __future__ import annotations

_MASK = 2**64 - 1


def shard_of(ad_id: int, shards: int) -> int:
    x = (ad_id * 0x9E3779B97F4A7C15) & _MASK
    x ^= x >> 31
    return x % shards
