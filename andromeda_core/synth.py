"""Synthetic ads world with a known ground truth.

Topics (the schema's base interests) have latent centres in R^d. An ad belongs to one topic:
latent a = normalise(centre + noise) and a quality q. A user has K interest clusters u_1..u_K near
topic centres. True affinity: truth(u, a) = 4 * max_k <u_k, a> + q. A user is shown 8 ads of each
cluster's topic (uniform within the topic, repeats merged) and 8 uniform over all ads, and engages with
each with probability sigmoid(truth - 2) (engagement_probability). Ads carry realistic targeting (mostly broad, some narrow,
exclusions, all_of groups, time windows, paused ads) and topic-worded creatives.

Output directory: events.jsonl (ad events, stream order), requests.jsonl (one request per user),
engagements.jsonl (impressions and engagements drawn from the truth), truth.npz (latents, quality and
topics of ads and users, the generator's config). Deterministic for a seed; ad chunks are generated in parallel.
"""
from __future__ import annotations

import json
import os
import zipfile
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from tqdm import tqdm

from andromeda_core.errors import InvalidInput
from andromeda_core.schema import Schema, load_schema

FACETS = ("beginners", "enthusiasts", "gear", "news", "events", "videos", "brands", "deals", "communities",
          "experts", "kids", "women", "men")
VERTICALS = ("sports", "fitness", "arts", "crafts", "food", "drinks", "travel", "outdoors", "culture", "music",
             "entertainment", "gaming", "media", "learning", "science", "technology", "business", "finance",
             "design", "home", "fashion", "beauty", "family", "pets", "automotive", "gadgets", "lifestyle",
             "shopping", "careers")
PRODUCTS = ("sale", "starter kit", "membership", "classes", "guide", "collection", "app", "subscription",
            "bundle", "festival", "workshop", "box")
PITCHES = ("Save big this week", "Loved by thousands", "Free shipping today", "Join the community",
           "Limited time offer", "New season, new look", "Try it free for 30 days", "Built for you")
SYLLABLES = ("zen", "ko", "va", "lu", "mi", "tor", "ex", "ra", "pix", "no", "sol", "dy", "qua", "ri", "fe", "lo")
MAJOR_COUNTRIES = ("US", "IN", "BR", "GB", "DE", "FR", "CA", "JP", "MX", "ID", "IT", "ES", "AU", "NG", "PH")
COUNTRY_WEIGHTS = np.array([30, 15, 8, 6, 5, 5, 4, 4, 4, 4, 3, 3, 3, 3, 3], dtype=float)
LANGUAGE_OF = {"US": "en", "IN": "hi", "BR": "pt", "GB": "en", "DE": "de", "FR": "fr", "CA": "en", "JP": "ja",
               "MX": "es", "ID": "id", "IT": "it", "ES": "es", "AU": "en", "NG": "en", "PH": "tl"}
SURFACE_WEIGHTS = {"feed": 45, "stories": 15, "reels": 15, "video": 8, "search": 6, "marketplace": 5,
                   "messenger": 3, "right_column": 2, "notifications": 1}
AUDIENCE_POOL, LOOKALIKE_POOL = 5000, 2000
GENERATOR = 2  # the version of the drawing below, kept in truth.npz: 2 keeps user topics and shuffles the log's order
SHOWN_PER_TOPIC, SHOWN_AT_RANDOM = 8, 8  # a user's impressions: per cluster topic, then over all ads
DAY = 86400


@dataclass(frozen=True)
class WorldConfig:
    ads: int
    users: int
    seed: int = 0
    latent_dim: int = 32
    clusters: int = 3
    base_time: int = 1764460800  # 2025-11-30T00:00:00Z
    chunk: int = 50000


WORLD_CATEGORIES = ("interests", "behaviors", "life_events", "custom_audiences", "country", "age", "gender",
                    "device_os", "language", "surface", "placement")  # the categories its ads target and its users hold


