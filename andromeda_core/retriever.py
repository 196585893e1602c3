"""Reference retrieval pipeline: user towers once per request, then one pass over the ad table in
chunks: targeting match -> score -> running exact top-k. Deterministic: ties go to the lower ad id.

With a lossy (fp16/int8) table that keeps an exact copy, the pass keeps the top rescore * k and those
few are rescored from the float32 copy, so the results carry full-precision scores and order."""
from __future__ import annotations

import time
from typing import Sequence

import torch

from andromeda_core.index import AdIndex
from andromeda_core.models import Scorer, score_each
from andromeda_core.targeting import compile_user, match_inputs
from andromeda_core.types import RetrieveRequest, RetrieveResponse, ScoredAd
from kernels.reference.topk import NO_ID, merge_topk, topk_by_score_then_id


class Retriever:
    def __init__(self, index: AdIndex, scorer: Scorer, chunk_size: int = 65536, rescore: int = 2):
        self.index, self.scorer, self.chunk_size, self.rescore = index, scorer, chunk_size, rescore
        self.watermark: str | None = None  # stream id of the newest applied update (set by the consumer)

    def retrieve(self, requests: Sequence[RetrieveRequest], now: int | None = None) -> list[RetrieveResponse]:
        """Answer a batch of requests; `now` (seconds) applies where a request's context has no ts."""
        started = time.perf_counter()
        server_now = int(time.time()) if now is None else now
        compiled = [compile_user(self.index.schema, r.user.attributes, r.context.targeting_values()) for r in requests]
        nows = [server_now if r.context.ts is None else r.context.ts for r in requests]
        inputs = match_inputs(self.index.schema, [c[0] for c in compiled], nows, self.index.device)
        with self.index.reading():
            users = self.scorer.encode_users(requests, self.index.embeddings_of, nows)
            k = max(r.k for r in requests)
            if self.rescore and self.index.keeps_exact:
                ids, _, eligible = self.scan(inputs, users, self.rescore * k)
                ids, scores = self.rescored(users, ids, k)
            else:
                ids, scores, eligible = self.scan(inputs, users, k)
        took_ms = (time.perf_counter() - started) * 1000
        responses = []
        for b, r in enumerate(requests):
            row_ids, row_scores = ids[b, : r.k].tolist(), scores[b, : r.k].tolist()
            ads = [ScoredAd(ad_id=i, score=s) for i, s in zip(row_ids, row_scores) if i != NO_ID]
            responses.append(RetrieveResponse(ads=ads, eligible=int(eligible[b]), index_watermark=self.watermark,
                                              took_ms=round(took_ms, 3), warnings=compiled[b][1]))
        return responses

    def scan(self, inputs, users, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One pass over the table -> (ids (B, k) -1 padded, scores (B, k), eligible counts (B,)).
        Call inside index.reading()."""
        cols, B = self.index.columns, inputs.now.shape[0]
        best_ids = torch.empty((B, 0), dtype=torch.int64, device=self.index.device)
        best_scores = torch.empty((B, 0), dtype=torch.float32, device=self.index.device)
        eligible = torch.zeros(B, dtype=torch.int64, device=self.index.device)
        for start in range(0, self.index.high_water, self.chunk_size):
            stop = min(start + self.chunk_size, self.index.high_water)
            ok = self.index.match(inputs, start, stop)
            eligible += ok.sum(1)
            scores = self.scorer.score(users, self.index.embeddings(start, stop))
            ids = cols["ad_id"][start:stop].expand(B, -1)
            best_ids, best_scores = merge_topk(best_ids, best_scores, ids, scores, ok, k)
        if best_ids.shape[1] < k:
            best_ids, best_scores = topk_by_score_then_id(best_scores, best_ids, best_ids != NO_ID, k)
        return best_ids, best_scores, eligible

    def rescored(self, users, shortlist: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """shortlist (B, m) ad ids, -1 padded -> their top-k by full-precision score: (ids (B, k), scores (B, k)).
        Call inside index.reading()."""
        vectors, found = self.index.exact_embeddings(shortlist)
        scores = score_each(self.scorer.score, users, vectors)
        return topk_by_score_then_id(scores, shortlist, found, k)  # found is False for -1 padding
