"""The quality report end to end on a tiny data set: every section, interval and plot is written."""
from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from andromeda_core.errors import InvalidInput
from andromeda_core.models import quality
from andromeda_core.models.distill import ask_teacher
from andromeda_core.models.evaluate import expected_metrics, per_user_metrics
from andromeda_core.models.retrieval import RetrievalModel
from andromeda_core.models.segments import described_table
from andromeda_core.models.towers import Dims
from andromeda_core.models.train import TrainConfig, default_config, train
from andromeda_core.schema import load_schema
from andromeda_core.synth import WorldConfig, engagement_probability
from tests.unit.test_models import tiny_data


def with_truth(data, seed=0):
    """data with the truth of a made-up world of 3 topics whose ads are more than its items, in another order."""
    rng = np.random.default_rng(seed)
    n_users, n_ads = len(data.users.items), len(data.items.ids) + 10
    data.truth = {"user_latent": rng.standard_normal((n_users, 2, 4)), "ad_latent": rng.standard_normal((n_ads, 4)),
                  "ad_quality": rng.standard_normal(n_ads), "ad_topic": rng.integers(0, 3, n_ads),
                  "user_topic": np.stack([rng.choice(3, 2, replace=False) for _ in range(n_users)]),
                  "item_ad": rng.permutation(n_ads)[:len(data.items.ids)]}
    return data


