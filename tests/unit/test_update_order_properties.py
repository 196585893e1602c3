"""Property tests: the index's state does not depend on the order its ops arrive in. Two writers racing (an
editor and a budget pacer) publish an ad's ops in any order; every replica must end where the ops' versions
say, as if they had arrived in version order."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from andromeda_core.index import AdIndex
from andromeda_core.snapshot import load_snapshot, save_snapshot
from tests.conftest import apply_events, upsert

ADS = (1, 2, 3)


@st.composite
def ad_ops(draw) -> list[dict]:
    """Ops on ADS, each ad's content ops (upserts, deletes) with distinct versions (two at one version conflict by
    definition); its pauses and resumes at any version, one of them's or another's (ties have a rule)."""
    ops = []
    for ad in ADS:
        count = draw(st.integers(0, 5))
        versions = draw(st.lists(st.integers(1, 9), min_size=count, max_size=count, unique=True))
        kinds = [draw(st.sampled_from(["upsert", "upsert", "pause", "resume", "delete"])) for _ in versions]
        for version in draw(st.lists(st.sampled_from(versions), max_size=3)) if versions else ():
            kinds.append(draw(st.sampled_from(["pause", "resume"])))  # a tie with an op of the same version
            versions.append(version)
        for version, kind in zip(versions, kinds):
            if kind == "upsert":
                ops.append(upsert(ad, version, {"country": {"any_of": [draw(st.sampled_from(["US", "CA"]))]}},
                                  status=draw(st.sampled_from(["active", "paused"]))))
            else:
                ops.append({"op": kind, "ad_id": ad, "version": version})
    return ops


def version_of(op: dict) -> int:
    return op["ad"]["version"] if op["op"] == "upsert" else op["version"]


def state(index: AdIndex) -> dict:
    """What a reader sees of every ad, and the version the index remembers for it; the tombstones the index keeps
    as batches apply are those of its versions (every ad deleted or expired, whatever the order)."""
    book = index._book
    assert book.tombstones() == {ad: v for ad, v in book.version.items() if ad not in book.slot_of}
    ads = {ad: {k: v for k, v in index.get(ad).items() if k != "slot"} if ad in index else None for ad in ADS}
    return {"ads": ads, "versions": {ad: index.version_of(ad) for ad in ADS}, "digest": index.digest()}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ad_ops(), order=st.randoms(use_true_random=False), cuts=st.lists(st.integers(1, 4), max_size=8))
def test_any_arrival_order_ends_where_the_versions_say(small_schema, scorer, tmp_path_factory, ops, order, cuts):
    """The ops applied one at a time in version order, and shuffled in batches of random sizes, with a snapshot
    taken and restored midway: the same ads, statuses, versions and digest."""
    in_order = AdIndex(small_schema, scorer.dim, capacity=4)
    for op in sorted(ops, key=version_of):
        apply_events(in_order, scorer, [op])
    shuffled = list(ops)
    order.shuffle(shuffled)
    index, at = AdIndex(small_schema, scorer.dim, capacity=4), 0
    for size in [*cuts, len(shuffled)]:
        apply_events(index, scorer, shuffled[at:at + size])
        at += size
        if at >= len(shuffled) // 2 and at - size < len(shuffled) // 2:  # once, midway: the statuses must survive
            path = save_snapshot(index, tmp_path_factory.mktemp("snap") / "s.safetensors")
            index = load_snapshot(path, small_schema)[0]
    assert state(index) == state(in_order)
