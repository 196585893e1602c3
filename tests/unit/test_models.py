"""Retrieval models: shapes, masking, causality, learned ids and their content fallback, logQ, determinism,
top-n routing, overfitting, warm start, checkpoints, int8."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from andromeda_core.quantization import quantize_int8, round_trip
from andromeda_core.models.features import N_FEATURES
from andromeda_core.models.heads import MoEHead
from andromeda_core.models.recdata import Items, RecData, Users
from andromeda_core.models.retrieval import RetrievalModel, user_inputs
from andromeda_core.models.towers import BID_FEATURE_MAX, Dims, SequenceEncoder, UserState
from andromeda_core.models.train import (CLICK_SMOOTHINGS, CLICK_WEIGHTS, TrainConfig, choose_click_prior, default_config,
                                         expert_losses, item_probability, log_q, lr_schedule, new_model, other_start,
                                         training_steps, train, validation_score)

DIMS = Dims(dim=16, gate=8, semantic=8, interests=2, categories=5)


def tiny_data(n_items: int = 40, n_users: int = 12, seed: int = 0) -> RecData:
    """Users engage with the items of one 'taste' block each; texts differ by block."""
    rng = np.random.default_rng(seed)
    text = rng.standard_normal((n_items, 384)).astype(np.float16)
    items = Items(ids=np.arange(1, n_items + 1), text=text, category=np.arange(n_items) % 4,
                  advertiser=np.arange(n_items) % 7, bid=np.ones(n_items, np.float32), categories=["a", "b", "c", "d"])
    seqs = [np.array([(u * 3 + j) % n_items for j in range(6)]) for u in range(n_users)]
    users = Users(items=seqs, events=[np.ones(6, np.int64) for _ in seqs], times=[np.arange(6) * 3600 for _ in seqs],
                  segments=[[u % 3] for u in range(n_users)], co_items=[[int(s[0])] for s in seqs],
                  context=np.zeros((n_users, 3), np.int64), now=np.full(n_users, 6 * 3600))
    return RecData("tiny", items, users)


KINDS = ["moe", "two_tower", "sasrec", "ranker"]


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_and_masking(kind):
    torch.manual_seed(0)
    data, model = tiny_data(), RetrievalModel(kind, DIMS, np.arange(1, 21)).eval()
    stored = model.item_vectors(data.items)
    assert stored.shape == (40, DIMS.stored)
    inputs = user_inputs(data, stored, np.array([0, 1, 2]), np.array([3, 0, 5]), DIMS.history)
    assert inputs.hist.shape == (3, 5, DIMS.stored) and inputs.hist_mask.sum(1).tolist() == [3, 0, 5]  # to the longest
    state = model.users(inputs)
    assert state.experts.shape == (3, DIMS.experts, DIMS.dim) and state.keys.shape == (3, DIMS.experts, DIMS.gate)
    # No history: the sequence expert (its empty-history vector), cohort and co-engagement answer.
    assert state.mask[1].tolist() == [True, False, False, True, False, True]
    text = torch.from_numpy(data.items.text).float()
    scores = model.score(state, stored, text)
    assert scores.shape == (3, 40) and torch.isfinite(scores).all()
    # Padding is inert: the same histories with different padded-out values score the same.
    inputs.hist[1] = torch.randn_like(inputs.hist[1])
    inputs.hist[0, 3:], inputs.hist_age[0, 3:], inputs.hist_event[0, 3:] = torch.randn_like(inputs.hist[0, 3:]), 7.0, 4
    assert torch.allclose(model.score(model.users(inputs), stored, text), scores, atol=1e-6)


def test_the_sequence_encoder_is_causal():
    """A later engagement cannot change an earlier position's output; it does change its own."""
    torch.manual_seed(0)
    encoder = SequenceEncoder(DIMS).eval()
    tokens, mask = torch.randn(2, 7, DIMS.dim), torch.ones(2, 7, dtype=torch.bool)
    changed = tokens.clone()
    changed[:, 4:] = torch.randn(2, 3, DIMS.dim)
    before, after = encoder(tokens, mask), encoder(changed, mask)
    assert torch.allclose(before[:, :4], after[:, :4], atol=1e-6)
    assert not torch.allclose(before[:, 4:], after[:, 4:], atol=1e-3)