class World:
    """The shared, seed-determined parts of the world: topics, their centres and verticals."""

    def __init__(self, schema: Schema, cfg: WorldConfig):
        self.schema, self.cfg = schema, cfg
        interests = schema.by_name["interests"].vocabulary
        self.topics = [v for v in interests if not v.endswith(tuple(f"_{f}" for f in FACETS))]
        vocab = set(interests)
        self.facets = {t: [f"{t}_{f}" for f in FACETS if f"{t}_{f}" in vocab] for t in self.topics}
        rng = np.random.default_rng([cfg.seed, 7])
        centres = rng.standard_normal((len(self.topics), cfg.latent_dim))
        self.centres = centres / np.linalg.norm(centres, axis=1, keepdims=True)
        popularity = 1.0 / np.arange(1, len(self.topics) + 1) ** 0.8
        self.popularity = rng.permutation(popularity / popularity.sum())
        self.vertical = [VERTICALS[i * len(VERTICALS) // len(self.topics)] for i in range(len(self.topics))]
        self.behaviors = schema.by_name["behaviors"].vocabulary
        self.placements = schema.by_name["placement"].vocabulary

    def latents(self, rng: np.random.Generator, topics: np.ndarray, noise: float) -> np.ndarray:
        x = self.centres[topics] + noise * rng.standard_normal((len(topics), self.cfg.latent_dim))
        return x / np.linalg.norm(x, axis=-1, keepdims=True)


def truth_scores(user_latent: np.ndarray, ad_latent: np.ndarray, ad_quality: np.ndarray) -> np.ndarray:
    """user_latent (K, d), ad_latent (N, d), ad_quality (N,) -> (N,) true affinity."""
    return 4.0 * (ad_latent.astype(np.float32) @ user_latent.astype(np.float32).T).max(axis=1) + ad_quality


def engaged_if_shown(truth: np.ndarray) -> np.ndarray:
    """(N,) true affinities -> (N,) the probability that a user shown the ad engages with it, sigmoid(truth - 2)."""
    return 1 / (1 + np.exp(-(truth - 2.0)))


def engagement_probability(user_latent: np.ndarray, user_topic: np.ndarray, ad_latent: np.ndarray,
                           ad_quality: np.ndarray, ad_topic: np.ndarray) -> np.ndarray:
    """user_latent (K, d), user_topic (K,), ad_latent (N, d), ad_quality (N,), ad_topic (N,) -> (N,): the
    probability that the world shows the user each ad (in its topic draws or its random ones) and the user
    engages with it."""
    per_topic = np.bincount(ad_topic)
    in_topic = np.isin(ad_topic, user_topic)
    missed = (1 - 1 / len(ad_topic)) ** SHOWN_AT_RANDOM * np.where(
        in_topic, (1 - 1 / per_topic[ad_topic]) ** SHOWN_PER_TOPIC, 1.0)
    return (1 - missed) * engaged_if_shown(truth_scores(user_latent, ad_latent, ad_quality))


def _brand(advertiser_id: int) -> str:
    a, b = divmod(advertiser_id * 2654435761 % (len(SYLLABLES) ** 3), len(SYLLABLES) ** 2)
    return (SYLLABLES[a % len(SYLLABLES)] + SYLLABLES[b // len(SYLLABLES)] + SYLLABLES[b % len(SYLLABLES)]).title()


class _Draws:
    """All random draws for a chunk of n ads, made up front (per-ad generator calls are slow)."""

    def __init__(self, world: World, rng: np.random.Generator, n: int):
        p_country = COUNTRY_WEIGHTS / COUNTRY_WEIGHTS.sum()
        self.r = rng.random((n, 16))
        self.countries = rng.choice(len(MAJOR_COUNTRIES), (n, 5), p=p_country)
        self.n_pick = rng.integers(1, 6, (n, 4))
        self.age = rng.choice([13, 18, 21, 25, 35], n), rng.choice([34, 44, 54, 65, 100], n)
        self.picks = rng.integers(0, 1 << 30, (n, 8))
        self.audiences = rng.integers(0, AUDIENCE_POOL, (n, 5))
        self.behaviors = rng.integers(0, len(world.behaviors), (n, 3))
        self.times = rng.integers(0, 60 * DAY, (n, 2))


def _ad_targeting(world: World, d: _Draws, i: int, topic: int) -> dict[str, Any]:
    t: dict[str, Any] = {}
    r, pick, n = d.r[i], d.picks[i], d.n_pick[i]
    if r[0] < 0.8:
        t["country"] = {"any_of": sorted({MAJOR_COUNTRIES[c] for c in d.countries[i, : n[0]]})}
    if r[1] < 0.6:
        lo = int(d.age[0][i])
        t["age"] = {"min": lo, "max": max(lo + 9, int(d.age[1][i]))} if r[2] < 0.5 else {"min": lo}
    name = world.topics[topic]
    facets = world.facets[name]
    if r[3] < 0.25:
        options = [name, *facets]
        t["interests"] = {"any_of": sorted({options[p % len(options)] for p in pick[: n[1]]})}
        if r[4] < 0.2 and facets:  # AND of ORs: also a second, related group
            t["interests"]["all_of"] = [sorted({name, facets[pick[5] % len(facets)], facets[pick[6] % len(facets)]})]
    if r[5] < 0.1:
        t["behaviors"] = {"any_of": sorted({world.behaviors[b] for b in d.behaviors[i, : min(n[2], 3)]})}
    if r[6] < 0.05:
        t["custom_audiences"] = {"any_of": sorted({int(a) for a in d.audiences[i, : min(n[3], 3)]})}
    if r[7] < 0.1:
        t.setdefault("custom_audiences", {})["none_of"] = sorted({int(a) for a in d.audiences[i, 3:]})
    if r[8] < 0.1:
        t["device_os"] = {"any_of": ["android" if r[12] < 0.6 else "ios"]}
    if r[9] < 0.15:
        surfaces = list(SURFACE_WEIGHTS)[:4]
        t["surface"] = {"any_of": sorted({surfaces[pick[7] % 4], surfaces[pick[4] % 4]})}
    if r[10] < 0.05:
        t["gender"] = {"any_of": ["female" if r[13] < 0.5 else "male"]}
    if r[11] < 0.05:
        t["life_events"] = {"none_of": ["recently_moved"]}
    return t


def _ad_chunk(args: tuple[World, int, int]) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Ads [first, first + n) -> (JSONL text, topics (n,), latents (n, d) f16, quality (n,))."""
    world, first, n = args
    cfg = world.cfg
    rng = np.random.default_rng([cfg.seed, 1, first])
    topics = rng.choice(len(world.topics), n, p=world.popularity)
    latents = world.latents(rng, topics, 0.6).astype(np.float16)
    quality = rng.normal(0.0, 0.5, n).astype(np.float32)
    advertisers = rng.integers(1, max(2, cfg.ads // 40), n)
    bids = np.round(rng.lognormal(0.0, 0.7, n), 2)
    d = _Draws(world, rng, n)
    lines, later = [], []
    for i in range(n):
        ad_id, topic = first + i + 1, int(topics[i])
        name, adv, r, pick = world.topics[topic], int(advertisers[i]), d.r[i], d.picks[i]
        words = name.replace("_", " ")
        facets = world.facets[name] or [name]
        ad: dict[str, Any] = {
            "ad_id": ad_id, "advertiser_id": adv, "version": 1,
            "status": "paused" if r[14] < 0.04 else "active",
            "creative": {"title": f"{_brand(adv)} {words} {PRODUCTS[pick[0] % len(PRODUCTS)]}",
                         "body": f"{PITCHES[pick[1] % len(PITCHES)]}: {words} for "
                                 f"{facets[pick[2] % len(facets)].replace('_', ' ')}.",
                         "category": world.vertical[topic]},
            "bid": float(bids[i]), "targeting": _ad_targeting(world, d, i, topic),
        }
        window, (t0, t1) = r[15], d.times[i]
        if window < 0.25:
            ad["start_time"], ad["end_time"] = cfg.base_time - int(t0) // 2, cfg.base_time + 3600 + int(t1)
        elif window < 0.28:  # already over
            ad["start_time"], ad["end_time"] = cfg.base_time - 70 * DAY, cfg.base_time - 1 - int(t1) // 6
        elif window < 0.30:  # not started yet
            ad["start_time"] = cfg.base_time + DAY + int(t0) // 6
        lines.append(json.dumps({"op": "upsert", "ad": ad}, separators=(",", ":")))
        edit = (pick[3] % 1000) / 1000
        if edit < 0.02:
            later.append({"op": "upsert", "ad": {**ad, "version": 2, "bid": round(ad["bid"] * 1.2, 2)}})
        elif edit < 0.03:
            later.append({"op": "pause", "ad_id": ad_id, "version": 2})
        elif edit < 0.035:
            later.append({"op": "delete", "ad_id": ad_id, "version": 2})
    lines.extend(json.dumps(e, separators=(",", ":")) for e in later)
    return "\n".join(lines) + "\n", topics.astype(np.int16), latents, quality


class _AdsByTopic:
    """Ad rows grouped by topic, for drawing the ads a user was shown."""

    def __init__(self, topics: np.ndarray, n_topics: int):
        self.order = np.argsort(topics, kind="stable")
        self.bounds = np.searchsorted(topics[self.order], np.arange(n_topics + 1))

    def sample(self, rng: np.random.Generator, topics: np.ndarray, per_topic: int) -> np.ndarray:
        out = [self.order[rng.integers(self.bounds[t], self.bounds[t + 1], per_topic)]
               for t in topics if self.bounds[t + 1] > self.bounds[t]]
        return np.concatenate(out) if out else np.empty(0, np.int64)


def _user(world: World, rng: np.random.Generator, user_id: int, by_topic: _AdsByTopic, ad_latent: np.ndarray,
          ad_quality: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray, list[dict]]:
    cfg = world.cfg
    clusters = rng.choice(len(world.topics), cfg.clusters, replace=False, p=world.popularity)
    latent = world.latents(rng, clusters, 0.3)
    country = str(rng.choice(MAJOR_COUNTRIES, p=COUNTRY_WEIGHTS / COUNTRY_WEIGHTS.sum()))
    interests = set()
    for c in clusters:
        name = world.topics[c]
        interests.add(name)
        interests.update(rng.choice(world.facets[name], int(rng.integers(0, 3))).tolist() if world.facets[name] else [])
    interests.update(rng.choice(world.topics, int(rng.integers(0, 3))).tolist())
    attributes: dict[str, Any] = {
        "age": int(rng.integers(13, 81)), "gender": str(rng.choice(["female", "male", "nonbinary", "unknown"], p=[.48, .48, .02, .02])),
        "country": country, "region": int(rng.integers(0, 5000)), "city": int(rng.integers(0, 200000)),
        "language": [LANGUAGE_OF[country]] + (["en"] if LANGUAGE_OF[country] != "en" and rng.random() < 0.4 else []),
        "device_os": str(rng.choice(["android", "ios", "windows", "macos"], p=[.55, .3, .1, .05])),
        "os_version": int(rng.integers(10, 19)), "device_type": str(rng.choice(["mobile", "tablet", "desktop"], p=[.8, .1, .1])),
        "connection": str(rng.choice(["wifi", "5g", "4g", "3g"], p=[.5, .2, .25, .05])),
        "interests": sorted(interests), "behaviors": sorted(set(rng.choice(world.behaviors, int(rng.integers(1, 6))).tolist())),
        "income_band": int(rng.integers(1, 11)), "household_size": int(rng.integers(1, 7)),
        "custom_audiences": sorted(set(rng.integers(0, AUDIENCE_POOL, int(rng.integers(0, 5))).tolist())),
        "lookalike_audiences": sorted(set(rng.integers(0, LOOKALIKE_POOL, int(rng.integers(0, 3))).tolist())),
    }
    if rng.random() < 0.15:
        attributes["life_events"] = [str(rng.choice(world.schema.by_name["life_events"].vocabulary))]
    # Engagement history drawn from the truth over ads of the user's topics plus random ones.
    pool = np.unique(by_topic.sample(rng, clusters, SHOWN_PER_TOPIC))
    # In a random order: the times below are sorted, and the log's order must not tell how an ad came to be shown
    # (the random ads last, the topics' ads by row made the last click mostly a random ad).
    shown = rng.permutation(np.concatenate([pool, rng.integers(0, len(ad_quality), SHOWN_AT_RANDOM)]))
    p_engage = engaged_if_shown(truth_scores(latent, ad_latent[shown], ad_quality[shown]))
    engaged = rng.random(len(shown)) < p_engage
    times = np.sort(rng.integers(cfg.base_time - 14 * DAY, cfg.base_time, len(shown)))
    log = [{"user_id": user_id, "ad_id": int(a) + 1, "event": "click" if e else "impression", "ts": int(ts)}
           for a, e, ts in zip(shown, engaged, times)]
    surface = str(rng.choice(list(SURFACE_WEIGHTS), p=np.array(list(SURFACE_WEIGHTS.values())) / 100))
    placements = [p for p in world.placements if p.startswith(surface)]
    request = {
        "user": {"user_id": user_id, "attributes": attributes,
                 "history": [{k: v for k, v in e.items() if k != "user_id"} for e in log if e["event"] == "click"][-20:],
                 "cohorts": sorted(set(rng.integers(0, 1000, 2).tolist())),
                 "co_engagement": [{"surface": str(rng.choice(["reels", "video", "marketplace"])), "ad_id": int(a) + 1}
                                   for a in rng.choice(pool, min(len(pool), 3), replace=False)] if len(pool) else []},
        "context": {"surface": surface, "placement": str(rng.choice(placements)), "ts": cfg.base_time + int(rng.integers(0, 3600))},
        "k": 100,
    }
    return request, clusters, latent.astype(np.float16), log


def iter_ad_chunks(world: World, workers: int = 2) -> Iterator[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """Yield the ad chunks in order (JSONL text, topics, latents, quality), generated in parallel."""
    cfg = world.cfg
    jobs = [(world, first, min(cfg.chunk, cfg.ads - first)) for first in range(0, cfg.ads, cfg.chunk)]
    if workers <= 1 or len(jobs) <= 1:
        yield from map(_ad_chunk, jobs)
        return
    with ProcessPoolExecutor(workers) as pool:
        yield from pool.map(_ad_chunk, jobs)


def read_truth(out: str | Path, read: Callable[[Any], Any]) -> Any:
    """read(the arrays of `out`/truth.npz), or None when there is no such file (no complete world: it is written
    last, and removed first when a world is written over); a file that is not one synthesize wrote is an
    InvalidInput naming it."""
    truth = Path(out) / "truth.npz"
    if not truth.is_file():
        return None
    with world_files(truth), np.load(truth, allow_pickle=False) as arrays:
        return read(arrays)


@contextmanager
def world_files(where: Path) -> Iterator[None]:
    """Reading what synthesize wrote at `where` (a world, or one of its files): content it does not write (a line
    that is not JSON, a request of another shape, a truth.npz of other arrays, empty or not an archive) is an
    InvalidInput naming `where`."""
    try:
        yield
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, EOFError,
            zipfile.BadZipFile) as exc:
        raise InvalidInput(f"not a world written by `andromeda synth` ({type(exc).__name__}: {exc})"[:300],
                           str(where)) from None


def world_config(out: str | Path) -> WorldConfig | None:
    """The config of the world written to `out`, or None when `out` holds no complete world."""
    return read_truth(out, lambda arrays: WorldConfig(**json.loads(str(arrays["config"]))))


def is_current(out: str | Path) -> bool:
    """Whether `out` holds a complete world drawn by this GENERATOR (older ones lack what the report reads)."""
    return bool(read_truth(out, lambda arrays: "generator" in arrays.files and int(arrays["generator"]) == GENERATOR))


def synthesize(cfg: WorldConfig, out: str | Path, schema: Schema | None = None, workers: int = 2,
               progress: bool = True) -> Path:
    """Write the world to `out`; returns the directory."""
    schema = schema or load_schema()
    if missing := [name for name in WORLD_CATEGORIES if name not in schema.by_name]:
        raise InvalidInput(f"the synthetic world draws the shipped schema's categories; this schema has no "
                           f"{', '.join(missing)}", "schema")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "truth.npz").unlink(missing_ok=True)  # until the new one is written, `out` holds no complete world
    world = World(schema, cfg)
    topics = np.empty(cfg.ads, np.int16)
    latents = np.empty((cfg.ads, cfg.latent_dim), np.float16)
    quality = np.empty(cfg.ads, np.float32)
    # each file written whole under a temporary name, renamed at the end: an interrupted run leaves no file cut short
    part = {name: out / f".{name}.tmp" for name in ("events.jsonl", "requests.jsonl", "engagements.jsonl", "truth.npz")}
    with open(part["events.jsonl"], "w", encoding="utf-8") as f, \
            tqdm(total=cfg.ads, unit="ad", desc="ads", disable=not progress) as bar:
        first = 0
        for text, t, lat, q in iter_ad_chunks(world, workers):
            f.write(text)
            topics[first:first + len(t)], latents[first:first + len(t)], quality[first:first + len(t)] = t, lat, q
            first += len(t)
            bar.update(len(t))
    rng = np.random.default_rng([cfg.seed, 2])
    by_topic = _AdsByTopic(topics, len(world.topics))
    user_latents = np.empty((cfg.users, cfg.clusters, cfg.latent_dim), np.float16)
    user_topics = np.empty((cfg.users, cfg.clusters), np.int16)
    with open(part["requests.jsonl"], "w", encoding="utf-8") as req_f, \
            open(part["engagements.jsonl"], "w", encoding="utf-8") as log_f:
        for u in tqdm(range(cfg.users), unit="user", desc="users", disable=not progress):
            request, user_topics[u], user_latents[u], log = _user(world, rng, u + 1, by_topic, latents, quality)
            req_f.write(json.dumps(request, separators=(",", ":")) + "\n")
            log_f.writelines(json.dumps(e, separators=(",", ":")) + "\n" for e in log)
    with open(part["truth.npz"], "wb") as f:
        np.savez(f, ad_latent=latents, ad_quality=quality, ad_topic=topics, user_latent=user_latents,
                 user_topic=user_topics, generator=GENERATOR, config=json.dumps(asdict(cfg)))
    for name, partial in part.items():  # truth.npz last: it says the world is complete
        os.replace(partial, out / name)
    return out
