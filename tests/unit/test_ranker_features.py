"""The ranker's pair features (item-kNN against recent engagements, popularity, declared interests in the ad's
text) against a plain-Python reading of their definition; they never see held-out engagements or the user's own training row; the
ranker reads them in its wide and deep parts, everywhere it is scored."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from andromeda_core.models import features
from andromeda_core.models.evaluate import rank_items, ranking_from_scores, recall_within
from andromeda_core.models.features import RECENT, PairFeatures, interest_matches
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models import train as train_module
from andromeda_core.models.train import (DEEP_SCALES, TrainConfig, choose_pair_weights, scale_deep_part, train,
                                         validation_ranking, validation_score)
from tests.unit.test_baselines import HAND, random_data, rec_data
from tests.unit.test_models import DIMS, tiny_data


def brute_interest(name: str, text: str) -> bool:
    """The interest's words (underscores as spaces) as whole words of the text, in order, case ignored."""
    phrase = re.sub(r"[^a-z0-9]+", " ", name.lower()).strip()
    return bool(phrase) and f" {phrase} " in " " + re.sub(r"[^a-z0-9]+", " ", text.lower()).strip() + " "


def brute_features(data, u: int, p: int, keep: int | None = None) -> np.ndarray:
    """(N, F) by the definition: cosine over the other users' training sets, mean over the recent window
    (repeats counted, h == j skipped), log(1 + users who engaged j in training, u excluded), whether one of
    u's declared interests is in j's text."""
    n = len(data.items.ids)
    others = [set(s.tolist()) for v, s in enumerate(data.train_sequences()) if v != u]
    count = [sum(j in s for s in others) for j in range(n)]
    out = np.zeros((n, len(RECENT) + 2))
    for f, r in enumerate(RECENT):
        r = min(r, keep or r)
        recent = data.users.items[u][max(p - r, 0):p].tolist()
        for j in range(n):
            total = sum(sum(h in s and j in s for s in others) / math.sqrt(count[h] * count[j])
                        for h in recent if h != j and count[h] and count[j])
            out[j, f] = total / max(len(recent), 1)
    out[:, -2] = np.log1p(count)
    declared = data.users.interests[u] if data.users.interests else []
    texts = data.items.texts or [""] * n
    out[:, -1] = [any(brute_interest(name, texts[j]) for name in declared) for j in range(n)]
    return out


VOCAB = ("art", "arts", "Party", "audio", "equipment", "kids", "for", "Trains")


def with_interests(data, seed: int):
    """data with random texts for its items and declared interests (of 1 to 2 words) for its users."""
    rng = np.random.default_rng(seed)
    data.items.texts = [" ".join(rng.choice(VOCAB, rng.integers(0, 6))) + rng.choice(["", ".", "!"])
                        for _ in data.items.ids]
    data.users.interests = [["_".join(rng.choice(VOCAB, rng.integers(1, 3))).lower() for _ in range(rng.integers(0, 4))]
                            for _ in data.users.items]
    return data


@pytest.mark.parametrize("seed", range(6))
def test_features_equal_the_brute_force_definition(seed):
    data = with_interests(random_data(seed, n_items=9, n_users=7), seed)
    rng = np.random.default_rng(seed)
    users = np.array([0, 1, 2, 3, 4, 5, 6, 2])
    positions = np.array([rng.integers(0, len(data.users.items[u]) + 1) for u in users])
    got = PairFeatures.fit(data).dense(data, users, positions).numpy()
    assert got[..., -1].any() and not got[..., -1].all()  # the interest feature is tested at 0 and at 1
    for b, (u, p) in enumerate(zip(users, positions)):
        np.testing.assert_allclose(got[b], brute_features(data, u, p), atol=1e-6)
    candidates = np.array([4, 0, 4, 8, 2])
    assert torch.equal(PairFeatures.fit(data).pairs(data, users, positions, candidates), torch.from_numpy(got[:, candidates]))
    short = PairFeatures.fit(data).dense(data, users, positions, keep=2).numpy()
    for b, (u, p) in enumerate(zip(users, positions)):
        np.testing.assert_allclose(short[b], brute_features(data, u, p, keep=2), atol=1e-6)