def test_an_ad_without_a_learned_id_gets_its_content_vector():
    """Ads 1-20 have learned ids; ad 25 was created after training: the content tower alone embeds it,
    exactly as it embeds a known ad whose id is withheld, and a learned id moves a known ad's vector."""
    torch.manual_seed(0)
    data, model = tiny_data(), RetrievalModel("moe", DIMS, np.array([3, 1, 2] + list(range(4, 21))))
    with torch.no_grad():
        model.ad_tower.identity.weight[:-1].normal_()  # as after training; the last row (no id) stays zero
        assert model.id_rows(torch.tensor([1, 20, 25, 0])).tolist() == [0, 19, -1, -1]
        with_ids = model.item_vectors(data.items)
        content = model.item_vectors(data.items, known=torch.zeros(40, dtype=torch.bool))
    assert torch.equal(with_ids[20:], content[20:])  # ids 21-40: never learned
    assert not torch.allclose(with_ids[:20, : DIMS.dim], content[:20, : DIMS.dim])
    assert torch.equal(with_ids[:20, DIMS.dim: -1], content[:20, DIMS.dim: -1])  # gating query, semantic: content


def test_a_bid_reads_as_at_most_the_bid_feature_cap():
    """The ad tower reads the bid (another bid, another vector), but a bid past BID_FEATURE_MAX, which it was never
    trained on, embeds as one at the cap: an advertiser cannot outscore every ad by bidding 1e30."""
    torch.manual_seed(0)
    tower = RetrievalModel("moe", DIMS, np.array([], np.int64)).ad_tower.eval()
    text, category, advertiser = torch.randn(4, 384), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    bids = torch.tensor([1.0, BID_FEATURE_MAX, 1e30, 3.4e38])
    with torch.no_grad():
        out = tower(text[:1].expand(4, -1), category, advertiser, bids, torch.full((4,), -1), torch.zeros(4, DIMS.dim))
    assert not torch.equal(out[0], out[1])
    assert torch.equal(out[2], out[1]) and torch.equal(out[3], out[1])


def test_the_click_prior_moves_only_the_score_by_its_weight():
    """An ad's bias gains click_weight x its click log-odds, known by external id (learned identity or not);
    an ad embedded as new gets none; the user towers and the ranker's deep part never read it."""
    torch.manual_seed(0)
    data = tiny_data()
    for kind in ("moe", "ranker"):
        model = RetrievalModel(kind, DIMS, np.arange(1, 21)).eval()
        with torch.no_grad():
            model.head.mlp[-1].weight.normal_() if kind == "ranker" else None  # the deep part speaks
            before = model.item_vectors(data.items)
            state = model.users(user_inputs(data, before, np.array([0, 1]), np.array([4, 5])))
            text = torch.from_numpy(data.items.text).float()
            scores = model.score(state, before, text)
            model.set_click_prior(data.items.ids[::-1][:30], np.linspace(-1, 1, 30))  # ads 40 .. 11, any order
            after = model.item_vectors(data.items)
            prior = torch.zeros(40)
            prior[10:] = torch.linspace(-1, 1, 30, dtype=torch.float32).flip(0)
            assert torch.equal(after[:, :-1], before[:, :-1])
            assert torch.allclose(after[:, -1] - before[:, -1], DIMS.click_weight * prior, atol=1e-6)
            moved = model.users(user_inputs(data, after, np.array([0, 1]), np.array([4, 5])))
            assert torch.equal(moved.experts, state.experts)
            assert torch.allclose(model.score(moved, after, text) - scores, DIMS.click_weight * prior, atol=1e-5)
            new = model.item_vectors(data.items, known=torch.zeros(40, dtype=torch.bool))
            with model.without_click_prior():
                assert torch.equal(model.item_vectors(data.items), before)
                assert torch.equal(model.item_vectors(data.items, known=torch.zeros(40, dtype=torch.bool)), new)
            assert torch.equal(model.item_vectors(data.items), after)  # restored


