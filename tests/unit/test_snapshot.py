from __future__ import annotations

import logging
import os

import pytest
import torch

from andromeda_core.errors import SnapshotCorrupt
from andromeda_core.clauses import FREE
from andromeda_core.index import AdIndex, holds_an_ad
from andromeda_core import snapshot
from andromeda_core.schema import schema_from_dict
from andromeda_core.snapshot import load_snapshot, save_snapshot
from index_updater import snapshots as snapshots_module
from index_updater.snapshots import SnapshotStore
from tests.conftest import SMALL_SCHEMA, apply_events, upsert


@pytest.fixture
def populated(small_schema, scorer):
    index = AdIndex(small_schema, scorer.dim, capacity=2)
    apply_events(index, scorer, [upsert(i, targeting={"audiences": {"any_of": [i % 5]}}) for i in range(1, 12)])
    apply_events(index, scorer, [{"op": "delete", "ad_id": 3, "version": 2}, {"op": "pause", "ad_id": 4, "version": 2}])
    return index


def test_round_trip_restores_content_metadata_and_tombstones(tmp_path, populated, small_schema, scorer):
    path = save_snapshot(populated, tmp_path / "index.snap", {"stream_id": "1764460899123-0"})
    restored, meta = load_snapshot(path, small_schema)
    assert meta == {"stream_id": "1764460899123-0"}
    assert restored.digest() == populated.digest() and len(restored) == len(populated) == 10
    assert apply_events(restored, scorer, [upsert(3, 1)]) == [False]  # the delete is remembered
    assert apply_events(restored, scorer, [upsert(99)]) == [True]  # and the table still grows
    assert restored.get(4)["status"] == "paused"
    assert not list(tmp_path.glob(".*tmp*"))  # the temp file was renamed into place


def test_the_rename_is_made_durable_after_the_file(tmp_path, populated, monkeypatch):
    """The file is fsynced, renamed, then its folder fsynced (the rename is the folder's data): a power loss after a
    trim below the snapshot must not take the snapshot back."""
    synced, fsync = [], os.fsync
    monkeypatch.setattr(snapshot.os, "fsync", lambda fd: (synced.append((os.path.isdir(f"/proc/self/fd/{fd}"),
                                                                         (tmp_path / "index.snap").exists())), fsync(fd)))
    save_snapshot(populated, tmp_path / "index.snap")
    assert synced == [(False, False), (True, True)]


def test_a_snapshot_keeps_an_ads_content_version_under_its_newer_pause(tmp_path, small_schema, scorer):
    """Upsert 1, pause 3, snapshot: an edit at version 2 arriving after the restore still brings its content,
    paused, as without the snapshot (the table's version column holds 3, the pause's)."""
    index = AdIndex(small_schema, scorer.dim, capacity=2)
    apply_events(index, scorer, [upsert(1, 1, {"audiences": {"any_of": [1]}}), {"op": "pause", "ad_id": 1, "version": 3}])
    restored = load_snapshot(save_snapshot(index, tmp_path / "s.snap"), small_schema)[0]
    for table in (index, restored):
        assert apply_events(table, scorer, [upsert(1, 2, {"audiences": {"any_of": [2]}})]) == [True]
        assert table.get(1)["status"] == "paused" and table.get(1)["version"] == 3
    assert restored.digest() == index.digest()


def test_a_snapshot_written_before_statuses_still_loads(tmp_path, populated, small_schema, scorer):
    """Snapshots written before pauses and resumes were versioned apart from the content hold no statuses: their ads
    load with the version the table holds, the pause of ad 4 (version 2) then its content's version. (Code of
    that time loads today's snapshots alike: it ignores the statuses.)"""
    tensors, layout = populated.export_state()
    path = snapshot.save_state({k: v for k, v in tensors.items() if not k.startswith("statuses.")}, layout,
                               tmp_path / "old.snap")
    restored = load_snapshot(path, small_schema)[0]
    assert restored.digest() == populated.digest() and restored.get(4)["status"] == "paused"
    assert apply_events(restored, scorer, [upsert(4, 2)]) == [False]