def test_features_on_hand_made_data():
    """User 2 at its test position (history 0, 2, 5, 3, 6: the window of 5 holds it all), candidate 1.
    The other users' training sets: {0, 1, 2}, {1, 2, 5}, {1, 5}, {0, 1, 2, 3, 6} (1 in all four, 0 in
    two, 2 in three, 5 in two, 3 and 6 in one); 1 is with 0 in two, with 2 in three, with 5 in two,
    with 3 and with 6 in one."""
    data = rec_data(HAND, 8)
    got = PairFeatures.fit(data).dense(data, np.array([2]), np.array([5]))[0].numpy()
    knn = (2 / math.sqrt(2 * 4) + 3 / math.sqrt(3 * 4) + 2 / math.sqrt(2 * 4) + 2 / math.sqrt(1 * 4)) / 5
    assert got[1, 0] == pytest.approx(1 / math.sqrt(1 * 4))  # the last engagement alone: 6
    assert got[1, 1] == pytest.approx(knn) and got[1, 2] == pytest.approx(knn)
    assert got[1, 3] == pytest.approx(math.log(5))
    assert got[4].tolist() == [0.0] * 5 and got[7].tolist() == [0.0] * 5  # never engaged in training, no interests


def test_interest_matches_whole_words_in_order():
    texts = ["Zen audio equipment sale. Audio for kids", "Party arts", "equipment audio", "trains_kids club", ""]
    interests = [["audio_equipment"], ["art"], ["arts", "kids"], [], ["TRAINS_KIDS", "club_sale"]]
    got = interest_matches(texts, interests, 6).toarray()
    assert got.tolist() == [[1, 0, 0, 0, 0, 0],  # not "equipment audio": the words in order
                            [0, 0, 0, 0, 0, 0],  # "art" is not a word of "Party" nor "arts"
                            [1, 1, 0, 1, 0, 0],  # "kids" is a word of "trains_kids"
                            [0] * 6,
                            [0, 0, 0, 1, 0, 0]]  # the text's underscore separates words too
    assert interest_matches([], [["art"]], 2).toarray().tolist() == [[0, 0]]


def test_features_never_see_held_out_engagements_nor_the_users_own_row():
    """Changing every user's last two engagements (validation, test) changes no feature at a training
    position; changing user u's own later engagements changes none of u's features at p."""
    data = random_data(3, n_items=12, n_users=8)
    users = np.arange(8)
    positions = np.array([max(len(s) - 3, 0) for s in data.users.items])
    before = PairFeatures.fit(data).dense(data, users, positions)
    for seq in data.users.items:
        seq[-2:] = (seq[-2:] + 5) % 12
    assert torch.equal(PairFeatures.fit(data).dense(data, users, positions), before)
    u, p = 4, 1
    mine = PairFeatures.fit(data).dense(data, np.array([u]), np.array([p]))
    data.users.items[u][p:] = (data.users.items[u][p:] + 7) % 12
    assert torch.equal(PairFeatures.fit(data).dense(data, np.array([u]), np.array([p])), mine)


def test_the_ranker_reads_the_features_in_its_wide_and_deep_parts():
    """Factored first layer = the plain MLP over the concatenated pair with the features; the wide part
    adds weights . features; absent features read as zero."""
    torch.manual_seed(3)
    data, model = tiny_data(), RetrievalModel("ranker", DIMS)
    stored, text = model.item_vectors(data.items), torch.from_numpy(data.items.text).float()
    state = model.users(user_inputs(data, stored, np.array([0, 1, 2]), np.array([3, 0, 5]), DIMS.history))
    cross = torch.rand(3, 40, features.N_FEATURES)
    torch.nn.init.normal_(model.head.mlp[-1].weight)
    with torch.no_grad():
        model.head.cross.copy_(torch.tensor([0.3, -0.2, 0.1, 0.4, 0.7]))
        experts = state.experts * state.mask[..., None]
        products = torch.einsum("bed,nd->bned", experts, stored[:, : DIMS.dim]).flatten(2)
        ad = torch.cat([stored[:, :-1], model.head.text(text)], 1)  # all but the bias
        pair = torch.cat([experts.flatten(1)[:, None].expand(3, 40, -1), products, ad[None].expand(3, -1, -1), cross], -1)
        deep = model.head.mlp(pair).squeeze(-1)
        wide = model.head.wide.score(state, stored) + cross @ model.head.cross
        assert torch.allclose(model.score(state, stored, text, cross), deep + wide, atol=1e-5)
        assert torch.allclose(model.score(state, stored, text),
                              model.score(state, stored, text, torch.zeros_like(cross)), atol=1e-6)
    assert model.pair_features and not RetrievalModel("moe", DIMS).pair_features
    assert model.head.flops_per_pair() > features.FLOPS_PER_PAIR >= sum(RECENT)