def test_training_adds_the_datas_click_prior_after_training():
    """Trained (and validated) without a prior, even when going on from a model that holds one; the
    data's prior is held after."""
    data = tiny_data()
    data.users.shown = [np.array([[(u * 3 + 7) % 40, u % 2]]) for u in range(len(data.users.items))]
    cfg = TrainConfig(steps=4, batch=8, negatives=4, validate_every=2)
    model = train(data, "moe", cfg, progress=False)
    assert torch.equal(model.click_prior(torch.from_numpy(data.items.ids)),
                       torch.from_numpy(data.click_logodds(model.dims.click_smoothing)))
    assert model.click_logodds.abs().sum() > 0
    seen = []
    original = RetrievalModel.score
    RetrievalModel.score = lambda self, state, stored, *a: seen.append(self.click_logodds.abs().sum().item()) \
        or original(self, state, stored, *a)
    try:
        again = train(data, "moe", cfg, init=model, progress=False)
    finally:
        RetrievalModel.score = original
    assert seen and not any(seen)  # every training and validation score ran without the prior
    assert torch.equal(again.click_logodds, model.click_logodds)
    plain = train(tiny_data(), "moe", cfg, progress=False)
    assert not len(plain.click_ids)  # no impressions logged: no prior


def test_a_click_weight_set_for_training_is_the_models_and_must_be_finite():
    """TrainConfig.click_weights (`andromeda train --click-weight`): validation then chooses only the smoothing."""
    data = tiny_data()
    data.users.shown = [np.array([[(u * 3 + 7) % 40, u % 2]]) for u in range(len(data.users.items))]
    model = train(data, "moe", TrainConfig(steps=2, batch=8, negatives=4, validate_every=0, click_weights=(3.0,)),
                  progress=False)
    assert model.dims.click_weight == 3.0 and model.click_logodds.abs().sum() > 0  # 3: not among CLICK_WEIGHTS
    for weights in ((), (-1.0,), (float("inf"),), (float("nan"),)):
        with pytest.raises(ValueError, match="click_weights"):
            TrainConfig(click_weights=weights)


def test_the_click_prior_is_chosen_on_the_validation_engagements_over_the_whole_corpus():
    """Every user's validation item was clicked the one time it was shown, 20 other items never: with no weight
    the untrained model ranks the validation items anywhere, with weight they lead the corpus. The pair with the
    best validation score is kept (the first of equals), with its log-odds as the prior, and the model then
    scores exactly that on validation. Data without impressions holds no prior and keeps its dims."""
    torch.manual_seed(0)
    data = tiny_data()
    users = np.arange(len(data.users.items))
    validation = [int(data.users.items[u][data.split(u)[0]]) for u in users]
    others = [i for i in range(40) if i not in validation][:20]
    data.users.shown = [np.array([[validation[u], 1]] + [[o, 0] for o in others]) for u in users]
    model = RetrievalModel("moe", DIMS, np.arange(1, 41)).eval()
    scores = choose_click_prior(model, data, None, users)
    assert list(scores) == [(s, w) for s in CLICK_SMOOTHINGS for w in CLICK_WEIGHTS]
    best = max(scores.values())
    assert scores[CLICK_SMOOTHINGS[0], 0.0] < best
    chosen = next(key for key, score in scores.items() if score == best)
    assert (model.dims.click_smoothing, model.dims.click_weight) == chosen and chosen[1] > 0
    assert torch.equal(model.click_prior(torch.from_numpy(data.items.ids)), torch.from_numpy(data.click_logodds(chosen[0])))
    assert validation_score(model, data, users) == best
    data.users.shown = []  # no impressions logged
    model = RetrievalModel("moe", DIMS, np.arange(1, 41)).eval()
    assert choose_click_prior(model, data, None, users) == {} and model.dims == DIMS and not len(model.click_ids)