@pytest.fixture
def tiny_report(tmp_path, monkeypatch):
    monkeypatch.setenv("ANDROMEDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(quality, "load_data", lambda name, world=None: with_truth(tiny_data(n_items=60, n_users=30)))
    monkeypatch.setattr(quality, "default_config", lambda kind, seed=0, distill=0.0, start="", going_on=False, examples=None: TrainConfig(
        steps=12, batch=16, negatives=16, seed=seed, distill=distill, teacher_rows=8, validate_every=6))
    out = tmp_path / "docs" / "quality.md"
    return quality.quality_report(("tiny",), out), out


def test_the_report_has_every_row_interval_comparison_and_plot(tiny_report):
    text, out = tiny_report
    assert out.read_text() == text
    for name in ("most popular", "item-kNN", quality.CONTENT, "sasrec", "two_tower", "moe", "ranker"):
        assert re.search(rf"^\| {re.escape(name)} \|", text, re.M), name
    assert "int8 + exact rescoring of the top 2x" in text
    assert (out.parent / "quality-tiny.png").stat().st_size > 0
    cells = re.findall(r"(\d\.\d{4}) \[(\d\.\d{4}), (\d\.\d{4})\]", text)
    assert cells and all(float(low) <= float(mean) <= float(high) for mean, low, high in cells)
    comparisons = text.split("### The MoE against every other row")[1].split("###")[0]
    others = r"(most popular|item-kNN|content \(MiniLM cosine\)|sasrec|two_tower|ranker)"
    assert len(re.findall(rf"^\| {others} \|", comparisons, re.M)) == 6
    assert len(re.findall(r"[-+]\d\.\d{4} \[[-+]\d\.\d{4}, [-+]\d\.\d{4}\] (\*\*better\*\*|\*\*worse\*\*|within noise)",
                          comparisons)) == 24
    assert "### Cold start" in text and "Short histories" in text and "Every ad new" in text
    every_ad_new = text.split("Every ad new")[1].split("Short histories")[0]
    assert re.findall(r"^\| ([\w ]+) \|", every_ad_new, re.M) == ["model", *quality.SIMULATED]
    expected = text.split("### Expected over the world's engagements")[1].split("###")[0]
    for name in (quality.CEILING, quality.ORACLE, "most popular", "item-kNN", quality.CONTENT, "sasrec", "two_tower",
                 "moe", "ranker"):
        assert re.search(rf"^\| {re.escape(name)} \| \d\.\d{{4}} \[", expected, re.M), name
    assert len(re.findall(rf"^\| {others} \| [-+]", expected, re.M)) == 6
    assert "ranker beats the MoE (expected over the world's engagements): significantly higher on" in text
    assert "ranker beats every retrieval model before distillation (sasrec, two_tower, moe" in text
    went_on = "; chosen: start (" not in text
    assert bool(re.search(rf"^\| {re.escape(quality.UNDISTILLED)} \| fp32 \|", text, re.M)) == went_on
    tradeoff = text.split("### The click prior")[1].split("###")[0]
    assert len(re.findall(r"^\| \d+(\.\d+)?( \(chosen\))? \| \d\.\d{4} \| \d\.\d{4} \| \d\.\d{3} \|$", tradeoff, re.M)) == 5
    assert re.search(r"start: \d\.\d{4}, 0: \d\.\d{4}, 2: \d\.\d{4}; chosen: (start|0|2) \(", text)
    assert trained_now(text) == ["sasrec", "two_tower", "moe", "ranker", "moe (distill 0)", "moe (distill 2)"]
    assert quality.TARGETS_HEAD in text and text.count("- met") + text.count("- NOT met") >= 6


def trained_now(report: str) -> list[str]:
    """The models a report says were trained in its run, in training order."""
    listed = report.split("Time: training ")[1].split("; the rest (")[0]
    return re.findall(r"(?:^|, )(.+?) [\d,]+ s", listed)


def test_a_second_run_reuses_the_checkpoints(tiny_report, monkeypatch):
    _, out = tiny_report
    monkeypatch.setattr(quality, "train", lambda *a, **k: pytest.fail("trained again"))
    monkeypatch.setattr(quality, "load_data", lambda name, world=None: tiny_data(n_items=60, n_users=30))  # no truth
    text = quality.quality_report(("tiny",), out)
    assert "Time: training none (every model from its checkpoint); the rest (" in text
    assert "Expected over" not in text and quality.ORACLE not in text and quality.TARGETS_HEAD in text


def power(x: int, y: int, then: Path | None = None) -> int:
    """x ** y; a negative y raises; with `then`, after 5 s the result is also written there."""
    if y < 0:
        raise ValueError(f"negative power {y}")
    if then is not None:
        time.sleep(5)
        then.write_text(str(x ** y))
    return x ** y


def test_side_by_side_keeps_the_job_order_and_stops_at_a_jobs_error(tmp_path):
    jobs = [(2, 10), (3, 2), (5, 1)]
    assert quality.side_by_side(power, jobs, 2) == quality.side_by_side(power, jobs, 1) == [1024, 9, 5]
    with pytest.raises(ValueError, match="negative power -1"):  # raised while the first job still sleeps, which
        quality.side_by_side(power, [(2, 1, tmp_path / "slow"), (2, -1)], 2)  # is stopped: it never writes
    time.sleep(6)
    assert not (tmp_path / "slow").exists()


def test_a_world_of_an_older_generator_is_refused_and_left_alone(tmp_path):
    world = tmp_path / "world"
    world.mkdir()
    np.savez(world / "truth.npz", config=json.dumps(asdict(WorldConfig(ads=10, users=2))))
    before = (world / "truth.npz").read_bytes()
    with pytest.raises(InvalidInput, match="older generator") as caught:
        quality.quality_report(("synthetic",), tmp_path / "q.md", world=world)
    assert caught.value.field == "--world" and (world / "truth.npz").read_bytes() == before


def test_a_distilled_checkpoint_that_names_no_start_is_trained_again(tiny_report, monkeypatch):
    _, out = tiny_report
    path = quality.checkpoint_path("tiny", "moe", 2.0)
    model, config = RetrievalModel.load(path)
    assert config["init"] == "tiny-moe.safetensors" and config["teacher"] == "tiny-ranker.safetensors"
    model.save(path, {k: v for k, v in config.items() if k not in ("model", "model_version", "dims", "init")})
    assert trained_now(quality.quality_report(("tiny",), out)) == ["moe (distill 2)"]


def test_a_checkpoint_trained_otherwise_under_the_same_name_is_trained_again(tiny_report):
    _, out = tiny_report
    untaught = quality.checkpoint_path("tiny", "moe", 0.0, going_on=True)
    model, config = RetrievalModel.load(untaught)
    model.save(untaught, {**config, "steps": 3})  # as `andromeda train --init tiny-moe --steps 3` writes it
    assert trained_now(quality.quality_report(("tiny",), out)) == ["moe (distill 0)"]
    model, config = RetrievalModel.load(untaught)
    model.save(untaught, {**config, "click_weights": [4.0]})  # as `andromeda train ... --click-weight 4` writes it
    assert trained_now(quality.quality_report(("tiny",), out)) == ["moe (distill 0)"]
    start = quality.checkpoint_path("tiny", "moe")
    model, config = RetrievalModel.load(start)
    model.save(start, {**config, "note": "trained again elsewhere"})  # the same name and settings, other bytes
    assert trained_now(quality.quality_report(("tiny",), out)) == ["ranker", "moe (distill 0)", "moe (distill 2)"]


def test_a_model_going_on_from_one_trained_again_is_trained_again(tiny_report):
    _, out = tiny_report
    quality.checkpoint_path("tiny", "moe").unlink()
    assert trained_now(quality.quality_report(("tiny",), out)) == ["moe", "ranker", "moe (distill 0)", "moe (distill 2)"]


def test_the_steps_without_a_teacher_are_the_students_steps_in_their_own_checkpoint(tiny_report):
    text, _ = tiny_report
    assert quality.checkpoint_path("tiny", "moe", 0.0, going_on=True).name == "tiny-moe-distill0.safetensors"
    assert quality.checkpoint_path("tiny", "moe").name == "tiny-moe.safetensors"
    _, config = RetrievalModel.load(quality.checkpoint_path("tiny", "moe", 0.0, going_on=True))
    assert config["init"] == "tiny-moe.safetensors" and "teacher" not in config
    more, taught = default_config("moe", going_on=True), default_config("moe", distill=0.5)
    assert more == dataclasses.replace(taught, distill=0.0) and more.steps < default_config("moe").steps


def test_a_student_is_trained_again_after_its_teacher_or_when_it_was_taught_by_other_users(tiny_report, monkeypatch):
    _, out = tiny_report
    quality.checkpoint_path("tiny", "ranker").unlink()
    assert trained_now(quality.quality_report(("tiny",), out)) == ["ranker", "moe (distill 2)"]
    path = quality.checkpoint_path("tiny", "moe", 2.0)
    model, config = RetrievalModel.load(path)
    assert config["teacher_users"] == len(quality.load_data("tiny").eval_users())  # fewer than TEACHER_USERS
    monkeypatch.setattr(quality, "ask_teacher", lambda ranker, data: ask_teacher(ranker, data, users=5))
    assert trained_now(quality.quality_report(("tiny",), out)) == ["moe (distill 2)"]
    assert RetrievalModel.load(path)[1]["teacher_users"] == 5
    assert trained_now(quality.quality_report(("tiny",), out)) == []


def test_a_model_trained_beside_the_others_is_the_one_trained_in_this_process(tmp_path, monkeypatch):
    """Side by side, train_all trains each of BESIDE in a spawned process of its own, by the settings made in this
    one (default_config, patched here), while this one trains the rest: the same weights as training here, their
    seconds named beside the others and left out of the rest's."""
    monkeypatch.setenv("ANDROMEDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(quality, "default_config", lambda kind, seed=0, distill=0.0, start="", going_on=False,
                        examples=None: TrainConfig(steps=12, batch=16, negatives=16, seed=seed, distill=distill,
                                                   teacher_rows=8, validate_every=6))
    data = tiny_data(n_items=60, n_users=30)
    described_table(load_schema())  # into this test's cache, which the processes beside read instead of loading MiniLM
    started = time.time()
    trained = quality.train_all(data, retrain=True, beside=True)
    now, sentence = time.time(), quality.timing(trained, started)
    assert quality.BESIDE == ("sasrec", "two_tower") and trained.beside == {"sasrec", "two_tower"}
    assert list(trained.seconds)[-2:] == ["sasrec", "two_tower"] and list(trained.models)[:3] == ["sasrec", "two_tower", "moe"]
    for kind in quality.BESIDE:
        here = train(data, kind, quality.default_config(kind), progress=False).state_dict()
        beside = trained.models[kind].state_dict()
        assert here.keys() == beside.keys() and all(torch.equal(v, beside[k]) for k, v in here.items())
    assert re.search(r", sasrec [\d,]+ s \(in a process of its own, beside the others\), two_tower [\d,]+ s \(in a "
                     r"process of its own, beside the others\)(; waiting for the models beside [\d,]+ s)?; the rest", sentence)
    made_up = quality.Trained(seconds={"moe": 20.0, "sasrec": 30.0}, beside={"sasrec"}, waited=5.0)
    assert quality.timing(made_up, time.time() - 100).endswith(
        "sasrec 30 s (in a process of its own, beside the others); waiting for the models beside 5 s; the rest (the "
        "teacher's rankings, validations, ranking and measuring) 75 s.")  # 100 s less the moe's and the wait


def test_the_oracle_ranks_by_the_worlds_true_affinity():
    data = with_truth(tiny_data())
    users, t = data.eval_users(), data.truth
    ranking = quality.oracle_ranking(data, users)
    for i, u in enumerate(users):
        ads = t["item_ad"]
        truth = 4 * (t["ad_latent"][ads] @ t["user_latent"][u].T).max(1) + t["ad_quality"][ads]
        truth[data.users.items[u][:5]] = -np.inf
        assert ranking.top[i, :5].tolist() == np.argsort(-truth, kind="stable")[:5].tolist()


def test_the_engagement_distribution_is_the_odds_of_the_worlds_engagements_history_excluded():
    data = with_truth(tiny_data())
    users, t = data.eval_users(), data.truth
    p = quality.engagement_distribution(data, users)
    assert p.shape == (len(users), len(data.items.ids)) and np.allclose(p.sum(1), 1)
    for i, u in enumerate(users):
        history = data.users.items[u][:data.split(u)[1]]
        assert (p[i, history] == 0).all()
        world = engagement_probability(t["user_latent"][u], t["user_topic"][u], t["ad_latent"], t["ad_quality"],
                                       t["ad_topic"])[t["item_ad"]]
        rest, odds = np.setdiff1d(np.arange(len(data.items.ids)), history), world / (1 - world)
        assert np.allclose(p[i, rest], odds[rest] / odds[rest].sum())
    ceiling, oracle = expected_metrics(quality.ranking_by(p, data, users).top, p), expected_metrics(
        quality.oracle_ranking(data, users).top, p)
    assert all((ceiling[name] >= oracle[name] - 1e-12).all() for name in ceiling)  # no ranking beats the ceiling


def test_expected_metrics_average_the_metrics_over_every_possible_held_out_item():
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.full(300, 0.3), size=4)
    top = np.stack([rng.permutation(300)[:250] for _ in range(4)])  # 50 items of each user's are outside its top
    expected = expected_metrics(top, p)
    for u in range(4):
        rank = np.full(300, 10**6)
        rank[top[u]] = np.arange(250)
        every = per_user_metrics(rank)  # the metrics if item t were the held-out one, (300,) each
        for name, values in every.items():
            assert expected[name][u] == pytest.approx(float((p[u] * values).sum()), abs=1e-12), name


