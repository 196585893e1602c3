"""The serving path on CUDA answers as on the CPU: the index and the scorer on the GPU (the Triton fused
pass), the hashed two-tower and a random-weight MoE, fp32/fp16/int8 storage, a batch and each request
alone, and the service's split (user state built on the CPU by the router, searched by a CUDA shard).

Runs where CUDA is (benchmarks/gpu_check.sh runs it on a lent GPU); skipped elsewhere, where the CPU
kernels are tested against the reference by tests/kernels."""
from __future__ import annotations

import json

import pytest
import torch

from andromeda_core.index import AdIndex
from andromeda_core.ingest import prepare_ops, read_events
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.quantization import STORAGE
from andromeda_core.retriever import Retriever, UserQuery, compile_requests
from andromeda_core.synth import WorldConfig, synthesize
from andromeda_core.types import parse_request

CUDA = "cuda"
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CATEGORIES = ["sports", "food", "travel"]


class RandomTextAdTower:
    """The MoE's ad tower over seeded random text embeddings (the GPU image has no packaged MiniLM):
    prepare_ops calls only encode_ads."""

    def __init__(self, model: RetrievalModel):
        self.model = model

    @torch.no_grad()
    def encode_ads(self, ads) -> torch.Tensor:
        text = torch.stack([torch.randn(384, generator=torch.Generator().manual_seed(a.ad_id)) for a in ads])
        return self.model.ad_tower(text, torch.zeros(len(ads), dtype=torch.long),
                                   torch.tensor([a.advertiser_id for a in ads]),
                                   torch.tensor([a.bid for a in ads], dtype=torch.float32),
                                   self.model.id_rows(torch.tensor([a.ad_id for a in ads])),
                                   torch.zeros((len(ads), self.model.dims.dim)))  # mentions none


@pytest.fixture(scope="module")
def world(default_schema, tmp_path_factory):
    path = synthesize(WorldConfig(ads=3000, users=48, seed=5), tmp_path_factory.mktemp("world") / "w", default_schema)
    requests = [parse_request({**json.loads(line), "k": 50}) for line in (path / "requests.jsonl").read_text().splitlines()]
    return path, requests


def moe_model() -> RetrievalModel:
    torch.manual_seed(0)
    return RetrievalModel("moe", Dims(categories=len(CATEGORIES) + 1)).eval()


SCORERS = ["two_tower", "moe"]


def make_scorer(name: str, device: str, schema):
    return HashedTwoTower(device=device) if name == "two_tower" else ModelScorer(moe_model(), CATEGORIES, schema, device)


def ops_for(name: str, world_path, schema) -> list:
    encoder = HashedTwoTower() if name == "two_tower" else RandomTextAdTower(moe_model())
    return [op for batch in read_events(world_path / "events.jsonl") for op in prepare_ops(schema, encoder, batch)]


def ids(responses) -> list[list[int]]:
    return [[a.ad_id for a in r.ads] for r in responses]


def assert_same_answers(cpu, cuda, tol: float = 1e-4):
    """The same eligible counts and, rank by rank, scores within tol; ids differ only where scores tie within tol
    (the GPU's float sums may order such near-ties differently): at each rank where they differ, both ids score
    within tol of each other on the CPU side too, or lie at the k-th score (one may then be the k+1-th)."""
    for want, got in zip(cpu, cuda):
        assert got.eligible == want.eligible and len(got.ads) == len(want.ads)
        assert all(abs(a.score - b.score) < tol for a, b in zip(want.ads, got.ads))
        score = {a.ad_id: a.score for a in want.ads}
        last = want.ads[-1].score if want.ads else 0.0
        for a, b in zip(want.ads, got.ads):
            assert a.ad_id == b.ad_id or abs(score.get(b.ad_id, last) - a.score) < tol


@pytest.mark.parametrize("name", SCORERS)
@pytest.mark.parametrize("storage", ["fp32", "fp16", "int8"])
def test_cuda_retriever_equals_cpu(default_schema, world, name, storage):
    path, requests = world
    ops = ops_for(name, path, default_schema)
    answers = {}
    for device in ("cpu", CUDA):
        scorer = make_scorer(name, device, default_schema)
        index = AdIndex(default_schema, scorer.dim, 1024, device, STORAGE[storage])
        index.apply(ops)
        retriever = Retriever(index, scorer)
        answers[device] = (retriever.retrieve(requests), [retriever.retrieve([r])[0] for r in requests[:8]])
    assert_same_answers(answers["cpu"][0], answers[CUDA][0])
    assert ids(answers[CUDA][1]) == ids(answers[CUDA][0][:8])  # on the GPU, alone as in the batch


@pytest.mark.parametrize("name", SCORERS)
def test_router_on_cpu_shard_on_cuda(default_schema, world, name):
    path, requests = world
    ops = ops_for(name, path, default_schema)
    cpu_scorer, cuda_scorer = make_scorer(name, "cpu", default_schema), make_scorer(name, CUDA, default_schema)
    cpu_index, cuda_index = AdIndex(default_schema, cpu_scorer.dim), AdIndex(default_schema, cuda_scorer.dim, 1024, CUDA)
    cpu_index.apply(ops)
    cuda_index.apply(ops)
    compiled = compile_requests(default_schema, requests)
    nows = [c.now for c in compiled]
    users = Retriever(cpu_index, cpu_scorer).encode(requests, nows)  # on the CPU, as the router builds it
    query = UserQuery(users, [c.values for c in compiled], nows, [r.k for r in requests])
    got, want = Retriever(cuda_index, cuda_scorer).search(query), Retriever(cpu_index, cpu_scorer).search(query)
    assert torch.equal(got.eligible, want.eligible)
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-4)
    assert (got.ids == want.ids).float().mean() > 0.99  # the rest: near-ties, as assert_same_answers allows