def test_log_q_is_the_log_of_each_candidates_expected_count():
    """3 items; engagements drawn with item probabilities [0.5, 0.3, 0.2]; 4 rows, 6 uniform negatives,
    2 teacher rows drawn from [0, 0.5, 0.5]: expected counts 4 * p + 6 / 3 + 2 * t."""
    engaged = item_probability(np.array([0, 0, 1, 2, 0, 1]), np.array([0.2, 0.2, 0.15, 0.2, 0.1, 0.15]), 3)
    assert np.allclose(engaged, [0.5, 0.3, 0.2])
    cfg = TrainConfig(batch=4, negatives=6, teacher_rows=2)
    candidates = np.array([2, 0, 1, 1])
    assert torch.allclose(log_q(candidates, engaged, None, cfg, 3), torch.log(torch.tensor([2.8, 4.0, 3.2, 3.2])))
    taught = np.array([0.0, 0.5, 0.5])
    assert torch.allclose(log_q(candidates, engaged, taught, cfg, 3), torch.log(torch.tensor([3.8, 4.0, 4.2, 4.2])))


def test_expert_losses_are_each_usable_experts_own_sampled_softmax():
    """Candidates a = [1, 0], [0, 1], [1, 1] with biases 0, 0, ln 2 and logQ 0, ln 2, 0. Row 0 (positive: candidate
    0, candidate 2 an accidental hit) has experts [1, 0] and [0, 1]: losses log(1 + 0.5 / e) and log(1 + e / 2).
    Row 1 (positive: candidate 1) has [1, 1] and an expert without input, which does not count: log(3 + 4e)."""
    dims, ln2, e = Dims(dim=2, gate=1, semantic=1), float(np.log(2)), float(np.e)
    candidates = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 0, 0, 0], [1, 1, 0, 0, ln2]])
    state = UserState(torch.tensor([[[1.0, 0], [0, 1]], [[1, 1], [5, 5]]]), torch.zeros(2, 2, 1),
                      torch.tensor([[True, True], [True, False]]))
    hit = torch.tensor([[False, False, True], [False, False, False]])
    losses = expert_losses(dims, state, candidates, torch.tensor([0, ln2, 0]), hit)
    expected = [(np.log(1 + 0.5 / e) + np.log(1 + e / 2)) / 2, np.log(3 + 4 * e)]
    assert torch.allclose(losses, torch.tensor(expected, dtype=torch.float32))


def test_the_moe_goes_on_from_a_sasrec_and_from_no_other_kind():
    """The SASRec-style two-tower's weights are the MoE's (neither head has any): the MoE starts from all of them."""
    data = tiny_data()
    tiny = TrainConfig(steps=10, batch=16, negatives=16, seed=1, validate_every=0)
    sasrec, two_tower = (train(data, kind, tiny, progress=False) for kind in ("sasrec", "two_tower"))
    went_on = train(data, "moe", TrainConfig(steps=1, batch=16, negatives=16, seed=2, lr=1e-9, validate_every=0),
                    init=sasrec, progress=False)
    assert went_on.state_dict().keys() == sasrec.state_dict().keys()
    for name, weight in sasrec.state_dict().items():
        assert torch.allclose(went_on.state_dict()[name].float(), weight.float(), atol=1e-6), name
    with pytest.raises(ValueError, match="a moe goes on only from a moe or a sasrec, not a two_tower"):
        train(data, "moe", tiny, init=two_tower, progress=False)
    assert other_start("moe", sasrec) == "sasrec" and other_start("moe", went_on) == other_start("ranker", went_on) == ""
    assert default_config("moe", start="sasrec").expert_loss == 1 and default_config("moe").expert_loss == 0
    with_expert_loss = train(data, "moe", dataclasses.replace(tiny, expert_loss=1.0), init=sasrec, progress=False)
    without = train(data, "moe", tiny, init=sasrec, progress=False)
    assert not torch.equal(with_expert_loss.user_towers.keys.weight, without.user_towers.keys.weight)