def test_the_report_names_the_scale_the_rankers_deep_part_was_kept_at():
    """Silent because training found nothing better (never scaled: dims keep 1), scaled to 0 by the funnel, or
    kept at a scale: each is said as it is."""
    ranker = RetrievalModel("ranker", Dims())
    trained = quality.Trained(models={"ranker": ranker})
    assert ranker.head.silent and quality.deep_scale(trained).startswith("0 (silent: its training found nothing better")
    ranker.dims = dataclasses.replace(ranker.dims, deep_scale=0.0)
    assert quality.deep_scale(trained).startswith("0 (the best-scoring on that validation split of 1, 0.5, 0.25, 0 ")
    ranker.head.mlp[-1].weight.data.fill_(0.1)
    ranker.dims = dataclasses.replace(ranker.dims, deep_scale=0.5)
    said = quality.deep_scale(trained)
    assert said.startswith("0.5 (the best-scoring") and "keeps 95% inside" in said


def test_beating_needs_significance_on_every_metric_and_matching_a_margin():
    """"Beats" was a higher mean on all four metrics and "matches" no significant loss, which the same model against
    itself plus noise passes often: now beating is significantly better on every metric (Holm over the target's
    comparisons) and matching is shown not worse by MATCH_MARGIN of the other's mean on every one."""
    from andromeda_core.models.quality import METRICS, Row, ordering

    rng = np.random.default_rng(7)
    base = {m: (rng.random(3000) < 0.3).astype(float) for m in METRICS}

    def row(name: str, storage: str, shift: float, noise: float = 0.0) -> Row:
        return Row(name, storage, {m: v + shift + noise * rng.standard_normal(len(v)) for m, v in base.items()})

    def verdicts(moe_shift: float, baseline_shift: float, sasrec_shift: float) -> dict[str, bool]:
        by = {("moe", "fp32"): row("moe", "fp32", moe_shift), ("ranker", "fp32"): row("ranker", "fp32", 0.2),
              ("most popular", "-"): row("most popular", "-", baseline_shift, 0.05),
              ("sasrec", "fp32"): row("sasrec", "fp32", sasrec_shift), ("two_tower", "fp32"): row("two_tower", "fp32", -0.2)}
        return {text.split(":")[0]: met for met, text in ordering(by, lambda ranking: ranking, "")}

    clear = verdicts(0.0, -0.05, 0.0)
    assert clear["MoE beats most popular"] and clear["MoE matches or beats the SASRec-style two-tower"]
    noise = verdicts(0.0, -0.001, -0.001)  # a hair below the MoE's means: higher on all four, not significantly
    assert not noise["MoE beats most popular"]
    worse = verdicts(0.0, -0.05, 0.1)  # the MoE 0.1 below SASRec's 0.4: worse than a 10% margin
    assert not worse["MoE matches or beats the SASRec-style two-tower"]
