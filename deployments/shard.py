"""ShardReplica: one copy of one index shard. It holds the shard's device-resident AdIndex and the
retrieval pipeline, and runs its own stream consumer: at start it loads the newest snapshot and
replays its shard's stream (Serve routes no request to it before that), then follows the stream in
a background thread. Concurrent queries share one pass over the table (@serve.batch)."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from ray import serve

from andromeda_core.config import install_log_redaction
from andromeda_core.errors import NotFound
from andromeda_core.index import AdIndex
from andromeda_core.models.serving import load_scorer
from andromeda_core.quantization import STORAGE
from andromeda_core.retriever import (Retriever, TopK, UserQuery, concat_queries, concat_topks, slice_query,
                                      split_topk)
from andromeda_core.schema import Schema, load_schema
from andromeda_core.wire import NumpyPickled
from deployments.config import ServiceConfig
from index_updater.consumer import ShardConsumer, consumer_client
from index_updater.snapshots import SnapshotStore, stream_id_key

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HistoryVectors(NumpyPickled):
    """A shard's answer to the router's history lookup: stored vectors (n, D) float32 on the CPU (zeros where not
    indexed) and found (n,) bool."""

    vectors: torch.Tensor
    found: torch.Tensor


@dataclass(frozen=True)
class ShardAnswer:
    """A shard's partial top-k for one query, the stream id up to which its index had applied every entry
    (ConsumerStats.watermark; None when it knows none), its pass's time and the slots the pass scanned."""

    topk: TopK
    watermark: str | None
    search_ms: float
    scanned: int


EXPIRED = "expired"  # a shard's answer to a query whose deadline passed before its pass began


def serving_identity(scorer_name: str, schema: Schema) -> str:
    """What a router and the shards it asks must share: the model that embeds users and ads (its served name) and the
    schema that compiles the targeting values (name, version, fingerprint)."""
    return f"model {scorer_name}, schema {schema.name} v{schema.version} ({schema.fingerprint})"


@dataclass(frozen=True)
class Mismatch:
    """A shard's answer to a router of another serving identity: its own (the router's user state or targeting values
    would be read under another model or schema)."""

    identity: str


@dataclass(frozen=True)
class ShardQuery:
    """What the router sends a shard: the compact query, the request's deadline (time.time(); None: none) and the
    router's serving_identity ("" from a router of before 2026-12-06: not checked)."""

    query: UserQuery
    deadline: float | None = None
    identity: str = ""

    def __len__(self) -> int:
        return len(self.query)


