"""Distillation targets: what the ranker (the quality ceiling) would retrieve for each user.

The retrieval models learn to put the ranker's top-k near the top of their own ranking, the way a
production retriever is distilled from the ranking stage's logged scores. The teacher is asked at
each user's validation-time state (history = everything before the validation engagement), so no
held-out engagement is ever shown to it or to the student; evaluation uses the later test-time state.
The teacher ranks without its click prior: the student is trained without one and gets the same prior
after training, so a teacher with it would count the prior twice.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from andromeda_core.models.evaluate import rank_items
from andromeda_core.models.recdata import RecData
from andromeda_core.models.retrieval import RetrievalModel

TEACHER_TOP = 100
TEACHER_USERS = 1000  # users (the first with a validation engagement) whose top-k the ranker is asked for: it
# ranks the corpus in about 66 ms per user on one thread, so all 3,972 of the synthetic world's took 4 minutes, for
# 300 distillation steps that draw 128 of them each


@dataclass
class Teacher:
    """users (U,), positions (U,) of the states asked, top (U, k) the ranker's item rows, best first."""

    users: np.ndarray
    positions: np.ndarray
    top: np.ndarray


def ask_teacher(ranker: RetrievalModel, data: RecData, users: int | None = TEACHER_USERS, k: int = TEACHER_TOP,
                progress: bool = True) -> Teacher:
    """The ranker's top-k over the full corpus (history excluded) for the first `users` (every one when None) of
    the users with a validation engagement."""
    if ranker.kind != "ranker":
        raise ValueError(f"the teacher must be a ranker checkpoint, got a {ranker.kind!r} model")
    asked = data.eval_users()[:users]
    with ranker.without_click_prior():
        ranking = rank_items(ranker, data, asked, split=0, progress=progress)
    return Teacher(asked, np.array([data.split(u)[0] for u in asked]), ranking.top[:, :k])