def test_rank_items_gives_the_ranker_its_features_and_new_ads_only_interest():
    torch.manual_seed(1)
    data, model = with_interests(tiny_data(), 5), RetrievalModel("ranker", DIMS)
    with torch.no_grad():
        model.head.cross.copy_(torch.tensor([2.0, 1.0, 0.5, 0.2, 1.0]))
    users = data.eval_users()[:5]
    positions = np.array([data.split(u)[1] for u in users])
    stored, text = model.item_vectors(data.items), torch.from_numpy(data.items.text).float()
    with torch.no_grad():
        state = model.users(user_inputs(data, stored, users, positions, DIMS.history, keep=2))
        cross = PairFeatures.fit(data).dense(data, users, positions, keep=2)
        want = ranking_from_scores(model.score(state, stored, text, cross), data, users, positions)
    got = rank_items(model, data, users, keep=2, progress=False)
    assert np.array_equal(got.top, want[0]) and np.array_equal(got.target_rank, want[1])
    with torch.no_grad():
        new = model.item_vectors(data.items, known=torch.zeros(40, dtype=torch.bool))
        state = model.users(user_inputs(data, new, users, positions, DIMS.history))
        full = PairFeatures.fit(data).dense(data, users, positions)
        assert full[..., -1].any()  # some declared interest is in some ad's text
        cross = torch.cat([torch.zeros_like(full[..., :-1]), full[..., -1:]], -1)  # nothing read from engagements
        want = ranking_from_scores(model.score(state, new, text, cross), data, users, positions)
        without = ranking_from_scores(model.score(state, new, text), data, users, positions)
    got = rank_items(model, data, users, content_only=True, progress=False)
    assert np.array_equal(got.top, want[0]) and not np.array_equal(got.top, without[0])


def test_pair_weights_are_chosen_on_validation_within_the_funnel_and_stay_fixed(monkeypatch):
    """Each combination's score is the validation score of the ranker with those wide weights (deep part
    silent) and its share kept, where measured, is the share of its top-100 inside the MoE's top-1000; the choice
    is the best-scoring combination that keeps the funnel (of equal scores, the earlier), as measuring every share
    by brute force chooses, its shares measured SHARES_CHECKED at a time from the best score down; a warm-started
    ranker keeps the weights chosen while its deep part trains."""
    data = with_interests(tiny_data(n_items=1200, n_users=30), 2)
    moe = train(data, "moe", TrainConfig(steps=30, batch=16, negatives=16, seed=1, validate_every=0), progress=False)
    model = RetrievalModel("ranker", moe.dims, moe.item_ids, described=moe.described)
    model.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("head.")}, strict=False)
    users = data.eval_users()
    grid = ((0.0, 30.0), (0.0, 20.0), (0.0, 10.0), (0.0, -1.0), (0.0, 5.0))
    moe_top = rank_items(moe, data, users, split=0, progress=False).top[:, :1000]
    monkeypatch.setattr(train_module, "SHARES_CHECKED", 3)  # several passes where the best-scoring fall short
    chosen, measured = {}, {}
    for funnel in (0.0, 0.99, 1.0):
        scores = choose_pair_weights(model, data, users, PairFeatures.fit(data), grid, funnel=funnel)
        chosen[funnel] = tuple(model.head.cross.tolist())
        shares = {w: kept for w, (_, kept) in scores.items() if kept is not None}
        assert len(scores) == 32 and (len(shares) % 3 == 0 or len(shares) == 32)
        if funnel == 0.0:  # the best-scoring keeps it: one pass measured
            assert len(shares) == 3
        measured.update(shares)
    assert len(measured) > 3  # a funnel of 99% or 100% turned the best-scoring down
    brute = {}
    for weights, (score, _) in scores.items():
        with torch.no_grad():
            model.head.cross.copy_(torch.tensor(weights))
        assert validation_score(model, data, users) == pytest.approx(score)
        top = rank_items(model, data, users, split=0, progress=False).top[:, :100]
        brute[weights] = np.mean([len(set(t) & set(m)) / len(t) for t, m in zip(top, moe_top)])
        assert measured.get(weights, brute[weights]) == pytest.approx(brute[weights])
    for funnel, weights in chosen.items():  # the old rule: max over those that keep the funnel keeps the first of equals
        assert weights == max((w for w in scores if brute[w] >= funnel), key=lambda w: scores[w][0])
    ranker = train(data, "ranker", TrainConfig(steps=12, batch=16, negatives=16, seed=1, validate_every=6,
                                               pair_users=len(users)), init=moe, progress=False)
    chosen = RetrievalModel("ranker", moe.dims, moe.item_ids, described=moe.described)
    chosen.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("head.")}, strict=False)
    choose_pair_weights(chosen, data, users, PairFeatures.fit(data))
    assert torch.equal(ranker.head.cross, chosen.head.cross)


