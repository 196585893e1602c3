"""The quality report (docs/quality.md): baselines and every model on MovieLens and two synthetic worlds
of different shapes, measured in one run, with 95% bootstrap intervals over users, paired significance
tests, cold-start rows and a plot of quality against FLOPs per pair."""
from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing
import os
import platform
import signal
import time
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from andromeda_core.config import IndexConfig, load_settings
from andromeda_core.errors import InvalidInput
from andromeda_core.models.baselines import (WINDOWS, content_similarity, declared_profiles, declared_similarity, item_knn,
                                            most_popular, tuned)
from andromeda_core.models.distill import TEACHER_TOP, TEACHER_USERS, Teacher, ask_teacher
from andromeda_core.models.evaluate import (CUTOFFS, Ranking, bytes_per_ad, counted_flops_per_pair, crossings,
                                            expected_metrics, per_user_metrics, rank_items, ranking_from_scores,
                                            recall_within)
from andromeda_core.models.features import NAMES as FEATURE_NAMES, PairFeatures
from andromeda_core.models.heads import HEADS
from andromeda_core.models.pareto import plot_quality_vs_flops
from andromeda_core.models.recdata import RecData, load_movielens, load_synthetic
from andromeda_core.models.retrieval import UNLOADABLE, RetrievalModel
from andromeda_core.models.segments import described_table
from andromeda_core.models.stats import (PAIRED_RESAMPLES, bootstrap_ci, format_ci, holm, paired_difference,
                                         paired_p_value)
from andromeda_core.models.train import (CLICK_WEIGHTS, DEEP_SCALES, TrainConfig, default_config, other_start, train,
                                         validation_score)
from andromeda_core.schema import load_schema
from andromeda_core.synth import (GENERATOR, WorldConfig, engagement_probability, is_current, synthesize, truth_scores,
                                  world_config)

RESCORE = IndexConfig.rescore  # as served by default
METRICS = ("HR@10", "HR@50", "HR@200", "NDCG@10")
WORLDS = {"synthetic": WorldConfig(ads=10000, users=4000, seed=5),
          "synthetic-b": WorldConfig(ads=12000, users=3000, seed=11, latent_dim=16, clusters=5)}
DATASETS = ("movielens", *WORLDS)
EVAL_USERS = 2000  # per data set (MovieLens has 610)
TRUE_RECALL_TARGET = {"synthetic": 0.28}  # twice the 0.14 every model had on this world before learned ids
DISTILL_GRID = (0.0, 2.0)  # distillation weights of the steps going on from the undistilled MoE (0: the same steps
# without a teacher); validation picks among those students and the MoE they start from. 2 since the ranker reads
# declared interests: on the default world (one run each) validation 0.1250 / 0.1260 / 0.1278 at 0.5 / 1 / 2, expected
# HR@200 0.342 / 0.352 / 0.354. 0.5 left the grid for the eval's 45 minutes: in the report of 2026-12-06 validation
# chose it once, on synthetic-b, 0.1184 against 0.1182 at 2
SHORT_HISTORY = 5
ORACLE = "oracle (true affinity)"
CEILING = "ceiling (engagement probability)"
CONTENT = "content (MiniLM cosine)"
DECLARED = "declared interests (MiniLM cosine)"
UNDISTILLED = "moe, the ranker's start"  # the undistilled MoE the ranker starts from, where the one kept went on from it
SIMULATED = ("sasrec", "two_tower", "moe")  # the models ranked again for the simulated short histories and every ad
# new: the retrievers (the ranker's full-corpus ranking of 2,000 users took about 50 s of one core each, in a run over
# 45 minutes; its cold-start row stays)
STORAGE_ROWS = (("fp16", 0), ("int8", 0), ("fp16", RESCORE), ("int8", RESCORE))  # the MoE as stored and served


def load_data(name: str, world: Path | None = None) -> RecData:
    """The data set; a synthetic world is drawn where `world` holds none. The default world, in the cache, is
    also drawn again (and its checkpoints dropped) when an older generator drew it."""
    if name == "movielens":
        return load_movielens()
    if world is None:
        world = load_settings().cache_dir / "worlds" / name
        if not is_current(world):
            for stale in (load_settings().cache_dir / "models").glob(f"{name}-*.safetensors"):
                if stale.name[len(name) + 1:].startswith(tuple(HEADS)):  # not synthetic-b's for synthetic
                    stale.unlink()  # trained on the older world
            synthesize(WORLDS[name], world, load_schema())
    elif world_config(world) is None:
        synthesize(WORLDS[name], world, load_schema())
    data = load_synthetic(world)
    data.name = name
    return data


def checkpoint_path(data: str, kind: str, distill: float = 0.0, start: str = "", going_on: bool = False) -> Path:
    """start: the other kind it went on from (a MoE from a sasrec), "" for none or its own kind; going_on: the steps
    going on from the undistilled MoE (default_config), named by their distillation weight, 0 included."""
    suffix = (f"-from-{start}" if start else "") + (f"-distill{distill:g}" if distill or going_on else "")
    return load_settings().cache_dir / "models" / f"{data}-{kind}{suffix}.safetensors"