def test_writers_of_one_snapshot_in_one_process_do_not_collide(tmp_path, populated, small_schema):
    # replicas of a shard that share a directory, or pods whose pid namespaces give them the same pid
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: save_snapshot(populated, tmp_path / "index.snap"), range(12)))
    assert load_snapshot(tmp_path / "index.snap", small_schema)[0].digest() == populated.digest()
    assert [p.name for p in tmp_path.iterdir()] == ["index.snap"]  # no temp file left behind
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "index.snap").stat().st_mode & 0o777 == 0o666 & ~umask  # readable as any new file is


@pytest.mark.parametrize("storage,exact_copy", [(torch.int8, True), (torch.int8, False), (torch.float16, True)])
def test_round_trip_keeps_the_storage_format_and_exact_copy(tmp_path, small_schema, scorer, storage, exact_copy):
    index = AdIndex(small_schema, scorer.dim, embedding_dtype=storage, exact_copy=exact_copy)
    apply_events(index, scorer, [upsert(i) for i in range(1, 6)])
    restored, _ = load_snapshot(save_snapshot(index, tmp_path / "index.snap"), small_schema)
    assert restored.columns["embedding"].dtype == storage and restored.keeps_exact == exact_copy
    assert restored.digest() == index.digest()
    ids = [1, 5, 404]
    assert all(torch.equal(a, b) for a, b in zip(restored.embeddings_of(ids), index.embeddings_of(ids)))


def test_corrupted_byte_is_detected(tmp_path, populated, small_schema):
    path = save_snapshot(populated, tmp_path / "index.snap")
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01  # a bit flip inside the tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="checksum"):
        load_snapshot(path, small_schema)


def test_truncated_file_is_detected(tmp_path, populated, small_schema):
    path = save_snapshot(populated, tmp_path / "index.snap")
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SnapshotCorrupt):
        load_snapshot(path, small_schema)


@pytest.mark.parametrize("failure", [MemoryError(), RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                                                                  "can't allocate memory: you tried to allocate 1 bytes")])
def test_memory_running_out_while_a_snapshot_is_read_is_no_corruption(tmp_path, populated, small_schema, monkeypatch,
                                                                      failure):
    """Raised as it is, so that the load is tried again later (until 2026-12-07 reported as corrupt: a store passed
    over every good snapshot, and a start then failed on a stream gap)."""
    path = save_snapshot(populated, tmp_path / "index.snap")
    monkeypatch.setattr(snapshot, "load_file", lambda *args: (_ for _ in ()).throw(failure))
    with pytest.raises(type(failure)):
        load_snapshot(path, small_schema)
    monkeypatch.undo()
    assert load_snapshot(path, small_schema)[0].digest() == populated.digest()


def test_snapshot_of_another_schema_is_refused(tmp_path, populated):
    path = save_snapshot(populated, tmp_path / "index.snap")
    other = schema_from_dict({**SMALL_SCHEMA, "version": 2})
    with pytest.raises(SnapshotCorrupt, match="schema"):
        load_snapshot(path, other)


def test_snapshot_of_another_content_under_the_same_schema_version_is_refused(tmp_path, populated):
    """A vocabulary reordered without a new version: the index's bits would mean other values."""
    path = save_snapshot(populated, tmp_path / "index.snap")
    reordered = [{**c, "vocabulary": ["CA", "US", "GB", "DE", "FR"]} if c["name"] == "country" else c
                 for c in SMALL_SCHEMA["categories"]]
    with pytest.raises(SnapshotCorrupt, match="another content of schema small-test v1"):
        load_snapshot(path, schema_from_dict({**SMALL_SCHEMA, "categories": reordered}))


@pytest.mark.parametrize("change", [{"embedding_dtype": "bogus"}, {"embedding_dtype": "__name__"},
                                    {"high_water": "999999"}, {"dim": "7"}, {"capacity": "-1"}, {"refs_width": "x"}])
