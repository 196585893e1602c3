"""What a user would build instead of Andromeda: FAISS IndexFlatIP over the same ad vectors behind a
plain FastAPI endpoint, post-filtered by targeting.

Per request (same JSON as POST /v1/retrieve): the same user tower (HashedTwoTower.encode_users, history
vectors from a dict of ad vectors), FAISS top k' (k' = k, then x4 until k eligible ads are found or the
whole corpus was searched), then the project's exact targeting match on those k' candidate slots; the
first k eligible are the answer. Runs in its own process (uvicorn, loopback only):

    python -m benchmarks.load_faiss --events world/events.jsonl --port 8123
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import faiss
import torch
import uvicorn
from fastapi import FastAPI

from andromeda_core.index import AdIndex
from andromeda_core.ingest import load_events, read_events
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.schema import load_schema
from andromeda_core.targeting import compile_user
from andromeda_core.types import RetrieveRequest
from kernels.reference.fused import clause_match

GROWTH = 4


def match_slots(index: AdIndex, now: torch.Tensor, truth: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Eligibility (B, n) of the ads in `slots` (n,): AdIndex.match on gathered rows instead of a range."""
    col = {name: index.columns[name][slots] for name in ("status", "start", "end", "refs")}
    return clause_match(col["status"], col["start"], col["end"], col["refs"], truth, now)


class FaissPeer:
    """FAISS over every slot's vector (FAISS id = slot) beside an AdIndex that only holds the targeting."""

    def __init__(self, events: Path):
        self.schema, self.scorer = load_schema(), HashedTwoTower()
        self.index = AdIndex(self.schema, self.scorer.dim)
        load_events(self.index, self.schema, self.scorer, read_events(events))
        slots = self.index.high_water
        self.flat = faiss.IndexFlatIP(self.scorer.dim)
        self.flat.add(self.index.embeddings(0, slots).numpy())
        self.ad_id = self.index.columns["ad_id"][:slots].tolist()
        live = self.index.ad_ids()
        self.vectors = dict(zip(live, self.index.embeddings_of(live)[0]))

    def lookup(self, ad_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """History ad vectors from the dict (zeros where unknown) and found (n,) bool."""
        zero = torch.zeros(self.scorer.dim)
        return (torch.stack([self.vectors.get(i, zero) for i in ad_ids]) if ad_ids else torch.zeros((0, self.scorer.dim)),
                torch.tensor([i in self.vectors for i in ad_ids], dtype=torch.bool))

    def retrieve(self, request: RetrieveRequest) -> dict:
        values, warnings = compile_user(self.schema, request.user.attributes, request.context.targeting_values())
        now = int(time.time()) if request.context.ts is None else request.context.ts
        user = self.scorer.encode_users([request], self.lookup, [now]).numpy()
        inputs = self.index.request_inputs([values], [now])  # the index is read-only here: no lock needed
        wanted, k_prime = request.k, request.k
        while True:
            k_prime = min(k_prime, self.flat.ntotal)
            scores, slots = self.flat.search(user, k_prime)
            ok = match_slots(self.index, *inputs, torch.from_numpy(slots[0]))[0].numpy()
            hits = [(self.ad_id[s], float(x)) for s, x, good in zip(slots[0], scores[0], ok) if good][:wanted]
            if len(hits) == wanted or k_prime == self.flat.ntotal:
                break
            k_prime *= GROWTH
        return {"ads": [{"ad_id": i, "score": x} for i, x in hits], "candidates": k_prime, "warnings": warnings}


def create_app(peer: FaissPeer) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/retrieve")
    def retrieve(request: RetrieveRequest) -> dict:
        return peer.retrieve(request)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events", type=Path, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=1, help="torch and FAISS threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    uvicorn.run(create_app(FaissPeer(args.events)), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