@serve.deployment
class ShardReplica:
    def __init__(self, config: dict, shard: int):
        install_log_redaction()
        self.config, self.shard = ServiceConfig.model_validate(config), shard
        cfg = self.config
        self.expired = 0  # queries dropped because their deadline passed while they waited
        device = cfg.resolved_device()
        schema = load_schema(cfg.schema_path)
        scorer = load_scorer(cfg.model, schema, device)
        index = AdIndex(schema, scorer.dim, capacity=cfg.initial_capacity, device=device,
                        embedding_dtype=STORAGE[cfg.storage], exact_copy=cfg.rescore > 0)
        self.retriever = Retriever(index, scorer, rescore=cfg.rescore)
        self.identity = serving_identity(scorer.name, schema)
        snapshots = SnapshotStore(Path(cfg.snapshot_dir) / f"shard-{shard}")
        self.consumer = ShardConsumer(consumer_client(cfg.resolved_redis_url()), index, scorer.name, shard, cfg.shards,
                                      stream=cfg.stream, snapshots=snapshots, snapshot_every_s=cfg.snapshot_every_s,
                                      trim=cfg.trim is not None, replica_id=uuid.uuid4().hex[:12],
                                      **({"trim_keep_entries": cfg.trim.keep_entries, "trim_every_s": cfg.trim.every_s,
                                          "replica_ttl_s": cfg.trim.replica_ttl_s} if cfg.trim else {}))
        with self.consumer.starting():  # reports its position each second: nothing it needs is trimmed meanwhile
            self.consumer.recover()
            # Readiness only after catch-up: Serve routes nothing here before __init__ returns. A stream
            # trimmed past every snapshot raises StreamGap: the replica fails to start (Serve retries)
            # rather than serve an index missing updates.
            self.consumer.catch_up()
            warming = time.perf_counter()
            self.retriever.warm_up()  # the kernel's build (CPU, seconds) or JIT (GPU, 83 s on an H100), before any request
            log.info("shard %d: kernels warmed up in %.1f s", shard, time.perf_counter() - warming)
        self.consumer.start()
        self.search.set_max_batch_size(cfg.max_batch_size)
        self.search.set_batch_wait_timeout_s(cfg.batch_wait_timeout_s)
        log.info("shard %d ready: %d ads at %s", shard, len(index), self.consumer.stats.last_id)

    @serve.batch(batch_size_fn=lambda queries: sum(len(q) for q in queries))  # a batch counts requests, not calls
    async def search(self, queries: list[ShardQuery]) -> list[ShardAnswer | Mismatch | str]:
        """Queries from concurrent requests share one pass over the table; each gets its own rows back. A query
        whose deadline passed while it waited gets EXPIRED and costs no work; one from a router of another serving
        identity gets Mismatch (the others of its batch are answered)."""
        return await self._pass(queries)

    async def search_alone(self, query: ShardQuery) -> ShardAnswer | Mismatch | str:
        """One query of more requests than `max_batch_size` (a large retrieve:batch): passes of its own, one per
        `max_batch_size` of its requests (_search)."""
        return (await self._pass([query]))[0]

    async def _pass(self, queries: list[ShardQuery]) -> list[ShardAnswer | Mismatch | str]:
        started, now = time.perf_counter(), time.time()
        out: list[ShardAnswer | Mismatch | str] = [self.mismatch(q.identity) or EXPIRED for q in queries]
        live = [i for i, q in enumerate(queries) if out[i] == EXPIRED and (q.deadline is None or q.deadline > now)]
        self.expired += out.count(EXPIRED) - len(live)
        if not live:
            return out
        result, watermark, scanned = await asyncio.to_thread(self._search, concat_queries([queries[i].query for i in live]))
        took = (time.perf_counter() - started) * 1000
        for i, part in zip(live, split_topk(result, [len(queries[i]) for i in live])):
            out[i] = ShardAnswer(part, watermark, took, scanned)
        return out

    def _search(self, query: UserQuery) -> tuple[TopK, str | None, int]:
        """(the search's result, the stream id up to which the index had applied every entry (ConsumerStats.watermark),
        the slots it scanned). Each part of at most max_batch_size requests is searched under a read of the index of its
        own, with the watermark and slots of that state (a batch applied between reading them and the pass would make
        them disagree), so that between the parts of a large query (a retrieve:batch of many requests) updates apply
        and other callers' passes start: until 2026-12-07 one read was held for all of it (a 256 x 10,000 batch, 4-9 s
        on 2 cores), which held back every update and, behind the waiting update (the lock prefers writers), every new
        search. The watermark is the parts' oldest (None if one has none), the slots their most."""
        parts = []
        for start in range(0, len(query), self.config.max_batch_size):
            part = slice_query(query, start, start + self.config.max_batch_size)
            with self.retriever.index.reading():
                parts.append((self.consumer.stats.watermark(), self.retriever.index.high_water, self.retriever.search(part)))
        marks = [mark for mark, _, _ in parts]
        watermark = None if None in marks else min(marks, key=stream_id_key)
        return concat_topks([result for _, _, result in parts]), watermark, max(scanned for _, scanned, _ in parts)

    def mismatch(self, identity: str) -> Mismatch | None:
        """Mismatch for a router of another serving identity (its user state or targeting values are of another model
        or schema), None for one of this replica's, or one from before identities (2026-12-06), which sends none."""
        return Mismatch(self.identity) if identity and identity != self.identity else None

    def owners(self, ad_ids: Sequence[int]) -> list[tuple[int | None, int | None, int | None]]:
        """(advertiser, content version, status version) of each ad as this replica's index has them
        (AdIndex.owners_of): what the owner registry takes where newer than its entry (index_updater/owners.py)."""
        return self.retriever.index.owners_of(ad_ids)

    def vectors(self, ad_ids: Sequence[int], identity: str = "") -> HistoryVectors | Mismatch:
        """The stored vectors of ad_ids: the router's user towers read the history ads that live on this shard (a
        router of another serving identity gets Mismatch: they are another model's; one from before identities sends
        none)."""
        if mismatch := self.mismatch(identity):
            return mismatch
        with self.retriever.index.reading():  # an ad past its end by Redis's clock is not read (ShardConsumer.clock_s)
            return HistoryVectors(*self.retriever.index.embeddings_of(ad_ids, self.consumer.clock_s()))

    def get_ad(self, ad_id: int, now: int) -> dict | None:
        """Indexed state of one ad and whether a request at `now` could be served it; None when not indexed."""
        try:
            state = self.retriever.index.get(ad_id)
        except NotFound:
            return None  # an ordinary answer, not a failed call (Ray would log a traceback)
        in_window = (state["start_time"] is None or state["start_time"] <= now) and (
            state["end_time"] is None or now < state["end_time"])
        return {**state, "shard": self.shard, "servable_now": state["status"] == "active" and state["satisfiable"] and in_window}

    def status(self) -> dict:
        """Readiness and the consumer's metrics (read by the router's /readyz and /metrics). A consumer that cannot
        read its stream (stream_down_s) leaves the replica ready: it serves what it applied (only updates stop),
        and `stream_up` and `reason` say so."""
        stats = self.consumer.stats
        healthy, reason = self.consumer.health(self.config.max_lag_s, self.config.stream_down_s)
        return {"shard": self.shard, "ready": self.consumer.caught_up and healthy, "healthy": healthy, "reason": reason,
                "stream_up": not stats.stream_down(self.config.stream_down_s),
                "stream_read_age_seconds": stats.read_age_s(),
                "model": self.retriever.scorer.name, "identity": self.identity, "index_size": len(self.retriever.index),
                "lag_seconds": stats.lag_seconds(), "applied": stats.applied, "stale": stats.stale,
                "dead_letters": stats.dead_letters, "errors": stats.errors, "stream_resets": stats.stream_resets,
                "last_error": stats.last_error, "last_id": stats.last_id, "capacity": self.retriever.index.capacity,
                "expired": self.expired}

    def check_health(self) -> None:
        """Serve replaces the replica when this raises: its consumer thread dead, or a gap no snapshot covers, or its
        lag past max_lag_s, which alone does not count while it cannot read its stream (a replacement could not start
        without Redis)."""
        healthy, reason = self.consumer.health(self.config.max_lag_s, self.config.stream_down_s)
        if not healthy:
            raise RuntimeError(f"shard {self.shard}: {reason}")

    def __del__(self) -> None:
        consumer = getattr(self, "consumer", None)
        if consumer is not None:
            consumer.stop()