def test_a_layout_that_does_not_fit_is_corrupt_not_a_crash(tmp_path, populated, small_schema, change):
    """Header fields its checksum vouches for (a writer's bug, a crafted file) that this code cannot load: SnapshotCorrupt,
    which a replica passes over for an older snapshot, never another exception that stops its start."""
    tensors, layout = populated.export_state()
    path = snapshot.save_state(tensors, {**layout, **change}, tmp_path / "bad.snap")
    with pytest.raises(SnapshotCorrupt, match="does not fit this index"):
        load_snapshot(path, small_schema)


def test_caller_metadata_that_is_not_an_object_is_corrupt(tmp_path, populated, small_schema):
    path = snapshot.save_state(*populated.export_state(), tmp_path / "list.snap", [1])
    with pytest.raises(SnapshotCorrupt, match="not an object"):
        load_snapshot(path, small_schema)


def test_a_store_says_which_snapshot_it_passes_over_and_why(tmp_path, populated, small_schema, caplog):
    """A schema changed under its version makes a replica pass over every snapshot: each is logged with the reason,
    not skipped in silence."""
    store = SnapshotStore(tmp_path)
    store.write(populated, "5-0")
    reordered = [{**c, "vocabulary": ["CA", "US", "GB", "DE", "FR"]} if c["name"] == "country" else c
                 for c in SMALL_SCHEMA["categories"]]
    with caplog.at_level(logging.ERROR, logger="index_updater.snapshots"):
        assert list(store.valid(schema_from_dict({**SMALL_SCHEMA, "categories": reordered}))) == []
    assert "another content of schema small-test v1" in caplog.text and "passing over it" in caplog.text


@pytest.mark.parametrize("fmt", ["andromeda-index/1", "andromeda-index/3"])
def test_a_snapshot_of_another_format_says_so_not_that_its_checksum_failed(tmp_path, populated, small_schema, fmt):
    """An upgrade from an older release, or a rollback from a newer one: the log must point at the format, not at the
    disk."""
    tensors, layout = populated.export_state()
    path = snapshot.save_state(tensors, layout, tmp_path / "other.snap")
    meta = snapshot.header(path)
    meta.pop("sha256")
    meta["format"] = fmt
    meta["sha256"] = snapshot._checksum(tensors, meta)  # as that release writes it: its checksum holds
    snapshot.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(SnapshotCorrupt, match=f"has format '{fmt}'; this code reads 'andromeda-index/2'"):
        load_snapshot(path, small_schema)


@pytest.mark.parametrize("stream_id", [None, "abc", 7, "5", "5-0\n", f"{2**64}-0"])
def test_a_snapshot_that_names_no_stream_id_is_passed_over_before_it_is_loaded(tmp_path, populated, small_schema,
                                                                               stream_id, caplog, monkeypatch):
    """Its header passes the checksum, but a replica cannot continue from it (Redis refuses "5-0\\n" and ids past
    2**64 - 1 too): an older snapshot is taken instead, from its header alone, and nothing (the position a replica
    reports before loading) reads the bad id."""
    store = SnapshotStore(tmp_path)
    store.write(populated, "5-0")
    tensors, layout = populated.export_state()
    snapshot.save_state(tensors, layout, tmp_path / "snapshot-000000000000009-0000000000.safetensors",
                        {} if stream_id is None else {"stream_id": stream_id})
    held, loaded = [], []
    monkeypatch.setattr(snapshots_module, "load_snapshot", lambda path, *args: (loaded.append(path.name),
                                                                                  load_snapshot(path, *args))[1])
    with caplog.at_level(logging.ERROR, logger="index_updater.snapshots"):
        found = [meta["stream_id"] for _, meta in store.valid(small_schema, before_load=held.append)]
    assert found == ["5-0"] and [m["stream_id"] for m in held] == ["5-0"]
    assert loaded == ["snapshot-000000000000005-0000000000.safetensors"]
    assert "snapshot-000000000000009-0000000000.safetensors names no stream id" in caplog.text
    # After the stream went back, the replica sets aside the snapshots it went back from: the one naming no stream id
    # is left alone there too (until 2026-12-07 it failed every try: the reset never settled, nothing was trimmed)
    assert store.set_aside(lambda meta: meta["stream_id"] == "5-0") == ["snapshot-000000000000005-0000000000.safetensors"]
    assert [p.name for p in store.paths()] == ["snapshot-000000000000009-0000000000.safetensors"]