def test_a_model_trains_about_twelve_passes_within_its_bounds():
    """Whole validations of 250 steps x 256 rows, at least 1,000 and at most 2,000 steps; the ranker, the steps going
    on from a MoE and a model of unknown data keep theirs."""
    assert [training_steps(n) for n in (18_630, 41_567, 99_006)] == [1000, 2000, 2000]  # the eval's data sets
    assert [training_steps(n) for n in (23_900, 24_100, 29_400)] == [1000, 1250, 1500]  # 4.48, 4.52, 5.51 validations
    assert training_steps(0) == 1000 and training_steps(10**9) == 2000
    assert default_config("moe", examples=24_100).steps == default_config("sasrec", examples=24_100).steps == 1250
    assert default_config("two_tower", examples=99_006).steps == 2000 and default_config("moe").steps == 1000
    assert default_config("ranker", examples=99_006).steps == 300
    assert default_config("moe", going_on=True, examples=99_006).steps == 300


def test_gating_routes_each_candidate_to_its_top_n_experts():
    d = Dims(dim=4, gate=2, semantic=2, interests=2)
    head = MoEHead(d, top_n=2)
    keys = torch.tensor([[[1.0, 0], [0, 1.0], [-1.0, 0], [0, -1.0], [0.5, 0.5]]])  # (1, E=5, G)
    experts = torch.arange(5.0)[None, :, None].expand(1, 5, 4).clone()  # expert e scores e * sum(a)
    mask = torch.tensor([[True, True, True, False, True]])
    # key . q: candidate 0 -> [1, 0.2, -1, (0), 0.6]: experts 0 and 4. Candidate 1 -> [0, -1, 0, 1, -0.5]:
    # expert 3 leads but is masked, so experts 0 and 2 (tied at 0, ahead of 4 and 1) share the gate equally.
    q = torch.tensor([[1.0, 0.2], [0.0, -1.0]])
    gates = head.gates(UserState(experts, keys, mask), q)
    assert (gates[0, :, 0] > 0).tolist() == [True, False, False, False, True]
    assert (gates[0, :, 1] > 0).tolist() == [True, False, True, False, False]
    assert torch.allclose(gates[0, [0, 2], 1], torch.tensor([0.5, 0.5]))
    assert gates[0, 3].abs().sum() == 0 and torch.allclose(gates.sum(1), torch.ones(1, 2))
    a = torch.zeros(2, d.stored)
    a[:, :4] = 1.0
    a[:, 4:6] = q
    score = head.score(UserState(experts, keys, mask), a)
    expected = (gates[0] * torch.arange(5.0)[:, None] * 4).sum(0)
    assert torch.allclose(score[0], expected)


WEIGHTS_DIGEST = """
import hashlib, torch
from andromeda_core.models.train import TrainConfig, train
from tests.unit.test_models import tiny_data
model = train(tiny_data(n_items=400, n_users=200), "moe",  # big enough for the CPU backward to add from several threads
              TrainConfig(steps=4, batch=256, negatives=256, seed=3, validate_every=2), progress=False)
print(hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest())
"""


def test_training_is_deterministic_for_a_seed_across_processes():
    """Two processes (each with its own thread pool and allocator) train bit-identical weights."""
    import subprocess
    import sys

    digests = {subprocess.run([sys.executable, "-c", WEIGHTS_DIGEST], capture_output=True, text=True, check=True,
                              timeout=300).stdout for _ in range(2)}
    assert len(digests) == 1 and len(digests.pop().strip()) == 64


@pytest.mark.parametrize("steps", [1, 2, 10])
def test_training_learns_at_the_configured_rate_for_any_step_count(steps):
    data, cfg = tiny_data(), TrainConfig(steps=steps, batch=8, negatives=4, seed=2)
    torch.manual_seed(cfg.seed)  # train() draws its initial weights the same way
    start = RetrievalModel("moe", Dims(categories=len(data.items.categories) + 1),
                           data.items.ids[data.train_items(cfg.min_id_engagements)])
    model = train(data, "moe", cfg, progress=False)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    moved = max((b - a).abs().max().item() for a, b in zip(start.parameters(), model.parameters()))
    assert moved > cfg.lr / 2  # Adam's first step alone moves each parameter with a gradient by ~lr