def test_the_trained_deep_part_is_scaled_down_into_the_funnel():
    """A warm-started ranker's trained deep part is scaled by the best-scoring of DEEP_SCALES whose validation top-100
    keeps cfg.funnel inside the MoE's validation top-1000 (0 always allowed). Held to nothing, it is kept whole and
    moves more than 1% of the top-100 out; held to 99%, the same wide weights and deep part are scaled by the
    best-scoring scale that keeps 99%, each scale's score and share being those of the ranker at that scale."""
    data = with_interests(tiny_data(n_items=1200, n_users=30), 2)
    moe = train(data, "moe", TrainConfig(steps=30, batch=16, negatives=16, seed=1, validate_every=0), progress=False)
    users = data.eval_users()
    moe_top = validation_ranking(moe, data, users).top
    kept, layers, scales, rankers = {}, {}, {}, {}
    for funnel in (0.0, 0.99):
        cfg = TrainConfig(steps=40, batch=16, negatives=16, seed=1, validate_every=10, patience=4, funnel=funnel,
                          validation_users=len(users), pair_users=len(users))
        rankers[funnel] = ranker = train(data, "ranker", cfg, init=moe, progress=False)
        assert ranker.head.cross.tolist() == [10.0, 0.0, 0.0, 0.0, 0.0]
        layers[funnel], scales[funnel] = ranker.head.mlp[-1].weight.detach().clone(), ranker.dims.deep_scale
        kept[funnel] = recall_within(validation_ranking(ranker, data, users).top[:, :100], moe_top)
    assert kept[0.0] < 0.99 <= kept[0.99] and layers[0.0].any()
    assert scales[0.0] == 1.0 and scales[0.99] in DEEP_SCALES[1:]
    assert torch.equal(layers[0.99], layers[0.0] * scales[0.99])
    whole = rankers[0.0]
    layer = whole.head.mlp[-1]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    out = scale_deep_part(whole, data, users, moe_top, 0.99)  # the choice that training held to 99% made
    assert whole.dims.deep_scale == scales[0.99] and torch.equal(layer.weight, layers[0.99])
    allowed = {scale: score for scale, (score, share) in out.items() if share >= 0.99 or scale == 0.0}
    assert list(out) == list(DEEP_SCALES) and out[scales[0.99]][0] == max(allowed.values())
    for scale, (score, share) in out.items():  # each scale's score and share are the ranker's at that scale
        with torch.no_grad():
            layer.weight.copy_(weight * scale)
            layer.bias.copy_(bias * scale)
        ranking = validation_ranking(whole, data, users)
        assert score == validation_score(whole, data, users) and share == recall_within(ranking.top[:, :100], moe_top)
    with pytest.raises(ValueError, match="funnel"):
        TrainConfig(funnel=1.5)


def test_a_feature_that_is_zero_everywhere_keeps_weight_zero_only():
    """Without declared interests (MovieLens) the interest feature is 0 for every pair: only its weight 0 is tried,
    with the same scores for the other features' combinations."""
    data = with_interests(tiny_data(n_items=300, n_users=20), 4)
    moe = train(data, "moe", TrainConfig(steps=10, batch=16, negatives=16, seed=1, validate_every=0), progress=False)
    model = RetrievalModel("ranker", moe.dims, moe.item_ids, described=moe.described)
    model.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("head.")}, strict=False)
    users, grid = data.eval_users(), ((0.0, 10.0), (0.0,), (0.0,), (0.0, 0.5), (0.0, 4.0))
    live = choose_pair_weights(model, data, users, PairFeatures.fit(data), grid, funnel=0.0)
    data.users.interests = [[] for _ in data.users.items]
    assert PairFeatures.fit(data).live() == (True, True, True, True, False)
    dead = choose_pair_weights(model, data, users, PairFeatures.fit(data), grid, funnel=0.0)
    assert len(live) == 8 and sorted(dead) == [w for w in sorted(live) if w[-1] == 0.0]
    assert all(dead[w] == live[w] for w in dead)
    assert model.head.cross[-1].item() == 0.0


def test_pair_features_refuse_interests_or_texts_of_another_length():
    data = with_interests(random_data(1, n_items=9, n_users=7), 1)
    data.users.interests = data.users.interests[:-1]
    with pytest.raises(ValueError, match="6 users' interests"):
        PairFeatures.fit(data)
    data = with_interests(random_data(1, n_items=9, n_users=7), 1)
    data.items.texts = data.items.texts[:3]
    with pytest.raises(ValueError, match="3 item texts"):
        PairFeatures.fit(data)
