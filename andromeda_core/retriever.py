"""The retrieval pipeline, split the way a sharded service runs it:

- `compile_requests`: each request's targeting values and warnings (a bad request is an error of its
  own, never its batch's);
- `Scorer.encode_users`: the user towers, once per request (a router runs them once for all shards);
- `Retriever.search(UserQuery) -> TopK`: ONE fused pass over this index (kernels.dispatch: Triton on
  CUDA, compiled CPU code otherwise): targeting match -> score -> partial top-k, for a batch of requests
  each with its own targeting, time and k. The pass shortlists max(rescore, 1) * k slots per request;
  those few are rescored by the scorer's head in float64 (`exact_scores`, from the float32 copy a lossy
  fp16/int8 table keeps), so results carry the scorer's scores rounded once, the same on every shard and
  replica. Deterministic: ties go to the lower ad id.

`Retriever.retrieve` chains the three steps in one process (the offline CLI, tests).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Sequence

import torch

from andromeda_core.errors import AndromedaError
from andromeda_core.index import AdIndex
from andromeda_core.models import KernelHead, Scorer, score_each
from andromeda_core.schema import Schema
from andromeda_core.targeting import UserValues, compile_user
from andromeda_core.types import FLOAT32_MAX, RetrieveRequest, RetrieveResponse, ScoredAd, parse_request
from andromeda_core.wire import NumpyPickled
from kernels import dispatch
from kernels.reference.fused import head_scores
from kernels.reference.topk import NO_ID, topk_by_score_then_id


@dataclass(frozen=True)
class CompiledRequest:
    """A request's targeting values (category -> sorted value indices), its time (seconds) and warnings."""

    values: UserValues
    now: int
    warnings: list[str]


@dataclass(frozen=True)
class UserQuery(NumpyPickled):
    """What a shard needs to answer B requests: the user towers' output (scorer state for B rows),
    each request's compiled targeting values, time (seconds) and k. Small: no raw features, no candidates."""

    users: Any
    values: list[UserValues]
    now: list[int]
    k: list[int]

    def __len__(self) -> int:
        return len(self.k)


@dataclass(frozen=True)
class TopK(NumpyPickled):
    """Per-request results: ids (B, K) int64 (-1 = none), scores (B, K) float32 (-inf = none), sorted by
    score desc then id asc; only the first k[b] entries of row b count (K may be less than k[b] when the
    table holds fewer slots); eligible (B,) int64."""

    ids: torch.Tensor
    scores: torch.Tensor
    eligible: torch.Tensor

    def row(self, b: int, k: int) -> list[ScoredAd]:
        """Request b's first k ads; a score of +-inf (one past float32, or a NaN ranked as -inf) goes out as
        float32's largest finite magnitude, which JSON can carry."""
        ids, scores = self.ids[b, :k].tolist(), self.scores[b, :k].clamp(-FLOAT32_MAX, FLOAT32_MAX).tolist()
        return [ScoredAd(ad_id=i, score=s) for i, s in zip(ids, scores) if i != NO_ID]


