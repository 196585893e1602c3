"""A directory of index snapshots named by the stream id they cover; the newest valid one wins.

Use one directory per shard: the ids are those of the shard's own stream, and a consumer that trims
its stream does so up to the oldest snapshot in its directory."""
from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from andromeda_core.errors import SnapshotCorrupt
from andromeda_core.index import AdIndex
from andromeda_core.schema import Schema
from andromeda_core.snapshot import header, load_snapshot, save_state

log = logging.getLogger(__name__)
NAME = re.compile(r"^snapshot-(\d{15})-(\d{10})\.safetensors$")
TEMP = re.compile(r"^\.snapshot-\d{15}-\d{10}\.safetensors\..+\.tmp$")  # save_state's, while it writes
TEMP_ABANDONED_S = 3600.0  # a temp file untouched this long has no writer (one killed, or stopped, mid-write)
STREAM_ID = re.compile(r"(\d{1,20})-(\d{1,20})")  # fullmatch; each part below 2**64 too (Redis refuses the rest)
KEEP = 3  # snapshots a store keeps (it writes the next before it prunes: KEEP + 1 for a while)


def stream_id_key(stream_id: str) -> tuple[int, int]:
    ms, _, seq = stream_id.partition("-")
    return int(ms), int(seq or 0)


def covers_stream_id(path: Path, meta: Any) -> bool:
    """Whether a snapshot's caller metadata names the stream id it covers (logged where not: a file no release of
    this code writes, passed over rather than failing the start)."""
    stream_id = meta.get("stream_id") if isinstance(meta, dict) else None
    if isinstance(stream_id, str) and (parts := STREAM_ID.fullmatch(stream_id)) and \
            all(int(part) < 1 << 64 for part in parts.groups()):
        return True
    log.error("snapshot %s names no stream id it covers (%r); passing over it for an older snapshot", path.name,
              stream_id)
    return False