def file_digest(path: Path) -> str:
    """The first 16 hex digits of the file's SHA-256: which checkpoint, not just which name, a model started from."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def checkpoint_meta(data: RecData, seed: int, teacher: Path | None = None, distill: float = 0.0,
                    init: Path | None = None, taught: int = 0, cfg: TrainConfig | None = None) -> dict:
    """taught: the users the teacher was asked for; cfg: the training run's steps and learning rate are recorded, and
    its click weights where set (get_model trains again where they are not the ones asked)."""
    schema = load_schema()
    meta = {"data": data.name, "schema": schema.name, "schema_version": schema.version,
            "schema_fingerprint": schema.fingerprint, "seed": seed, "categories": data.items.categories}
    meta = {**meta, "steps": cfg.steps, "lr": cfg.lr} if cfg else meta
    meta = {**meta, "click_weights": list(cfg.click_weights)} if cfg and cfg.click_weights else meta
    meta = {**meta, "init": init.name, "init_digest": file_digest(init)} if init else meta
    return {**meta, "teacher": teacher.name, "distill": distill, "teacher_users": taught} if teacher else meta


TRAINED_AS = ("seed", "steps", "lr", "click_weights", "init", "init_digest", "teacher_users")  # the metadata a
# reused checkpoint must share with the one get_model would write


@dataclass
class Trained:
    """The models of one data set: by name, which were trained in this run and in how many seconds, the MoE's
    validation score at its start (None) and at each distillation weight of the steps going on from it, and which
    of those was kept."""

    models: dict[str, RetrievalModel] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # of the models trained in this run, in the order they
    # were done (those beside, last)
    beside: set[str] = field(default_factory=set)  # those of them trained in a process of their own (BESIDE)
    waited: float = 0.0  # seconds this process waited for the models beside once its own were done
    validation: dict[float | None, float] = field(default_factory=dict)
    chosen: float | None = None


def get_model(data: RecData, kind: str, retrain: bool, teacher: Teacher | None = None, distill: float = 0.0,
              init: tuple[RetrievalModel, Path] | None = None, seed: int = 0, going_on: bool = False,
              config: TrainConfig | None = None) -> tuple[RetrievalModel, Path, bool]:
    """(model, its checkpoint, trained in this call). The checkpoint is loaded unless retrain, or it is missing or
    unusable (of an older model version, say), or its metadata names another seed, number of steps, learning rate, set
    click weight or start than asked (init's checkpoint, by name and contents) or, when distilled, another number of users asked of
    the teacher: it was trained otherwise (by `andromeda train --steps 3`, say, which writes the same names). config:
    the training settings (None: default_config's)."""
    start = other_start(kind, init[0] if init else None)
    path = checkpoint_path(data.name, kind, distill, start, going_on)
    cfg = config or default_config(kind, seed, distill, start, going_on, examples=len(data.train_examples()))
    loaded = None
    if path.exists() and not retrain:
        try:
            loaded = RetrievalModel.load(path)
        except UNLOADABLE:
            pass  # trained again below
    taught = len(teacher.users) if teacher is not None and distill else 0
    meta = checkpoint_meta(data, seed, checkpoint_path(data.name, "ranker") if distill else None, distill,
                           init[1] if init else None, taught, cfg)
    if loaded is not None and all(loaded[1].get(key) == meta.get(key) for key in TRAINED_AS):
        return loaded[0], path, False
    model = train(data, kind, cfg, teacher if distill else None, init[0] if init else None)
    model.save(path, meta)
    return model, path, True


BESIDE = ("sasrec", "two_tower")  # trained in a process of their own beside the others when the data sets run side by
# side: no other model starts from these baselines, so nothing waits on them until ranking, and each data set's chain
# of models (MoE, ranker, students) is shorter


def fit_beside(data: RecData, kind: str, retrain: bool, threads: int, config: TrainConfig) -> tuple[Path, float | None]:
    """Trains (or loads) data's `kind` model by `config` in this process with `threads` torch threads, as get_model
    does: (its checkpoint, the seconds it trained; None when loaded). Run in a process of its own by train_all."""
    torch.set_num_threads(threads)
    started = time.time()
    _, path, fresh = get_model(data, kind, retrain, config=config)
    return path, time.time() - started if fresh else None


def train_all(data: RecData, retrain: bool, beside: bool = False) -> Trained:
    """The two-tower baselines; the MoE undistilled; the ranker on its frozen towers; then the same steps going on
    from the undistilled MoE at each weight of DISTILL_GRID (0: without the teacher, so that the teacher is judged
    against as many more steps, not against none). The MoE kept is the one of those and their start with the best
    validation score (each user's second-to-last engagement, never the test one; of equals, the start). beside: the
    kinds of BESIDE train in a spawned process of their own meanwhile, with as many torch threads as this one (the
    same bits as in this process)."""
    out, runs = Trained(), {}
    val_users = data.eval_users()[:EVAL_USERS]
    pool = ProcessPoolExecutor(len(BESIDE), mp_context=multiprocessing.get_context("spawn")) if beside else None
    try:
        examples = len(data.train_examples())  # the settings are this process's, as get_model would make them here
        aside = {kind: pool.submit(fit_beside, data, kind, retrain, torch.get_num_threads(),
                                   default_config(kind, examples=examples)) for kind in BESIDE} if pool else {}

        def fit(name: str, kind: str, distill: float = 0.0, teacher: Teacher | None = None, init: str | None = None,
                going_on: bool = False):
            for failed in (f for f in aside.values() if f.done() and f.exception() is not None):
                raise failed.exception()  # a model beside failed: stop now, not after this process's hour
            # a model going on from one trained now is trained again too, and a student of a ranker trained now
            again = retrain or init in out.seconds or (teacher is not None and "ranker" in out.seconds)
            started = time.time()
            model, path, fresh = get_model(data, kind, again, teacher, distill, runs[init] if init else None,
                                           going_on=going_on)
            runs[name] = model, path
            if fresh:
                out.seconds[name] = time.time() - started
            return model

        for kind in ("sasrec", "two_tower", "moe"):
            if kind not in aside:
                out.models[kind] = fit(kind, kind)
        out.models["ranker"] = fit("ranker", "ranker", init="moe")
        teacher = ask_teacher(out.models["ranker"], data) if any(DISTILL_GRID) else None
        candidates = {None: "moe", **{w: f"moe (distill {w:g})" for w in DISTILL_GRID}}
        for weight in DISTILL_GRID:
            fit(candidates[weight], "moe", weight, teacher if weight else None, init="moe", going_on=True)
        out.validation = {w: validation_score(runs[name][0], data, val_users) for w, name in candidates.items()}
        out.chosen = max(candidates, key=out.validation.get)  # max keeps the first of equals: the start
        out.models["moe"] = runs[candidates[out.chosen]][0]
        if out.chosen is not None:  # the retriever the ranker was built on and is held to beat
            out.models[UNDISTILLED] = runs["moe"][0]
        waiting = time.time()
        for kind, future in aside.items():
            path, seconds = future.result()
            out.models[kind] = RetrievalModel.load(path)[0]
            if seconds is not None:
                out.seconds[kind] = seconds
                out.beside.add(kind)
        out.waited = time.time() - waiting
        out.models = {**{k: out.models[k] for k in BESIDE if k in aside}, **out.models}  # in the order trained in line
        return out
    except BaseException:
        if pool is not None:
            terminate(pool)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def ranking_by(scores: np.ndarray, data: RecData, users: np.ndarray) -> Ranking:
    """scores (U, N) for users (U,) -> their Ranking at the held-out position."""
    return Ranking(*ranking_from_scores(torch.from_numpy(scores), data, users, np.array([data.split(u)[1] for u in users])))


def oracle_ranking(data: RecData, users: np.ndarray) -> Ranking:
    """The world's own ground-truth affinity as a ranker (synthetic data only)."""
    t, ads = data.truth, data.truth["item_ad"]
    return ranking_by(np.stack([truth_scores(t["user_latent"][u], t["ad_latent"][ads], t["ad_quality"][ads])
                                for u in users]), data, users)


def engagement_distribution(data: RecData, users: np.ndarray) -> np.ndarray:
    """(U, N) float64 (synthetic data only): for users (U,), the probability that the held-out engagement is each
    item given the engagements before it, under the world's own process; rows sum to 1. The world engages the user
    with each ad independently with probability c (engagement_probability: shown, then engaged with), so given the
    others, the one engagement more is ad a with probability proportional to c_a / (1 - c_a); the history is 0."""
    t = data.truth
    c = np.stack([engagement_probability(t["user_latent"][u], t["user_topic"][u], t["ad_latent"], t["ad_quality"],
                                         t["ad_topic"])[t["item_ad"]] for u in users]).astype(np.float64)
    p = c / (1 - c)
    for i, u in enumerate(users):
        p[i, data.users.items[u][:data.split(u)[1]]] = 0.0
    return p / p.sum(1, keepdims=True)


@dataclass
class Row:
    name: str
    storage: str
    ranking: Ranking
    flops: int = 0  # analytical FLOPs per pair; 0 for the baselines that score no pairs
    counted: float = 0.0
    bytes: tuple[int, int] = (0, 0)
    kind: str = ""  # the learned model behind the row


def rankings(data: RecData, trained: Trained, users: np.ndarray) -> tuple[list[Row], dict[str, list[Row]], dict[str, int]]:
    """(main rows, subset rows by subset name, the window of each history baseline): every model and baseline
    ranked for the same users; the baselines' windows chosen on the validation split, as the models' settings."""
    m = trained.models
    validation = data.eval_users()[:TrainConfig().validation_users]
    (knn, knn_window), (content, content_window) = (tuned(fn, data, users, validation)
                                                    for fn in (item_knn, content_similarity))
    rows = [Row("most popular", "-", most_popular(data, users)), Row("item-kNN", "-", knn), Row(CONTENT, "-", content)]
    profiles = declared_profiles(data)
    if profiles.any():  # the synthetic worlds' users declare interests; MovieLens's declare nothing
        rows.append(Row(DECLARED, "-", declared_similarity(data, users, profiles)))
    if data.truth:
        rows.insert(0, Row(ORACLE, "-", oracle_ranking(data, users)))

    counted = {kind: counted_flops_per_pair(model, data) for kind, model in m.items()}
    pair = PairFeatures.fit(data)  # the ranker's, fit once for its rows

    def learned(kind: str, dtype: str = "fp32", rescore: int = 0, **how) -> Row:
        model = m[kind]
        return Row(kind, storage_label(dtype, rescore), rank_items(model, data, users, dtype, rescore=rescore, pair=pair,
                                                                   **how),
                   model.head.flops_per_pair(), counted[kind], bytes_per_ad(model, dtype, rescore), kind)

    rows += [learned(kind) for kind in ("sasrec", "two_tower", "moe", UNDISTILLED) if kind in m]
    rows += [learned("moe", dtype, rescore) for dtype, rescore in STORAGE_ROWS] + [learned("ranker")]
    short = [Row("item-kNN", "-", item_knn(data, users, recent=SHORT_HISTORY)),
             Row(CONTENT, "-", content_similarity(data, users, recent=SHORT_HISTORY))]
    short += [learned(kind, keep=SHORT_HISTORY) for kind in SIMULATED]
    every_ad_new = [learned(kind, content_only=True) for kind in SIMULATED]
    return rows, {"short": short, "content_only": every_ad_new}, {"item-kNN": knn_window, CONTENT: content_window}


def asked(data: RecData) -> str:
    """Whom ask_teacher asks on this data set."""
    n = len(data.eval_users())
    return f"the first {TEACHER_USERS:,} users" if n > TEACHER_USERS else f"all {n:,} users"


def timing(trained: Trained, started: float) -> str:
    """The sentence on where this data set's time went after its data was loaded: each model trained in this run,
    then the rest (the teacher's rankings, validations, ranking and measuring) up to the end of the report's
    section; a model trained beside the others is named with them, its seconds not in the rest's sum, nor the wait for
    it."""
    models = ", ".join(f"{name} {s:,.0f} s" + (" (in a process of its own, beside the others)" if name in trained.beside
                                                 else "") for name, s in trained.seconds.items())
    rest = time.time() - started - trained.waited - sum(s for name, s in trained.seconds.items()
                                                        if name not in trained.beside)
    waited = f"; waiting for the models beside {trained.waited:,.0f} s" if trained.waited >= 0.5 else ""
    return (f"Time: training {models or 'none (every model from its checkpoint)'}{waited}; the rest (the teacher's "
            f"rankings, validations, ranking and measuring) {rest:,.0f} s.")


def click_weights(trained: Trained) -> str:
    """The sentence on the click prior's smoothings and weights, where the data has one (train.choose_click_prior)."""
    held = {kind: m.dims for kind, m in trained.models.items() if len(m.click_ids)}
    if not held:
        return ""
    return ("Click prior: each ad's click log-odds over the impressions logged before the held-out engagements, "
            "smoothed toward the overall rate by s impressions and added w times to its bias after training; s and w "
            "chosen on the validation split (the mean of the four metrics, full corpus ranked): "
            + ", ".join(f"{kind} s = {d.click_smoothing:g}, w = {d.click_weight:g}" for kind, d in held.items()) + ". ")


def deep_scale(trained: Trained) -> str:
    """The scale the ranker's trained deep part was kept at (train.scale_deep_part)."""
    ranker = trained.models["ranker"]
    if ranker.head.silent and ranker.dims.deep_scale:  # never scaled: its training found nothing better than its start
        return "0 (silent: its training found nothing better on that validation split)"
    return (f"{ranker.dims.deep_scale:g} (the best-scoring on that validation split of "
            f"{', '.join(f'{s:g}' for s in DEEP_SCALES)} whose top-100 keeps {TrainConfig.funnel:.0%} inside the MoE's "
            f"top-1000)")


def distill_label(weight: float | None) -> str:
    """How the report names a MoE kept (Trained.chosen): "start" for the undistilled one, else its weight."""
    return "start" if weight is None else f"{weight:g}"


def storage_label(dtype: str, rescore: int) -> str:
    if rescore:
        return f"{dtype} + exact rescoring of the top {rescore}x"
    return dtype if dtype == "fp32" else f"{dtype}, scan only"


Measure = Callable[[Ranking], dict[str, np.ndarray]]  # a ranking -> METRICS (and more) per user, (U,) each


def held_out(r: Ranking) -> dict[str, np.ndarray]:
    """The metrics of each user's one held-out engagement."""
    return per_user_metrics(r.target_rank)


def expected_over(p: np.ndarray) -> Measure:
    """The metrics' expectations over p (U, N), each user's probability of every item being the held-out one."""
    return lambda r: expected_metrics(r.top, p)


def metric_cells(r: Ranking, mask: np.ndarray | None = None, measure: Measure = held_out) -> list[str]:
    per_user = measure(r)
    return [format_ci(*bootstrap_ci(per_user[name] if mask is None else per_user[name][mask])) for name in METRICS]


def main_table(rows: list[Row], ranker_top: np.ndarray, truth: np.ndarray | None) -> str:
    lines = ["| model | storage | HR@10 | HR@50 | HR@200 | NDCG@10 | ranker top-100 in top-1000 | "
             "true top-100 in top-1000 | FLOPs/pair (analytical) | FLOPs/pair (flop_counter, matmuls) | "
             "bytes/ad scanned | bytes/ad held |", "|---" * 12 + "|"]
    for row in rows:
        true = "n/a" if truth is None else f"{recall_within(truth, row.ranking.top):.3f}"
        cost = [f"{row.flops:,}", f"{row.counted:,.0f}", str(row.bytes[0]), str(row.bytes[1])] if row.kind else ["-"] * 4
        lines.append(f"| {row.name} | {row.storage} | " + " | ".join(metric_cells(row.ranking)) +
                     f" | {recall_within(ranker_top, row.ranking.top):.3f} | {true} | " + " | ".join(cost) + " |")
    return "\n".join(lines)


def subset_table(rows: list[Row], mask: np.ndarray | None = None, measure: Measure = held_out) -> str:
    if mask is not None and not mask.any():
        return "(no such users in this data set)"
    lines = ["| model | HR@10 | HR@50 | HR@200 | NDCG@10 |", "|---|---|---|---|---|"]
    lines += [f"| {row.name} | " + " | ".join(metric_cells(row.ranking, mask, measure)) + " |" for row in rows]
    return "\n".join(lines)


def paired_intervals(a: Row, b: Row, measure: Measure = held_out) -> list[tuple[float, float, float]]:
    """Per metric of METRICS: a minus b over the same users, (mean, low, high) of the paired bootstrap."""
    ours, theirs = measure(a.ranking), measure(b.ranking)
    return [paired_difference(ours[m], theirs[m]) for m in METRICS]


def significance(pairs: list[tuple[Row, Row]], measure: Measure = held_out) -> list[list[tuple[float, str]]]:
    """For each (a, b) pair and metric: a's mean minus b's and "better", "worse" or "" (within noise), significant
    where the two-sided paired bootstrap p-value, Holm-adjusted over every pair and metric given (one family), is
    below 0.05 (until 2026-12-06 each 95% interval alone decided, over about 100 comparisons per world)."""
    cells = []
    for a, b in pairs:
        ours, theirs = measure(a.ranking), measure(b.ranking)
        cells += [(ours[m], theirs[m]) for m in METRICS]
    labels = []
    for (x, y), p in zip(cells, holm([paired_p_value(x, y) for x, y in cells])):
        diff = float(np.mean(x) - np.mean(y))
        labels.append((diff, ("better" if diff > 0 else "worse") if p < 0.05 else ""))
    return [labels[i:i + len(METRICS)] for i in range(0, len(labels), len(METRICS))]


def comparisons(moe: Row, others: list[Row], measure: Measure = held_out) -> str:
    """MoE minus each other row per metric: paired bootstrap 95% interval, and significance over the whole table
    (significance)."""
    lines = ["| MoE minus | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 1) + "|"]
    for row, labels in zip(others, significance([(moe, row) for row in others], measure)):
        cells = [f"{diff:+.4f} [{low:+.4f}, {high:+.4f}] " + (f"**{label}**" if label else "within noise")
                 for (diff, low, high), (_, label) in zip(paired_intervals(moe, row, measure), labels)]
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def versus(pairs: list[tuple[Row, Row]], measure: Measure = held_out) -> tuple[int, int, int]:
    """Over every (a, b) pair and metric, one family: (where a's mean is above b's, where a is significantly above,
    significantly below)."""
    cells = [cell for labels in significance(pairs, measure) for cell in labels]
    return (sum(diff > 0 for diff, _ in cells), sum(label == "better" for _, label in cells),
            sum(label == "worse" for _, label in cells))


TARGETS_HEAD = ("Targets (one that orders two models tests its own comparisons, Holm-adjusted over its 4 metrics, or its "
                "12 model-metric pairs, and needs every one: stricter than any one alone; the tables above adjust over "
                "all their comparisons at once, so a cell there may read within noise where a target counts it):")
MATCH_MARGIN = 0.1  # "matches": not worse than the other by this share of its mean, on any metric (non-inferiority)


def matches(a: Row, b: Row, measure: Measure = held_out) -> int:
    """On how many metrics a is shown not worse than b by MATCH_MARGIN of b's mean: one-sided paired bootstrap
    p-values, Holm-adjusted over the metrics, below 0.05 (failing to find a significant loss, the rule before
    2026-12-06, is what noise alone does)."""
    ours, theirs = measure(a.ranking), measure(b.ranking)
    p = [paired_p_value(ours[m], theirs[m], margin=MATCH_MARGIN * float(np.mean(theirs[m])) or 1e-12) for m in METRICS]
    return sum(q < 0.05 for q in holm(p))


def ordering(by: dict[tuple[str, str], Row], measure: Measure, label: str) -> list[tuple[bool, str]]:
    """The targets that order the models, on measure. "Beats": significantly better on every metric (each target's
    comparisons one family: significance); "matches or beats": matches on every metric (matches)."""
    moe, ranker = by[("moe", "fp32")], by[("ranker", "fp32")]
    n, checks = len(METRICS), []
    for name in ("most popular", "item-kNN", CONTENT, DECLARED):
        if (name, "-") not in by:
            continue
        above, better, worse = versus([(moe, by[(name, "-")])], measure)
        checks.append((better == n, f"MoE beats {name}{label}: significantly higher on {better} of {n} metrics "
                                    f"(higher on {above}, {worse} significantly lower)"))
    sasrec = by[("sasrec", "fp32")]
    above, better, worse = versus([(moe, sasrec)], measure)
    kept = matches(moe, sasrec, measure)
    checks.append((kept == n, f"MoE matches or beats the SASRec-style two-tower{label}: shown not worse by "
                              f"{MATCH_MARGIN:.0%} of its mean on {kept} of {n} metrics (higher on {above}, {better} "
                              f"significantly, {worse} significantly lower)"))
    above, better, worse = versus([(ranker, moe)], measure)
    checks.append((better == n, f"ranker beats the MoE{label}: significantly higher on {better} of {n} metrics "
                                f"(higher on {above}, {worse} significantly lower)"))
    before = [by[(name, "fp32")] for name in ("sasrec", "two_tower", UNDISTILLED if (UNDISTILLED, "fp32") in by else "moe")]
    above, better, worse = versus([(ranker, row) for row in before], measure)
    pairs = n * len(before)
    checks.append((better == pairs, f"ranker beats every retrieval model before distillation ({', '.join(r.name for r in before)})"
                                    f"{label}: significantly higher on {better} of {pairs} model-metric pairs (higher on "
                                    f"{above}, {worse} significantly lower)"))
    return checks


def targets(rows: list[Row], ranker_top: np.ndarray, truth_target: float | None, truth: np.ndarray | None,
            expected: Measure | None = None) -> list[str]:
    """The quality targets, judged on the measured rows (storage: as served, with rescoring); those that order the
    models on the held-out engagement and, where the world's engagement probability is known, on its expectation."""
    by = {(r.name, r.storage): r for r in rows}
    moe, ranker = by[("moe", "fp32")], by[("ranker", "fp32")]
    checks = ordering(by, held_out, "")
    if expected:
        checks += ordering(by, expected, " (expected over the world's engagements)")
    recall = recall_within(ranker_top, moe.ranking.top)
    checks.append((recall >= 0.9, f"MoE finds {recall:.1%} of the ranker's top-100 in its top-1000 (target >= 90%; "
                                  f"the ranker shares the MoE's towers, so this measures what its deep part reorders)"))
    checks.append((ranker.flops >= 100 * moe.flops,
                   f"ranker / MoE FLOPs per pair = {ranker.flops / moe.flops:.0f}x (target >= 100x)"))
    if truth is not None and truth_target is not None:
        true = recall_within(truth, moe.ranking.top)
        checks.append((true >= truth_target, f"MoE finds {true:.1%} of the true top-100 in its top-1000 (target >= "
                                             f"{truth_target:.0%}: twice the {truth_target / 2:.0%} of the models before "
                                             f"learned ids on this world)"))
    served = [by[("moe", storage_label(d, RESCORE))] for d in ("fp16", "int8")]
    moved = max(crossings(r.ranking, moe.ranking) for r in served)
    checks.append((moved <= 0.01 * len(moe.ranking.target_rank),
                   f"fp16/int8 as served (top-{RESCORE}x rescored): at most {moved} of {len(moe.ranking.target_rank)} "
                   f"users' held-out item crosses a cutoff of {', '.join(map(str, CUTOFFS))} vs fp32 (target <= 1%)"))
    return [f"- {'met' if ok else 'NOT met'}: {text}" for ok, text in checks]


def expected_section(data: RecData, users: np.ndarray, by_name: dict[str, Row], others: list[Row],
                     p: np.ndarray, truth: np.ndarray) -> str:
    """The synthetic world's rows and MoE comparisons on the metrics' expectations over p (U, N), its engagement
    distribution; truth (U, 100): the true top-100."""
    expected = expected_over(p)
    ceiling = Row(CEILING, "-", ranking_by(p, data, users))
    drawn, mean = held_out(ceiling.ranking)["HR@10"], expected(ceiling.ranking)["HR@10"]
    return (f"### Expected over the world's engagements\n\n"
            f"The held-out engagement above is one draw per user. The world knows each user's probability of "
            f"engaging with every ad (c: shown in the user's topic draws or at random, then engaged with, "
            f"sigmoid(truth - 2)), each ad independently, so given the engagements before it the held-out one is "
            f"ad a with probability proportional to c_a / (1 - c_a). Each cell here is the metric's expectation over that "
            f"probability, averaged over the same users [95% bootstrap interval]: what the table above estimates, "
            f"without the noise of one draw. The ceiling ranks by that probability itself (no ranking does better "
            f"on these; on the held-out draws it reaches HR@10 {format_ci(*bootstrap_ci(drawn))} against "
            f"{mean.mean():.4f} expected, a check of the probability, and it finds "
            f"{recall_within(truth, ceiling.ranking.top):.1%} of the true top-100 in its top-1000: a model that "
            f"learned the logs' next click exactly would find that much); the oracle ranks by affinity alone, "
            f"without the world's exposure, which the models learn from its logs.\n\n"
            f"{subset_table([ceiling, *by_name.values()], measure=expected)}\n\n"
            f"MoE minus each other row, paired bootstrap as above:\n\n"
            f"{comparisons(by_name['moe'], others, expected)}\n\n")


def click_prior_tradeoff(model: RetrievalModel, ranked: Ranking, data: RecData, users: np.ndarray, p: np.ndarray,
                         truth: np.ndarray) -> str:
    """The model ranked at each click weight of CLICK_WEIGHTS (its smoothing kept; at its own weight: ranked, its
    ranking of users): expected metrics over p (U, N) and its share of the true top-100 (truth (U, 100)) in its
    top-1000. The model's own weight is restored."""
    chosen = model.dims
    lines = ["| click weight w | expected HR@10 | expected HR@200 | true top-100 in top-1000 |", "|---|---|---|---|"]
    try:
        for weight in CLICK_WEIGHTS:
            model.dims = dataclasses.replace(chosen, click_weight=weight)
            ranking = ranked if weight == chosen.click_weight else rank_items(model, data, users, progress=False)
            expected = expected_metrics(ranking.top, p)
            lines.append(f"| {weight:g}{' (chosen)' if weight == chosen.click_weight else ''} | "
                         f"{expected['HR@10'].mean():.4f} | {expected['HR@200'].mean():.4f} | "
                         f"{recall_within(truth, ranking.top):.3f} |")
    finally:
        model.dims = chosen
    return ("### The click prior: the logged next click against the true affinity\n\n"
            "The MoE at each weight of the click prior (smoothing as chosen). Validation, like the held-out click, "
            "reads the world's logs, where a user is shown mostly the ads of their own topics; the true top-100 ranks "
            "by affinity alone, as if every ad were shown, and clicks per impression estimate an ad's affinity "
            "wherever it was shown: the two need not want the same weight.\n\n" + "\n".join(lines) + "\n\n")


def section(data: RecData, retrain: bool, plot_dir: Path, beside: bool = False) -> str:
    started = time.time()
    trained = train_all(data, retrain, beside)
    users = data.eval_users()[:EVAL_USERS]
    rows, subsets, windows = rankings(data, trained, users)
    ranker_top = next(r for r in rows if r.name == "ranker").ranking.top[:, :100]
    by_name = {r.name: r for r in rows if r.storage in ("-", "fp32")}
    truth = by_name[ORACLE].ranking.top[:, :100] if data.truth else None  # the true top-100, history excluded
    known = set(data.train_items().tolist())
    cold = np.array([data.users.items[u][-1] not in known for u in users])
    short = np.array([data.split(u)[1] <= SHORT_HISTORY for u in users])
    others = [r for r in by_name.values() if r.name not in ("moe", ORACLE)]
    p = engagement_distribution(data, users) if data.truth else None
    expected = expected_over(p) if p is not None else None
    plotted = expected or held_out
    plot = plot_quality_vs_flops(
        [{"name": r.name, "flops": r.flops, **dict(zip(("mean", "low", "high"), bootstrap_ci(plotted(r.ranking)["HR@10"])))}
         for r in by_name.values()], plot_dir / f"quality-{data.name}.png",
        f"{data.name}: {'expected ' if expected else ''}HR@10 against FLOPs per pair")
    tuning = ", ".join(f"{distill_label(w)}: {s:.4f}" for w, s in trained.validation.items())
    pair = ", ".join(f"{name} {w:g}" for name, w in zip(FEATURE_NAMES, trained.models["ranker"].head.cross.tolist()))
    body = (f"{main_table(rows, ranker_top, truth)}\n\n![quality against FLOPs]({plot.name})\n\n"
            f"### The MoE against every other row: paired bootstrap over the same users\n\n"
            f"Difference of means [95% interval]; significant where the two-sided paired bootstrap p-value "
            f"({PAIRED_RESAMPLES:,} resamples), Holm-adjusted over the table's {len(others) * len(METRICS)} "
            f"comparisons, is below 0.05.\n\n"
            f"{comparisons(by_name['moe'], others)}\n\n"
            f"{expected_section(data, users, by_name, others, p, truth) if p is not None else ''}"
            f"{click_prior_tradeoff(trained.models['moe'], by_name['moe'].ranking, data, users, p, truth) if p is not None else ''}"
            f"### Cold start\n\nNew items: the {int(cold.sum())} users whose held-out item was never engaged in "
            f"training (no learned id: embedded from content alone).\n\n"
            f"{subset_table([r for r in by_name.values() if r.name != ORACLE], cold)}\n\n"
            f"Every ad new: the whole corpus embedded from content alone (as if every ad were created after "
            f"training), for the retrieval models.\n\n{subset_table(subsets['content_only'])}\n\n"
            f"Short histories: the {int(short.sum())} users with at most {SHORT_HISTORY} engagements before their "
            f"held-out one.\n\n{subset_table(list(by_name.values()), short)}\n\n"
            f"Short histories, simulated for every user: the towers of the retrieval models read only the last "
            f"{SHORT_HISTORY} engagements (item-kNN and content sum over their last {SHORT_HISTORY}; segments and "
            f"co-engagements stay; the whole history is still excluded from the ranking).\n\n{subset_table(subsets['short'])}\n\n"
            f"{TARGETS_HEAD}\n" + "\n".join(targets(rows, ranker_top, TRUE_RECALL_TARGET.get(data.name), truth, expected)))
    return (f"## {data.name}\n\n{len(data.items.ids):,} items, {len(data.users.items):,} users, {len(users)} evaluated "
            f"(last engagement held out, full corpus ranked, history excluded). {timing(trained, started)} "
            f"The MoE kept, chosen on the validation split (mean of the four metrics at each user's second-to-last "
            f"engagement) among the MoE the ranker starts from and the same more steps from it at each weight of "
            f"distillation from the ranker's top-{TEACHER_TOP} (asked for {asked(data)}; weight 0: no teacher): "
            f"{tuning}; chosen: {distill_label(trained.chosen)} (the teacher is asked at those same states, which "
            f"favours distillation a little). "
            f"The ranker's wide weights on its pair features, chosen on that validation split before its deep "
            f"part trains: {pair}; its deep part, trained after them, kept at scale {deep_scale(trained)}. "
            f"The history baselines' windows, chosen on that validation split among "
            f"{', '.join(map(str, WINDOWS))}: " + ", ".join(f"{name} the last {w}" for name, w in windows.items()) +
            f". {click_weights(trained)}"
            f"Cells: mean [95% bootstrap interval over users].\n\n" + body)


def side_by_side(fn: Callable, jobs: list[tuple], workers: int) -> list:
    """[fn(*job) for job in jobs], in `workers` processes (started in job order) when more than 1. The first error
    of any job is raised as soon as it happens, and the other jobs are stopped. Spawned, not forked: a forked child
    of a process whose OpenMP threads already ran can hang."""
    if workers <= 1:
        return [fn(*job) for job in jobs]
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(fn, *job) for job in jobs]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for failed in (f for f in done if f.exception() is not None):
            terminate(pool)
            raise failed.exception()
        return [f.result() for f in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def terminate(pool: ProcessPoolExecutor) -> None:
    """Stops the pool's processes, after an error: a running job would otherwise hold the exit for an hour."""
    for process in list(pool._processes.values()):
        process.terminate()


def _section_of(name: str, world: Path | None, retrain: bool, plot_dir: Path, threads: int, beside: bool) -> str:
    """One data set's section, computed with `threads` torch threads (in a worker process of quality_report; beside:
    its BESIDE models in a process of their own)."""
    if beside:  # stopped by side_by_side, train_all stops the processes beside it
        signal.signal(signal.SIGTERM, _exit)
    torch.set_num_threads(threads)
    return section(load_data(name, world), retrain, plot_dir, beside)


def _exit(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def quality_report(datasets: tuple[str, ...], out: Path, retrain: bool = False, world: Path | None = None,
                   workers: int | None = None) -> str:
    """Writes the report to `out`. The data sets run side by side in `workers` processes (default: one per data set;
    one in all on one core), the cores shared out among them as torch threads (at least one each): the models' small
    ops use a second thread at about 70% (a MoE's training steps on the synthetic world: 1.4x faster on 2 threads
    than on 1), so data sets on one thread each finish sooner than one after the other on two. On 2 cores the three
    data sets share the two cores, since no one of them is half the work: two processes, MovieLens in one and the
    synthetic worlds one after the other in the other (2,476 s and 3,423 s of one core), took 3,427 s; three took
    2,981 s (2026-12-06, with the ranker's rankings 14% faster as well). Side by side, each data set also trains its
    BESIDE models in a process of its own (train_all), and the threads are shared out among all the processes:
    MovieLens, whose three retrieval models of 2,000 steps took 1,759 of its 2,476 s, was last by 200 s (the threads of
    the processes beside stay reserved after they finish). Results are bit-identical for a seed on the same machine
    and the same number of threads per process."""
    if world and world_config(world) is not None and not is_current(world):
        raise InvalidInput(f"{world} was drawn by an older generator (the report reads what version {GENERATOR} keeps); "
                           f"draw it again with `andromeda synth`", "--world")
    started = time.time()
    out.parent.mkdir(parents=True, exist_ok=True)
    datasets = tuple(dict.fromkeys(datasets))  # a data set twice would write its checkpoints from two processes
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(len(datasets), workers or (len(datasets) if cores > 1 else 1)))
    beside = workers > 1  # side by side, each data set's BESIDE models train in a process of their own too
    threads = max(1, cores // (workers * (1 + len(BESIDE) * beside)))
    jobs = [(name, world if name == "synthetic" else None, retrain, out.parent, threads, beside) for name in datasets]
    described_table(load_schema())  # the text of the described values, into the cache the processes read (each would
    # otherwise load MiniLM for it)
    sections = side_by_side(_section_of, jobs, workers)
    cpu = platform.processor() or platform.machine()
    text = (f"# Retrieval quality\n\nWritten by `andromeda eval` in one run ({time.time() - started:.0f} s on {cpu}, "
            f"{cores} cores: the data sets in {workers} processes"
            + (f", each training its {' and '.join(BESIDE)} in processes of their own beside it," if beside else "")
            + f" of {threads} torch thread{'s' * (threads > 1)} each, torch {torch.__version__}). Models train with default sizes "
            f"(`andromeda train`); checkpoints in `.cache/models/`. Baselines: most popular (training "
            f"engagements), item-kNN (cosine over co-engagement, summed over the user's last W), content (cosine of "
            f"the ad's MiniLM text embedding, the ad tower's input, with the mean of the user's last W; W chosen per "
            f"data set on the validation split, as the models' settings), declared "
            f"interests (the same cosine with the mean MiniLM text of the interests and behaviours the user declares; "
            f"synthetic worlds only: MovieLens users declare nothing), and a "
            f"SASRec-style two-tower (the MoE's sequence expert alone, dot product). The oracle ranks by the "
            f"synthetic world's own true affinity. The ranker (the MoE's frozen towers, a deep part and a wide "
            f"part) also reads pair features no two-tower can compute: the item-kNN score of the candidate "
            f"against the user's last 1, 5 and 50 engagements (mean cosine over co-engagement) and its log "
            f"popularity, fit on training engagements without the user's own (leave-one-user-out; a new ad "
            f"has none), and whether one of the interests the user declares occurs as whole words in the ad's "
            f"text (interest; synthetic worlds only: MovieLens users declare nothing).\n\n" + "\n\n".join(sections) + "\n")
    out.write_text(text)
    return text
