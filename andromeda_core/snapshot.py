"""Index snapshots: the index state in one safetensors file, written atomically.

The header metadata carries the index layout, the caller's free-form metadata (e.g. the stream id
the snapshot covers) and a SHA-256 over the names, dtypes, shapes and bytes of every tensor and
over the metadata itself; any mismatch or parse failure on load raises SnapshotCorrupt.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from andromeda_core.errors import SnapshotCorrupt, out_of_memory
from andromeda_core.index import AdIndex
from andromeda_core.schema import Schema

UMASK = os.umask(0o022)  # the process's umask (read by setting it, then put back)
os.umask(UMASK)
FORMAT = "andromeda-index/2"  # 2: targeting as clause refs plus the clause dictionary. The statuses (pauses and
# resumes newer than an ad's content) came later as tensors of their own: code before them loads a snapshot
# with them as it always did (it ignores them: versions as the table holds them), and this code one without them


def _checksum(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.view(torch.uint8).numpy())
    return h.hexdigest()


def save_snapshot(index: AdIndex, path: str | Path, metadata: dict[str, Any] | None = None) -> Path:
    """Write `index` to `path` atomically (temp file, fsync, rename)."""
    return save_state(*index.export_state(), path, metadata)


def save_state(tensors: dict[str, torch.Tensor], layout: dict[str, str], path: str | Path,
               metadata: dict[str, Any] | None = None) -> Path:
    """Write an index's exported state (AdIndex.export_state) to `path` atomically and durably (temp file, fsync,
    rename, fsync of the folder)."""
    path = Path(path)
    meta = {**layout, "format": FORMAT, "user": json.dumps(metadata or {}, sort_keys=True)}
    meta["sha256"] = _checksum(tensors, meta)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # one per writer
    os.close(handle)
    tmp = Path(tmp)
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.chmod(tmp, 0o666 & ~UMASK)  # as open() would make it: mkstemp's 0600 would keep other readers out
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    sync_directory(path.parent)  # the rename itself durable before the stream is trimmed below it
    return path


def sync_directory(folder: Path) -> None:
    """fsync `folder`, so that a rename in it survives a power loss (the rename is the directory's data); a file
    system that cannot fsync a directory (some network ones) is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def header(path: str | Path) -> dict[str, str]:
    """The header metadata of a snapshot file (the layout, "format", "sha256", and "user": the caller's metadata as
    JSON), read without its tensors; raises what safetensors raises for a file it cannot read."""
    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


def load_snapshot(path: str | Path, schema: Schema, device: str | torch.device = "cpu") -> tuple[AdIndex, dict[str, Any]]:
    """Restore (index, caller metadata) from `path`, verifying its checksum."""
    try:
        meta = header(path)
        tensors = load_file(str(path))
    except Exception as exc:  # any failure to parse the file is corruption; out of memory: the file may be fine (until
        if out_of_memory(exc):  # 2026-12-07 reported as corrupt: every good snapshot passed over, a start failing on a gap)
            raise
        raise SnapshotCorrupt(f"cannot read snapshot {path}: {exc}") from None
    expected = meta.pop("sha256", None)
    if meta.get("format") != FORMAT:  # before the checksum: a file of another release is not a damaged one
        raise SnapshotCorrupt(f"snapshot {path} has format {meta.get('format')!r}; this code reads {FORMAT!r}")
    if expected != _checksum(tensors, meta):
        raise SnapshotCorrupt(f"snapshot {path} failed its checksum")
    try:
        index = AdIndex.from_state(schema, tensors, meta, device)
        user = json.loads(meta["user"])
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:  # a layout its checksum vouches for
        if out_of_memory(exc):  # but this code cannot take (never a half index); out of memory: the file may be fine
            raise
        raise SnapshotCorrupt(f"snapshot {path} does not fit this index: {type(exc).__name__}: {exc}") from None
    if not isinstance(user, dict):
        raise SnapshotCorrupt(f"snapshot {path}: its metadata is not an object")
    return index, user
