"""Open-loop HTTP load generator (asyncio + aiohttp), run in a process of its own.

Request i of a step is due at t0 + i / rate and is sent then, whatever the earlier ones are doing (no
cap on requests in flight); its latency runs from its due time, so a late send (the generator
falling behind) or a queue anywhere counts against the system, not hidden (no coordinated omission).
"""
from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path

import aiohttp
import numpy as np
import uvloop

HEADERS = {"Content-Type": "application/json"}


@functools.lru_cache(maxsize=4)
def bodies(requests_jsonl: str, k: int) -> tuple[bytes, ...]:
    """The world's requests as JSON bodies with `k` set."""
    return tuple(json.dumps({**json.loads(line), "k": k}).encode()
                 for line in Path(requests_jsonl).read_text().splitlines() if line.strip())


async def _step(url: str, payloads: tuple[bytes, ...], rate: float, seconds: float, timeout_s: float) -> dict:
    loop = asyncio.get_running_loop()
    done, late = [], []  # (latency s, success) per request; how late each was sent (s)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(session: aiohttp.ClientSession, body: bytes, due: float) -> None:
        late.append(loop.time() - due)
        success = False
        try:
            async with session.post(url, data=body, headers=HEADERS, timeout=timeout) as reply:
                await reply.read()
                success = reply.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        done.append((loop.time() - due, success))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        n = max(1, round(rate * seconds))
        t0 = loop.time() + 0.05
        tasks = []
        for i in range(n):
            due = t0 + i / rate
            await asyncio.sleep(max(0.0, due - loop.time()))
            tasks.append(asyncio.create_task(one(session, payloads[i % len(payloads)], due)))
        await asyncio.gather(*tasks)
        finished = loop.time()
    latency, good = (np.array(column) for column in zip(*done))
    lat_ms = latency[good] * 1000 if good.any() else np.array([np.nan])
    return {"offered": rate, "sent": n, "achieved": float(good.sum() / (finished - t0)),
            "p50": float(np.percentile(lat_ms, 50)), "p95": float(np.percentile(lat_ms, 95)),
            "p99": float(np.percentile(lat_ms, 99)), "errors": int((~good).sum()),
            "late_p99": float(np.percentile(np.array(late) * 1000, 99))}


def run_step(url: str, requests_jsonl: str, k: int, rate: float, seconds: float, timeout_s: float) -> dict:
    """One step at a fixed arrival rate: offered and achieved rate (successes / time until the last
    reply), latency percentiles of the successes (ms), errors (non-200, refused, timed out) and how late
    the generator sent (p99 ms)."""
    return uvloop.run(_step(url, bodies(requests_jsonl, k), rate, seconds, timeout_s))