def test_the_folder_is_listed_again_after_each_snapshot(tmp_path, populated, small_schema, caplog):
    """While a start loads its newest snapshot (minutes, for a large table) the running replicas write newer ones and
    prune the older: if that one fails, the next tried is the newest there now, and one pruned meanwhile is not
    reported as damaged."""
    store = SnapshotStore(tmp_path, keep=2)
    first, second = store.write(populated, "5-0"), store.write(populated, "6-0")
    data = bytearray(second.read_bytes())
    data[-1] ^= 0xFF  # bit rot in its tensors: its header reads, its checksum fails
    second.write_bytes(bytes(data))

    def meanwhile(meta):
        if meta["stream_id"] == "6-0":  # while it loads, a replica writes two rounds, pruning 5-0
            store.write(populated, "7-0")
            store.write(populated, "8-0")
    with caplog.at_level(logging.INFO, logger="index_updater.snapshots"):
        found = [meta["stream_id"] for _, meta in store.valid(small_schema, before_load=meanwhile)]
    assert not first.exists() and found == ["8-0", "7-0"]


def test_temp_files_of_writes_that_never_finished_are_removed_once_untouched_an_hour(tmp_path, populated):
    """A replica killed or stopped mid-write leaves its temp file (a table's size); a live writer's is kept."""
    abandoned = tmp_path / ".snapshot-000000000000005-0000000000.safetensors.abc123.tmp"
    live = tmp_path / ".snapshot-000000000000006-0000000000.safetensors.def456.tmp"
    other = tmp_path / ".notes.tmp"
    for path in (abandoned, live, other):
        path.write_bytes(b"partial")
    hours_ago = os.path.getmtime(live) - 2 * 3600
    os.utime(abandoned, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    store = SnapshotStore(tmp_path)  # at start
    assert not abandoned.exists() and live.exists() and other.exists()
    os.utime(live, (hours_ago, hours_ago))
    store.write(populated, "7-0")  # and after each write
    assert not live.exists() and other.exists()


def test_the_temp_file_sweep_never_fails_a_start_or_a_written_snapshot(tmp_path, populated, monkeypatch):
    """Best effort: a temp file it cannot remove, or a folder it cannot list, is logged; the start goes on, and the
    snapshot written before the sweep stands (it was reported failed: its round given back, nothing trimmed)."""
    temp = tmp_path / ".snapshot-000000000000005-0000000000.safetensors.abc.tmp"
    temp.write_bytes(b"partial")
    os.utime(temp, (0, 0))

    def refused(self, *args, **kwargs):
        raise OSError(30, "Read-only file system")
    monkeypatch.setattr(snapshots_module.Path, "unlink", refused)
    store = SnapshotStore(tmp_path)  # at start
    assert store.write(populated, "6-0").exists() and temp.exists()  # after a write
    monkeypatch.setattr(snapshots_module.Path, "iterdir", refused)
    assert store.remove_abandoned() == []


def test_a_live_row_referring_to_a_free_clause_is_refused_on_export_and_on_load(populated, small_schema):
    """A snapshot exports only the clauses its live rows reach; a live row whose clause the dictionary does not hold
    (a broken reference count) is refused, not written or loaded as a table that matches nothing there."""
    tensors, layout = populated.export_state(copy=True)
    live = holds_an_ad(tensors["col.status"])
    clause = int(tensors["col.refs"][live][0, 0]) >> 1
    category = tensors["clauses.category"].clone()
    category[clause] = FREE
    with pytest.raises(ValueError, match=f"refers to clause {clause}, which the dictionary does not hold"):
        AdIndex.from_state(small_schema, {**tensors, "clauses.category": category}, layout)
    populated.clauses._keys[clause] = None  # as a leaked release would leave it
    with pytest.raises(ValueError, match="refers to a free clause id"):
        populated.export_state()