def test_weight_decay_shrinks_the_trained_weights():
    data, norms = tiny_data(), {}
    for decay in (0.0, 10.0):
        cfg = TrainConfig(steps=4, batch=8, negatives=4, seed=2, lr=1e-2, weight_decay=decay, validate_every=0)
        model = train(data, "moe", cfg, progress=False)
        norms[decay] = sum(p.detach().square().sum().item() for p in model.parameters() if p.requires_grad) ** 0.5
    assert norms[10.0] < 0.95 * norms[0.0]  # 4 steps at lr x decay = 0.1 scale every weight by 0.9^4 = 0.66;
    # Adam's own moves are ~lr each


def test_context_dropout_trains_the_unknown_surface_and_placement():
    """Every training user has a known surface and placement; a request naming neither reads row 0 of both tables.
    Without context dropout training never moves those rows (no weight decay here); with it, it does; a share
    outside [0, 1] is refused."""
    data = tiny_data()
    data.users.context[:] = [3, 5, 10]
    rows = {}
    for dropout in (0.0, 0.5):
        cfg = TrainConfig(steps=6, batch=8, negatives=4, seed=2, lr=1e-2, weight_decay=0.0, validate_every=0,
                          context_dropout=dropout)
        torch.manual_seed(cfg.seed)
        start = new_model(data, "moe", cfg).user_towers
        trained = train(data, "moe", cfg, progress=False).user_towers
        moved = {(table, row): not torch.equal(getattr(trained, table).weight[row], getattr(start, table).weight[row])
                 for table, row in (("surface", 0), ("placement", 0), ("surface", 3), ("placement", 5))}
        rows[dropout] = [moved[key] for key in sorted(moved)]  # placement 0, 5, surface 0, 3
    assert rows[0.0] == [False, True, False, True] and rows[0.5] == [True] * 4
    with pytest.raises(ValueError, match="context_dropout must be a share between 0 and 1"):
        TrainConfig(context_dropout=1.5)


@pytest.mark.parametrize("decay", [-0.1, float("nan")])
def test_weight_decay_must_not_be_negative(decay):
    with pytest.raises(ValueError, match="weight_decay must be at least 0"):
        TrainConfig(weight_decay=decay)