class SnapshotStore:
    def __init__(self, directory: str | Path, keep: int = KEEP):
        self.directory, self.keep = Path(directory), max(1, keep)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.remove_abandoned()

    def remove_abandoned(self) -> list[str]:
        """Remove the temp files of writes that ended without their rename (a replica killed, or stopped, mid-write:
        each a table's size, until 2026-12-07 kept for good) once untouched for TEMP_ABANDONED_S: a live writer's, of
        this replica or another sharing the folder, grows as it writes. At start and after each write; their names."""
        removed, now = [], time.time()
        try:
            for path in self.directory.iterdir():
                try:
                    if TEMP.match(path.name) and now - path.stat().st_mtime > TEMP_ABANDONED_S:
                        path.unlink()
                        removed.append(path.name)
                except FileNotFoundError:  # another replica removed it first
                    continue
        except OSError as exc:  # best effort (a read-only folder, say): neither a start nor a written snapshot fails
            log.warning("could not remove the temp files of unfinished snapshot writes in %s: %s", self.directory, exc)
        if removed:
            log.warning("removed the temp files of snapshot writes that never finished: %s", removed)
        return removed

    def paths(self) -> list[Path]:
        """Snapshot files, newest stream id first."""
        return sorted((p for p in self.directory.iterdir() if NAME.match(p.name)), key=lambda p: p.name, reverse=True)

    def write(self, index: AdIndex, stream_id: str, metadata: dict | None = None) -> Path:
        return self.write_state(index.export_state(), stream_id, metadata)

    def write_state(self, state: tuple[dict[str, torch.Tensor], dict[str, str]], stream_id: str,
                    metadata: dict | None = None, foreign: Callable[[dict], dict] = lambda meta: {}) -> Path:
        """Write an index's exported state (AdIndex.export_state) covering `stream_id`; keep the newest `keep` of the
        writer's own (foreign: as in valid; another's, say of another model sharing the folder by mistake, neither
        counts nor is deleted: counted, they pruned the writer's own as soon as it was written)."""
        ms, seq = stream_id_key(stream_id)
        path = save_state(*state, self.directory / f"snapshot-{ms:015d}-{seq:010d}.safetensors",
                          {**(metadata or {}), "stream_id": stream_id})
        for old in self.own(foreign)[self.keep:]:
            old.unlink(missing_ok=True)
        self.remove_abandoned()
        return path

    def own(self, foreign: Callable[[dict], dict]) -> list[Path]:
        """paths() of the snapshots whose header `foreign` finds nothing in (one whose header cannot be read counts:
        valid() reports it corrupt)."""
        def mine(path: Path) -> bool:
            try:
                return not foreign(json.loads(header(path)["user"]))
            except Exception:
                return True
        return [path for path in self.paths() if mine(path)]

    def valid(self, schema: Schema, device: str | torch.device = "cpu",
              foreign: Callable[[dict], dict] = lambda meta: {},
              before_load: Callable[[dict], None] = lambda meta: None) -> Iterator[tuple[AdIndex, dict]]:
        """(index, metadata) of each snapshot that passes its checksum (corrupt ones are skipped), newest first,
        each loaded only when asked for. foreign: what in a snapshot's caller metadata differs from what the caller
        wants; one it finds anything in is skipped, logged, from its header alone (never loaded). before_load: called
        with a snapshot's caller metadata just before it is loaded. The folder is listed again before each snapshot:
        while one loads (minutes, for a large table), the running replicas write newer ones and prune the older ones
        (until 2026-12-07 one listing was kept, and a start whose newest snapshot failed found the rest pruned)."""
        tried: set[Path] = set()
        while path := next((p for p in self.paths() if p not in tried), None):
            tried.add(path)
            try:
                meta = json.loads(header(path)["user"])
                differs = foreign(meta)
            except Exception:  # an unreadable header: load_snapshot below reports the file as corrupt
                meta, differs = None, {}
            if differs:
                log.error("snapshot %s has %s; skipping it", path.name, differs)
                continue
            if meta is not None:
                if not covers_stream_id(path, meta):  # from its header alone
                    continue
                before_load(meta)
            try:
                restored, meta = load_snapshot(path, schema, device)
            except SnapshotCorrupt as exc:  # logged: a schema changed under its version passes over every one
                if path.exists():
                    log.error("%s; passing over it for an older snapshot", exc)
                else:
                    log.info("snapshot %s was pruned while it loaded; taking the next", path.name)
                continue
            if covers_stream_id(path, meta):
                yield restored, meta

    def set_aside(self, stale: Callable[[dict], bool]) -> list[str]:
        """Rename each snapshot whose caller metadata (with its stream_id) is `stale` to stale-<name>: kept for
        inspection, no longer found. Returns their names; one whose header cannot be read, or that names no stream id,
        is left alone (valid() passes over both; until 2026-12-07 one naming none failed every call)."""
        names = []
        for path in self.paths():
            try:
                meta = json.loads(header(path)["user"])
            except Exception:  # corrupt: valid() skips it anyway
                continue
            if covers_stream_id(path, meta) and stale(meta) and self.set_aside_file(path):
                names.append(path.name)
        return names

    @staticmethod
    def set_aside_file(path: Path) -> bool:
        """Rename one snapshot to stale-<name> (kept for inspection, no longer found); False when it is gone
        already (another replica of the shard set it aside first)."""
        try:
            path.rename(path.with_name(f"stale-{path.name}"))
        except FileNotFoundError:
            return False
        return True

    def oldest_stream_id(self, foreign: Callable[[dict], dict] = lambda meta: {}) -> str | None:
        """Stream id covered by the oldest kept snapshot of the caller's own (foreign: as in valid): the stream may be
        trimmed up to it."""
        paths = self.own(foreign)
        if not paths:
            return None
        ms, seq = NAME.match(paths[-1].name).groups()
        return f"{int(ms)}-{int(seq)}"
