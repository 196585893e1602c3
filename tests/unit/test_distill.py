"""Distillation: the teacher's targets are its full-corpus top-k, and training on them moves the student."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from andromeda_core.models.distill import Teacher, ask_teacher
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.train import TrainConfig, _rows, example_weights, train
from tests.unit.test_models import DIMS, tiny_data


def test_teacher_targets_are_the_rankers_top_k_at_the_validation_state():
    torch.manual_seed(0)
    data, ranker = tiny_data(), RetrievalModel("ranker", DIMS)
    teacher = ask_teacher(ranker, data, k=7, progress=False)
    assert teacher.top.shape == (12, 7) and teacher.positions.tolist() == [4] * 12
    with torch.no_grad():
        stored, text = ranker.item_vectors(data.items), torch.from_numpy(data.items.text).float()
        scores = ranker.score(ranker.users(user_inputs(data, stored, teacher.users, teacher.positions,
                                                       ranker.dims.history)), stored, text)
    for i, (u, p) in enumerate(zip(teacher.users, teacher.positions)):
        history = data.users.items[u][:p]
        assert not set(teacher.top[i]) & set(history.tolist())
        scores[i, torch.from_numpy(history)] = float("-inf")
        assert teacher.top[i].tolist() == scores[i].topk(7).indices.tolist()


def test_the_teacher_ranks_without_its_click_prior():
    """The student gets the prior after training; a teacher with it would hand it over twice."""
    torch.manual_seed(0)
    data, ranker = tiny_data(), RetrievalModel("ranker", DIMS)
    plain = ask_teacher(ranker, data, k=7, progress=False)
    ranker.set_click_prior(data.items.ids, np.linspace(5, -5, 40))  # would put items 0.. first
    assert ask_teacher(ranker, data, k=7, progress=False).top.tolist() == plain.top.tolist()
    assert ranker.click_logodds.abs().sum() > 0  # held again after


def test_the_teacher_is_asked_for_the_first_users_with_a_validation_engagement():
    data, ranker = tiny_data(), RetrievalModel("ranker", DIMS)
    first = ask_teacher(ranker, data, users=5, k=7, progress=False)
    assert first.users.tolist() == data.eval_users()[:5].tolist()
    assert first.top.tolist() == ask_teacher(ranker, data, k=7, progress=False).top[:5].tolist()


def test_only_a_ranker_can_teach():
    with pytest.raises(ValueError, match="ranker"):
        ask_teacher(RetrievalModel("moe", DIMS), tiny_data(), progress=False)


def fixed_teacher(data, favourites: list[int]) -> Teacher:
    users = data.eval_users()
    return Teacher(users, np.array([data.split(u)[0] for u in users]), np.tile(favourites, (len(users), 1)))


def test_training_rows_add_weighted_teacher_rows():
    data = tiny_data()
    teacher = fixed_teacher(data, [35, 36, 37, 38, 39])
    examples = data.train_examples()
    cfg = TrainConfig(batch=8, teacher_rows=4, distill=0.25)
    draw = example_weights(data, examples, balanced=False)
    users, positions, positives, known, weights = _rows(data, examples, draw, teacher, cfg, np.random.default_rng(0))
    assert len(users) == len(positions) == len(positives) == len(known) == len(weights) == 12
    assert weights.tolist() == [1.0] * 8 + [0.25] * 4
    assert (known[:8, 0] == positives[:8]).all() and (known[:8, 1:] == -1).all()
    assert set(positives[8:].tolist()) <= {35, 36, 37, 38, 39} and (known[8:] == [35, 36, 37, 38, 39]).all()
    assert (positions[8:] == 4).all()


def share_in_top(model: RetrievalModel, data, items: list[int], k: int = 5) -> float:
    """Share of the top-k at the users' test states that are among `items`."""
    users = data.eval_users()
    with torch.no_grad():
        stored = model.item_vectors(data.items)
        state = model.users(user_inputs(data, stored, users, np.array([data.split(u)[1] for u in users]),
                                        model.dims.history))
        top = model.score(state, stored).topk(k, dim=1).indices
    return float(torch.isin(top, torch.tensor(items)).float().mean())


def test_distillation_pulls_the_teachers_favourites_into_the_students_top():
    """Mean over three seeds: one tiny run may learn the teacher slowly (seed 1: 0.17 of the favourites in the top;
    seeds 2 and 3: 1.0 and 0.95)."""
    data, favourites = tiny_data(), [35, 36, 37, 38, 39]
    shares = {"plain": [], "distilled": []}
    for seed in (1, 2, 3):
        cfg = TrainConfig(steps=120, batch=16, negatives=16, lr=5e-3, seed=seed, distill=2.0, teacher_rows=8,
                          validate_every=0)
        shares["plain"].append(share_in_top(train(data, "moe", cfg, progress=False), data, favourites))
        shares["distilled"].append(share_in_top(train(data, "moe", cfg, fixed_teacher(data, favourites), progress=False),
                                                data, favourites))
    assert np.mean(shares["distilled"]) >= 0.6 > 0.3 >= np.mean(shares["plain"])