def test_long_runs_keep_the_one_cycle_schedule():
    cfg = TrainConfig(steps=100, lr=1e-2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched, rates = lr_schedule(opt, cfg), []
    for _ in range(cfg.steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    peak = rates.index(max(rates))
    assert rates[0] == pytest.approx(cfg.lr / 25) and peak == 9 and rates[peak] == pytest.approx(cfg.lr)
    assert rates[-1] < cfg.lr / 1000


@pytest.mark.parametrize("steps", [0, -3])
def test_training_needs_at_least_one_step(steps):
    with pytest.raises(ValueError, match="steps must be at least 1"):
        TrainConfig(steps=steps)


def train_hit_rate(model: RetrievalModel, data: RecData, k: int = 3) -> float:
    """Share of training examples whose target ranks in the top k over all items."""
    examples = data.train_examples()
    with torch.no_grad():
        stored = model.item_vectors(data.items)
        state = model.users(user_inputs(data, stored, examples[:, 0], examples[:, 1], model.dims.history))
        scores = model.score(state, stored, torch.from_numpy(data.items.text).float())
    targets = torch.tensor([data.users.items[u][p] for u, p in examples])
    return float((scores.topk(k, dim=1).indices == targets[:, None]).any(1).float().mean())


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_overfits_tiny_data(kind):
    data = tiny_data()
    before = train_hit_rate(RetrievalModel(kind, DIMS), data)
    model = train(data, kind, TrainConfig(steps=250, batch=16, negatives=16, lr=5e-3, seed=1, validate_every=0),
                  progress=False)
    after = train_hit_rate(model, data)
    assert after >= 0.9 > before


def test_checkpoint_round_trip(tmp_path):
    data = tiny_data()
    data.users.shown = [np.array([[(u * 3 + 7) % 40, u % 2]]) for u in range(len(data.users.items))]
    model = train(data, "moe", TrainConfig(steps=3, batch=8, negatives=4, min_id_engagements=2), progress=False)
    model.save(tmp_path / "m.safetensors", {"data": "tiny", "schema_version": 1})
    loaded, config = RetrievalModel.load(tmp_path / "m.safetensors")
    assert config["model"] == "moe" and config["data"] == "tiny" and config["dims"]["dim"] == 64
    # A learned identity only for the ads engaged at least twice in training (some once: content alone).
    assert 0 < len(data.train_items(2)) < len(data.train_items())
    assert model.item_ids.tolist() == data.items.ids[data.train_items(2)].tolist()
    assert torch.equal(loaded.item_ids, model.item_ids)
    assert torch.equal(loaded.click_logodds, model.click_logodds) and model.click_logodds.any()  # the prior travels
    assert not model.ad_tower.identity.weight[-1].any()  # the "no id" row stays zero through training
    with torch.no_grad():
        assert torch.equal(model.item_vectors(data.items), loaded.item_vectors(data.items))
    with torch.no_grad():
        model.user_towers.keys.weight[0, 0] = float("nan")  # a damaged file: refused at load, naming the tensor
    model.save(tmp_path / "nan.safetensors", {"data": "tiny", "schema_version": 1})
    with pytest.raises(ValueError, match="user_towers.keys.weight holds NaN or infinite values"):
        RetrievalModel.load(tmp_path / "nan.safetensors")


def test_int8_quantisation_error_is_bounded():
    stored = torch.randn(257, 37)
    stored[:, 16:32] *= 50  # one loud block must not coarsen the others
    q, scale = quantize_int8(stored)
    assert q.dtype == torch.int8 and scale.shape == (257, 3)
    blocks = torch.nn.functional.pad(stored.abs(), (0, 11)).view(257, 3, 16).amax(2)
    step = (blocks / 127).repeat_interleave(16, dim=1)[:, :37]
    error = (round_trip(stored, "int8") - stored).abs()
    assert (error <= step / 2 + 1e-5).all()
    assert error[:, :16].max() < 0.05
    assert torch.allclose(round_trip(stored, "fp16"), stored, atol=1e-2, rtol=1e-3)
    assert torch.equal(round_trip(stored, "fp32"), stored)


def test_ranker_factored_first_layer_equals_the_plain_mlp():
    """The ranker's factored evaluation is the MLP over the concatenated pair features, exactly."""
    torch.manual_seed(3)
    data, model = tiny_data(), RetrievalModel("ranker", DIMS)
    stored, text = model.item_vectors(data.items), torch.from_numpy(data.items.text).float()
    state = model.users(user_inputs(data, stored, np.array([0, 1, 2]), np.array([3, 0, 5]), DIMS.history))
    torch.nn.init.normal_(model.head.mlp[-1].weight)  # the deep part starts silent; make it speak
    experts = state.experts * state.mask[..., None]
    products = torch.einsum("bed,nd->bned", experts, stored[:, : DIMS.dim]).flatten(2)
    ad = torch.cat([stored[:, :-1], model.head.text(text)], 1)  # all but the bias (the score adds it)
    pair = torch.cat([experts.flatten(1)[:, None].expand(3, 40, -1), products, ad[None].expand(3, -1, -1),
                      torch.zeros(3, 40, N_FEATURES)], -1)  # no pair features: tests/unit/test_ranker_features.py
    with torch.no_grad():
        assert torch.allclose(model.head.deep(state, stored, text), model.head.mlp(pair).squeeze(-1), atol=1e-5)
        wide = model.head.wide.score(state, stored)
        assert wide.abs().sum() > 0 and torch.allclose(model.score(state, stored, text), model.head.mlp(pair).squeeze(-1) + wide,
                                                       atol=1e-5)
    weights = [model.head.mlp[0].weight, model.head.mlp[0].bias, model.head.text.weight]  # and training's gradients
    factored = torch.autograd.grad(model.head.deep(state, stored.detach(), text).sum(), weights)
    plain = torch.autograd.grad(model.head.mlp(pair.detach()).sum(), weights[:2])
    assert all(torch.allclose(f, p, atol=1e-4) for f, p in zip(factored, plain)) and factored[2].abs().sum() > 0


def test_a_silent_deep_part_is_skipped_only_where_it_adds_exactly_0():
    """Scoring without gradients skips a deep part whose output layer is zero: the same scores to the bit. With
    gradients (training) it runs, so the zero layer still learns."""
    torch.manual_seed(4)
    data, model = tiny_data(), RetrievalModel("ranker", DIMS)
    stored, text = model.item_vectors(data.items).detach(), torch.from_numpy(data.items.text).float()
    state = model.users(user_inputs(data, stored, np.array([0, 1]), np.array([3, 5]), DIMS.history))
    state = UserState(state.experts.detach(), state.keys.detach(), state.mask)
    cross = torch.randn(2, len(stored), N_FEATURES)
    model.head.cross.data.normal_()
    assert model.head.silent
    with torch.no_grad():
        full = model.head.deep(state, stored, text, cross) + model.head.wide.score(state, stored) + cross @ model.head.cross
        model.head.deep = None  # the shortcut must not call it
        assert torch.equal(model.score(state, stored, text, cross), full)
        del model.head.deep
    model.score(state, stored, text, cross).sum().backward()
    assert model.head.mlp[-1].weight.grad.abs().sum() > 0
    moe = RetrievalModel("moe", DIMS).head.flops_per_pair()
    assert model.head.flops_per_pair() < 100 * moe  # as scored: the deep part skipped
    torch.nn.init.normal_(model.head.mlp[-1].weight)
    assert not model.head.silent and model.head.flops_per_pair() >= 100 * moe
    with torch.no_grad():
        assert not torch.equal(model.score(state, stored, text, cross),
                               model.head.wide.score(state, stored) + cross @ model.head.cross)


def test_a_warm_started_ranker_starts_as_the_moe_and_learns_only_its_head():
    data = tiny_data()
    moe = train(data, "moe", TrainConfig(steps=30, batch=16, negatives=16, seed=1, validate_every=0), progress=False)
    stored, text = moe.item_vectors(data.items), torch.from_numpy(data.items.text).float()
    state = moe.users(user_inputs(data, stored, np.array([0, 4]), np.array([3, 5]), moe.dims.history))
    start = RetrievalModel("ranker", moe.dims, moe.item_ids, described=moe.described)
    start.load_state_dict({k: v for k, v in moe.state_dict().items() if not k.startswith("head.")}, strict=False)
    with torch.no_grad():
        assert torch.allclose(start.eval().score(state, stored, text), moe.score(state, stored, text))
    ranker = train(data, "ranker", TrainConfig(steps=20, batch=16, negatives=16, seed=1, validate_every=10),
                   init=moe, progress=False)
    towers = {k: v for k, v in ranker.state_dict().items() if not k.startswith("head.")}
    assert all(torch.equal(v, moe.state_dict()[k]) for k, v in towers.items())  # frozen: only the head learned
    assert not ranker.training and not ranker.user_towers.sequence.training
    with pytest.raises(ValueError, match="only a ranker"):
        train(data, "sasrec", TrainConfig(steps=2, batch=8, negatives=4), init=moe, progress=False)


def test_a_model_of_the_same_kind_goes_on_from_all_its_weights():
    data = tiny_data()
    moe = train(data, "moe", TrainConfig(steps=30, batch=16, negatives=16, seed=1, validate_every=0), progress=False)
    tiny_step = TrainConfig(steps=1, batch=16, negatives=16, seed=2, lr=1e-9, validate_every=0)
    went_on = train(data, "moe", tiny_step, init=moe, progress=False)
    fresh = train(data, "moe", tiny_step, progress=False)
    for name, weight in moe.state_dict().items():
        assert torch.allclose(went_on.state_dict()[name].float(), weight.float(), atol=1e-6), name
    assert not all(torch.equal(fresh.state_dict()[k], v) for k, v in moe.state_dict().items())
    assert all(p.requires_grad for p in went_on.parameters())  # nothing frozen: every weight may move


def test_validation_scores_in_eval_mode_and_restores_the_modes():
    data = tiny_data()
    model = RetrievalModel("moe", DIMS)
    model.train()
    model.ad_tower.eval()
    first = validation_score(model, data, data.eval_users())
    assert model.training and not model.ad_tower.training and model.user_towers.sequence.training
    model.eval()
    assert validation_score(model, data, data.eval_users()) == first and not model.training