def exact_scores(scorer: Scorer, users: Any, candidates: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each request's valid candidates, candidates (B, m, S) float32, valid (B, m) bool -> (B, m) float32 scores (0
    where not valid; score_each: each request by itself): the scorer's head (`kernel_head`, of that request alone)
    applied in float64 (kernels.reference.fused.head_scores) and rounded to float32 once. So a score depends on the
    user state and the ad alone (a learned model's user towers, run on the request's batch, may still differ in the
    last bits): a float32 matmul's rounding changes with the number of candidates and a candidate's place among
    them (an ad scored 1.0000001 in one place, 1.0 in another), which ordered equal ads differently on two shards
    or on two replicas of other slot layouts. Two float64 evaluations of one score (their error about 1e-16 of it)
    round to different float32s only where they straddle a rounding boundary."""
    def in_float64(user: Any, ads: torch.Tensor) -> torch.Tensor:
        head = scorer.kernel_head(user)
        return head_scores(ads.double(), None, head.experts.double(), head.keys.double(), head.mask, head.bias_col,
                           head.top_n)

    return score_each(in_float64, users, candidates, valid)


def merge_topks(parts: Sequence[TopK], k: int) -> TopK:
    """The exact top-k of several shards' partial results for the same B requests: ids/scores (B, k),
    eligible counts added up."""
    ids = torch.cat([p.ids for p in parts], 1)
    ids, scores = topk_by_score_then_id(torch.cat([p.scores for p in parts], 1), ids, ids != NO_ID, k)
    return TopK(ids, scores, sum(p.eligible for p in parts))


def compile_requests(schema: Schema, requests: Sequence[RetrieveRequest],
                     now: int | None = None) -> list[CompiledRequest | AndromedaError]:
    """Targeting values of each request; `now` (seconds, default: the clock) where a request has no
    context.ts. A request with bad input gets its error in its place."""
    server_now = int(time.time()) if now is None else now
    out: list[CompiledRequest | AndromedaError] = []
    for r in requests:
        try:
            values, warnings = compile_user(schema, r.user.attributes, r.context.targeting_values())
            out.append(CompiledRequest(values, server_now if r.context.ts is None else r.context.ts, warnings))
        except AndromedaError as exc:
            out.append(exc)
    return out


def concat_users(states: Sequence[Any]) -> Any:
    """Stack scorer user states of several queries along the batch dimension (a tensor or a dataclass of tensors)."""
    first = states[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(states))
    if is_dataclass(first):
        return type(first)(*(torch.cat([getattr(s, f.name) for s in states]) for f in fields(first)))
    raise TypeError(f"cannot concatenate user states of type {type(first).__name__}")


def concat_queries(queries: Sequence[UserQuery]) -> UserQuery:
    """Several queries as one batch (request batching: they share one pass over the table)."""
    if len(queries) == 1:
        return queries[0]
    return UserQuery(concat_users([q.users for q in queries]), [v for q in queries for v in q.values],
                     [t for q in queries for t in q.now], [k for q in queries for k in q.k])


def slice_query(query: UserQuery, start: int, stop: int) -> UserQuery:
    """Requests start..stop-1 of a query (its user state sliced along the batch dimension, as concat_users stacks)."""
    users = query.users
    users = users[start:stop] if isinstance(users, torch.Tensor) else type(users)(
        *(getattr(users, f.name)[start:stop] for f in fields(users)))
    return UserQuery(users, query.values[start:stop], query.now[start:stop], query.k[start:stop])


def concat_topks(parts: Sequence[TopK]) -> TopK:
    """The results of consecutive parts of one query as one TopK: rows stacked, the narrower parts padded with no
    ad (-1, -inf) to the widest."""
    width = max(p.ids.shape[1] for p in parts)

    def padded(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)
    return TopK(torch.cat([padded(p.ids, NO_ID) for p in parts]), torch.cat([padded(p.scores, -math.inf) for p in parts]),
                torch.cat([p.eligible for p in parts]))


def split_topk(result: TopK, sizes: Sequence[int]) -> list[TopK]:
    """Inverse of concat_queries for the results: one TopK per query of `sizes` rows."""
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [TopK(result.ids[a:b], result.scores[a:b], result.eligible[a:b]) for a, b in zip(bounds, bounds[1:])]


TIES_KEPT = 4096  # places a tie at a shortlist's cut may add to it (Retriever.shortlist): a request whose every ad
# scores the same (no known interests and no history, to the untrained hashed two-tower) made the pass grow to the
# whole table for its whole batch, and rescoring gather (B, n, S) vectors


class Retriever:
    def __init__(self, index: AdIndex, scorer: Scorer, rescore: int = 2):
        self.index, self.scorer, self.rescore = index, scorer, rescore

    def encode(self, requests: Sequence[RetrieveRequest], now: Sequence[int]) -> Any:
        """User towers for B requests, reading history vectors from this index."""
        return self.scorer.encode_users(requests, self.index.embeddings_of, now)

    def search(self, query: UserQuery) -> TopK:
        """One pass over the table for B requests, each with its own targeting, time and k: the fused kernel
        shortlists max(rescore, 1) * k slots per request by its own scores, and they are rescored in float64
        (exact_scores; from the exact copy where the table keeps one)."""
        users = query.users.to(self.index.device)  # a router builds user state on its own device
        head = self.scorer.kernel_head(users)
        with self.index.reading():
            k = max(1, min(max(query.k), self.index.high_water))  # no request gets more than the table holds
            wanted = [max(self.rescore, 1) * min(kb, k) for kb in query.k]
            slots, eligible = self.shortlist(self.index.request_inputs(query.values, query.now), head, wanted)
            found = slots >= 0
            scores = exact_scores(self.scorer, users, self.index.vectors_at(slots), found)
            ids = torch.where(found, self.index.columns["ad_id"][slots.clamp(min=0)], NO_ID)
            ids, scores = topk_by_score_then_id(scores, ids, found, k)
        return TopK(ids.cpu(), scores.cpu(), eligible.cpu())

    def shortlist(self, inputs: tuple[torch.Tensor, torch.Tensor], head: KernelHead,
                  wanted: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The best wanted[b] eligible slots of each request by the kernel's scores, and every slot tied with
        the last of them: (slots (B, m) int64, -1 padded; eligible counts (B,)). The pass keeps one place more
        than wanted and grows while a tie runs past its end, by at most TIES_KEPT places: past them the kernel's
        order (by slot) cuts the tie. Call inside index.reading()."""
        columns, n = self.index.scan_columns(), self.index.high_water
        if n == 0:
            return torch.full((len(wanted), 0), -1, device=self.index.device), torch.zeros(len(wanted), dtype=torch.int64)
        want = torch.tensor(wanted, device=self.index.device)
        width, limit = min(max(wanted) + 1, n), min(max(wanted) + 1 + TIES_KEPT, n)
        while True:
            slots, scores, eligible = dispatch.fused_scan(*columns, *inputs, head.experts, head.keys, head.mask,
                                                          head.bias_col, head.top_n, width)
            last = (want.clamp(max=width) - 1)[:, None]
            threshold = torch.where(slots.gather(1, last) >= 0, scores.gather(1, last), float("inf"))
            kept = (slots >= 0) & ((scores >= threshold) | (torch.arange(width, device=slots.device) <= last))
            if width >= limit or not (kept[:, -1] & (scores[:, -1] == threshold[:, 0])).any():
                return torch.where(kept, slots, -1), eligible
            width = min(4 * width, limit)

    def warm_up(self) -> None:
        """Build what first searches would, so that no real request waits for it: a retrieval of one request of no
        attributes (user towers, a pass, rescoring), then the kernels of every shape a pass over this table may
        take (kernels.dispatch.warm_up: on CUDA Triton's JIT, seconds each; on the CPU the C++ build, also for an
        empty table, which runs no pass). Changes nothing in the index."""
        request = parse_request({"user": {"user_id": 0}, "k": 100})
        self.retrieve([request])
        compiled = compile_requests(self.index.schema, [request])[0]
        with self.index.reading():
            head = self.scorer.kernel_head(self.encode([request], [compiled.now]).to(self.index.device))
            inputs = self.index.request_inputs([compiled.values], [compiled.now])
            dispatch.warm_up(*self.index.scan_columns(), *inputs, head.experts, head.keys, head.mask, head.bias_col,
                             head.top_n)

    def retrieve(self, requests: Sequence[RetrieveRequest], now: int | None = None) -> list[RetrieveResponse | AndromedaError]:
        """Answer requests in one process; each gets its response, or its own error."""
        started = time.perf_counter()
        compiled = compile_requests(self.index.schema, requests, now)
        good = [b for b, c in enumerate(compiled) if isinstance(c, CompiledRequest)]
        out: list[RetrieveResponse | AndromedaError] = list(compiled)
        if not good:
            return out
        batch = [requests[b] for b in good]
        nows = [compiled[b].now for b in good]
        with self.index.reading():  # towers and pass see the same table (search's own read nests)
            users = self.encode(batch, nows)
            result = self.search(UserQuery(users, [compiled[b].values for b in good], nows, [r.k for r in batch]))
        took_ms = round((time.perf_counter() - started) * 1000, 3)
        for row, (b, r) in enumerate(zip(good, batch)):
            out[b] = RetrieveResponse(ads=result.row(row, r.k), eligible=int(result.eligible[row]),
                                      took_ms=took_ms, warnings=compiled[b].warnings)
        return out
