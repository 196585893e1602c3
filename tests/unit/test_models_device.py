"""Scorers run on their device: user state is built there and scoring happens there; only the ad
tower's output (what the publisher stores) comes back to the CPU.

There is no GPU here, so the device checks use PyTorch's `meta` device: any tensor left on the CPU
and mixed with the model's would raise, exactly as a CPU tensor would against a CUDA model."""
from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest
import torch

from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.serving import ModelScorer
from andromeda_core.models.towers import Dims, UserState
from andromeda_core.models.two_tower import HashedTwoTower
from andromeda_core.types import parse_event
from tests.conftest import upsert
from tests.unit.test_model_serving import request

META = torch.device("meta")
CPU = torch.device("cpu")


def model_scorer(schema, kind: str = "moe", device: str | torch.device = "cpu") -> ModelScorer:
    """An untrained model whose segment expert reads the text of two described values (users_of declares one)."""
    torch.manual_seed(0)
    described = (np.array(sorted(zlib.crc32(t.encode()) for t in ("interests=running", "interests=jazz"))),
                 torch.randn((2, 384)).half())
    return ModelScorer(RetrievalModel(kind, Dims(categories=4), described=described), ["sports", "food", "travel"],
                       schema, device)


def lookup(dim: int):
    """An index lookup answering from the CPU (as AdIndex.embeddings_of does): every ad found."""
    def embeddings_of(ad_ids):
        return torch.ones((len(ad_ids), dim)) / dim**0.5, torch.ones(len(ad_ids), dtype=torch.bool)
    return embeddings_of


def users_of(scorer, batch: int = 2):
    declaring = request()
    declaring.user.attributes["interests"] = ["running"]
    return scorer.encode_users([declaring] * batch, lookup(scorer.dim), [3600 * 30] * batch)


def state_tensors(users) -> list[torch.Tensor]:
    return [users.experts, users.keys, users.mask] if isinstance(users, UserState) else [users]


@pytest.mark.parametrize("kind", ["moe", "two_tower", "sasrec"])
def test_model_scorer_builds_user_state_and_scores_on_its_device(default_schema, kind):
    scorer = model_scorer(default_schema, kind, META)
    assert scorer.device == META and all(p.device == META for p in scorer.model.parameters())
    users = users_of(scorer)
    assert {t.device for t in state_tensors(users)} == {META}
    scores = scorer.score(users, torch.zeros((5, scorer.dim), device=META))
    assert scores.shape == (2, 5) and scores.device == META


def test_hashed_two_tower_builds_user_vectors_and_scores_on_its_device():
    scorer = HashedTwoTower(dim=16, buckets=64, device=META)
    assert scorer.device == META and scorer.table.device == META
    users = users_of(scorer)
    assert users.shape == (2, 16) and users.device == META
    assert scorer.score(users, torch.zeros((3, 16), device=META)).device == META


@pytest.mark.parametrize("make", [lambda schema: model_scorer(schema), lambda schema: HashedTwoTower(dim=16, buckets=64)])
def test_defaults_to_the_cpu_and_encode_ads_returns_cpu_float32(default_schema, make):
    scorer = make(default_schema)
    assert scorer.device == CPU and all(t.device == CPU for t in state_tensors(users_of(scorer)))
    ads = [parse_event(upsert(i, title=t)).ad for i, t in enumerate(["running shoes", "espresso machine"], 1)]
    stored = scorer.encode_ads(ads)
    assert stored.shape == (2, scorer.dim) and stored.dtype == torch.float32 and stored.device == CPU


def test_to_and_load_accept_a_torch_device(default_schema, tmp_path):
    scorer = model_scorer(default_schema)
    scorer.model.save(tmp_path / "m.safetensors", {"categories": ["sports", "food", "travel"]})
    loaded = ModelScorer.load(tmp_path / "m.safetensors", default_schema, device=CPU)
    assert loaded.device == CPU
    assert torch.equal(users_of(loaded).experts, users_of(scorer).experts)
    assert loaded.to(META) is loaded and loaded.device == META and users_of(loaded).experts.device == META
    assert ModelScorer.load(tmp_path / "m.safetensors", default_schema, device=META).device == META
    two_tower = HashedTwoTower(dim=16, buckets=64)
    assert two_tower.to(META) is two_tower and two_tower.table.device == META


def test_user_state_slices_moves_and_pickles(default_schema):
    users = users_of(model_scorer(default_schema), batch=3)
    one = users[1:2]
    assert one.experts.shape[0] == 1 and torch.equal(one.experts[0], users.experts[1])
    moved = users.to(META)
    assert isinstance(moved, UserState) and {t.device for t in state_tensors(moved)} == {META}
    assert moved.experts.shape == users.experts.shape and moved.mask.dtype == torch.bool
    back = pickle.loads(pickle.dumps(users))
    assert all(torch.equal(a, b) for a, b in zip(state_tensors(back), state_tensors(users)))
