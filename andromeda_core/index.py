"""AdIndex: the device-resident, slot-addressed, structure-of-arrays ad table of one replica.

Columns (N = capacity slots): ad_id, version, advertiser_id (N,) int64; status (N,) int8 bits
(kernels.reference.match.LIVE | ACTIVE | SATISFIABLE); start, end (N,) int64 seconds (start <= now < end);
bid (N,) float32; embedding (N, D) in the scan's storage format (fp32, fp16 or int8 + per-block
embedding_scale); when that format is not fp32 and the index keeps an exact copy, embedding_exact
(N, D) float32, read only for the few rows a request rescores and for user-history lookups; the
targeting columns of andromeda_core.targeting.

Every operation is idempotent by (ad_id, version): an event whose version is not newer than the
indexed one (or than the version that deleted or expired the ad) is a no-op. A batch of
operations is applied under the table lock, so a scan sees all of a batch or none of it.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence, Union

import numpy as np
import torch

from andromeda_core.errors import NotFound
from andromeda_core.quantization import dequantize, int8_blocks, quantize_int8
from andromeda_core.schema import Schema
from andromeda_core.targeting import ColumnSpec, CompiledTargeting, MatchInputs, targeting_columns
from andromeda_core.types import Ad, DeleteEvent, StatusEvent
from kernels.reference.match import ACTIVE, LIVE, SATISFIABLE, targeting_match

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class PreparedAd:
    """An upsert ready for the table: the validated ad, its compiled targeting, its ad-tower embedding (D,)."""

    ad: Ad
    targeting: CompiledTargeting
    embedding: np.ndarray


IndexOp = Union[PreparedAd, DeleteEvent, StatusEvent]


def core_columns(dim: int, embedding_dtype: torch.dtype, exact_copy: bool) -> dict[str, ColumnSpec]:
    extra = {"embedding_scale": ColumnSpec((int8_blocks(dim),), torch.float32, 0)} if embedding_dtype == torch.int8 else {}
    if exact_copy and embedding_dtype != torch.float32:
        extra["embedding_exact"] = ColumnSpec((dim,), torch.float32, 0)
    return {**extra,
        "ad_id": ColumnSpec((), torch.int64, -1),
        "version": ColumnSpec((), torch.int64, -1),
        "advertiser_id": ColumnSpec((), torch.int64, -1),
        "status": ColumnSpec((), torch.int8, 0),
        "start": ColumnSpec((), torch.int64, INT64_MIN),
        "end": ColumnSpec((), torch.int64, INT64_MAX),
        "bid": ColumnSpec((), torch.float32, 0),
        "embedding": ColumnSpec((dim,), embedding_dtype, 0),
    }


class AdIndex:
    def __init__(self, schema: Schema, dim: int, capacity: int = 1024, device: str | torch.device = "cpu",
                 embedding_dtype: torch.dtype = torch.float32, exact_copy: bool = True):
        if dim < 1 or capacity < 1:
            raise ValueError("dim and capacity must be positive")
        self.schema, self.dim, self.device = schema, dim, torch.device(device)
        self.specs = {**core_columns(dim, embedding_dtype, exact_copy), **targeting_columns(schema)}
        self.columns = {name: self._filled(spec, capacity) for name, spec in self.specs.items()}
        self._slot_of: dict[int, int] = {}
        self._tombstones: dict[int, int] = {}  # ad_id -> version that deleted or expired it
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # popped from the end: lowest slot first
        self.high_water = 0  # slots >= high_water have never held an ad; scans stop there
        self._lock = threading.Lock()
        self._bitset_names = [c.name for c in schema.bitset_categories]
        self._list_names = [c.name for c in schema.list_categories]

    def _filled(self, spec: ColumnSpec, n: int) -> torch.Tensor:
        return torch.full((n, *spec.shape), spec.fill, dtype=spec.dtype, device=self.device)

    # -- reading ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.columns["ad_id"].shape[0]

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, ad_id: int) -> bool:
        return ad_id in self._slot_of

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the table still (no batch is applied) for the duration of a scan."""
        with self._lock:
            yield

    def match(self, inputs: MatchInputs, start: int, stop: int) -> torch.Tensor:
        """Eligibility (B, stop - start) bool of slots [start, stop). Call inside `reading()`."""
        c = self.columns
        return targeting_match(
            c["status"][start:stop], c["start"][start:stop], c["end"][start:stop], inputs.now,
            [(c[f"{n}.pos"][start:stop], c[f"{n}.neg"][start:stop]) for n in self._bitset_names], inputs.user_bits,
            [(c[f"{n}.pos"][start:stop], c[f"{n}.neg"][start:stop]) for n in self._list_names], inputs.user_tables,
        )

    def eligible(self, inputs: MatchInputs, chunk_size: int = 65536) -> list[list[int]]:
        """Ad ids eligible for each of the B requests, ascending."""
        out: list[list[int]] = [[] for _ in range(inputs.now.shape[0])]
        with self.reading():
            for start in range(0, self.high_water, chunk_size):
                stop = min(start + chunk_size, self.high_water)
                ok = self.match(inputs, start, stop)
                ids = self.columns["ad_id"][start:stop]
                for b in range(ok.shape[0]):
                    out[b].extend(ids[ok[b]].tolist())
        return [sorted(ids) for ids in out]

    def ad_ids(self) -> list[int]:
        """Ids of the live ads."""
        return list(self._slot_of)

    def slot_of(self, ad_id: int) -> int | None:
        return self._slot_of.get(ad_id)

    @property
    def keeps_exact(self) -> bool:
        """Whether the scan's format is lossy and an exact float32 copy is kept for rescoring."""
        return "embedding_exact" in self.columns

    def _vectors(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Stored embeddings of `rows` as float32, dequantised when stored as int8."""
        scale = self.columns["embedding_scale"][rows] if "embedding_scale" in self.columns else None
        return dequantize(self.columns["embedding"][rows], scale)

    def embeddings(self, start: int, stop: int) -> torch.Tensor:
        """(stop - start, D) float32 embeddings of slots [start, stop) as the scan reads them."""
        return self._vectors(slice(start, stop))

    def exact_embeddings(self, ad_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ad_ids (...) int64 -> (full-precision float32 embeddings (..., D), zeros where not indexed;
        found (...) bool). Rescoring reads these inside `reading()`."""
        slots = torch.tensor([self._slot_of.get(a, -1) for a in ad_ids.flatten().tolist()], dtype=torch.int64,
                             device=self.device).reshape(ad_ids.shape)
        found = slots >= 0
        rows = slots.clamp(min=0)
        vectors = self.columns["embedding_exact"][rows] if self.keeps_exact else self._vectors(rows.flatten()).reshape(
            *rows.shape, self.dim)
        return vectors * found[..., None], found

    def embeddings_of(self, ad_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, D) float32 embeddings of `ad_ids` for user towers (zeros where not indexed; full precision
        unless a lossy index keeps no exact copy) and found (n,) bool."""
        vectors, found = self.exact_embeddings(torch.tensor(list(ad_ids), dtype=torch.int64))
        return vectors.cpu(), found.cpu()

    def get(self, ad_id: int) -> dict:
        """The indexed state of one ad."""
        slot = self._slot_of.get(ad_id)
        if slot is None:
            raise NotFound(f"ad {ad_id} is not in the index", "ad_id")
        with self._lock:
            c = {name: col[slot] for name, col in self.columns.items() if col.dim() == 1}
            status = int(c["status"])
            return {
                "ad_id": ad_id, "version": int(c["version"]), "advertiser_id": int(c["advertiser_id"]),
                "status": "active" if status & ACTIVE else "paused", "satisfiable": bool(status & SATISFIABLE),
                "start_time": None if int(c["start"]) == INT64_MIN else int(c["start"]),
                "end_time": None if int(c["end"]) == INT64_MAX else int(c["end"]),
                "bid": float(c["bid"]), "slot": slot,
            }

    def version_of(self, ad_id: int) -> int | None:
        """Newest version applied for `ad_id` (live, deleted or expired), or None if never seen."""
        slot = self._slot_of.get(ad_id)
        return int(self.columns["version"][slot]) if slot is not None else self._tombstones.get(ad_id)

    def digest(self) -> str:
        """Order-independent hash of the live content (every column of every live slot)."""
        with self._lock:
            live = (self.columns["status"][: self.high_water].to(torch.int32) & LIVE) != 0
            total = torch.zeros((), dtype=torch.int64)
            for i, name in enumerate(sorted(self.columns)):
                col = self.columns[name][: self.high_water][live].cpu()
                ints = col.view(torch.int32) if col.dtype == torch.float32 else (
                    col.view(torch.int16) if col.dtype in (torch.float16, torch.bfloat16) else col)
                ints = ints.to(torch.int64).reshape(ints.shape[0], -1)
                weights = torch.arange(1, ints.shape[1] + 1, dtype=torch.int64) * (2 * i + 1)
                row = (ints * weights).sum(1) + (i + 1) * 0x9E3779B1
                row = (row ^ (row >> 31)) * 0x2545F4914F6CDD1D
                total += row.sum()
            return f"{int(live.sum())}-{int(total) & (2**64 - 1):016x}"

    # -- state (for snapshots) -------------------------------------------------------------------

    def export_state(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(CPU tensors, layout metadata) that `from_state` restores; consistent under the lock."""
        with self._lock:
            n = self.high_water
            tensors = {f"col.{name}": col[:n].cpu().contiguous() for name, col in self.columns.items()}
            tensors["tombstones.ad_id"] = torch.tensor(list(self._tombstones), dtype=torch.int64)
            tensors["tombstones.version"] = torch.tensor(list(self._tombstones.values()), dtype=torch.int64)
            layout = {"schema_name": self.schema.name, "schema_version": str(self.schema.version),
                      "dim": str(self.dim), "capacity": str(self.capacity), "high_water": str(n),
                      "embedding_dtype": str(self.specs["embedding"].dtype).removeprefix("torch."),
                      "exact_copy": str(self.keeps_exact)}
            return tensors, layout

    @classmethod
    def from_state(cls, schema: Schema, tensors: dict[str, torch.Tensor], layout: dict[str, str],
                   device: str | torch.device = "cpu") -> "AdIndex":
        if layout["schema_name"] != schema.name or layout["schema_version"] != str(schema.version):
            raise ValueError(f"state was written for schema {layout['schema_name']} v{layout['schema_version']}, "
                             f"not {schema.name} v{schema.version}")
        index = cls(schema, int(layout["dim"]), capacity=int(layout["capacity"]), device=device,
                    embedding_dtype=getattr(torch, layout["embedding_dtype"]),
                    exact_copy=layout.get("exact_copy") == "True")
        n = index.high_water = int(layout["high_water"])
        for name, col in index.columns.items():
            col[:n] = tensors[f"col.{name}"].to(device)
        live = torch.nonzero((index.columns["status"][:n].to(torch.int32) & LIVE) != 0).flatten().tolist()
        index._slot_of = dict(zip(index.columns["ad_id"][live].tolist(), live))
        used = set(live)
        index._free = [s for s in range(index.capacity - 1, -1, -1) if s not in used]
        index._tombstones = dict(zip(tensors["tombstones.ad_id"].tolist(), tensors["tombstones.version"].tolist()))
        return index

    def adopt(self, other: "AdIndex") -> None:
        """Take over `other`'s content (e.g. a restored snapshot) in one step that scans see whole."""
        if other.schema != self.schema or other.dim != self.dim:
            raise ValueError("can only adopt an index with the same schema and embedding width")
        with self._lock:
            self.specs, self.columns = other.specs, other.columns
            self._slot_of, self._tombstones, self._free = other._slot_of, other._tombstones, other._free
            self.high_water = other.high_water

    # -- writing ---------------------------------------------------------------------------------

    def apply(self, ops: Sequence[IndexOp]) -> list[bool]:
        """Apply a batch atomically; returns, per op, whether it changed the index (False = stale no-op)."""
        with self._lock:
            batch = _Batch()
            applied = [self._plan(op, batch) for op in ops]
            self._write(batch)
            self._free.extend(reversed(batch.freed))
            return applied

    def sweep_expired(self, now: int) -> int:
        """Free the slots of ads whose end_time <= now (they already stopped matching). Returns how many."""
        with self._lock:
            end = self.columns["end"][: self.high_water]
            live = (self.columns["status"][: self.high_water].to(torch.int32) & LIVE) != 0
            slots = torch.nonzero(live & (end <= now)).flatten().tolist()
            batch = _Batch()
            for slot in slots:
                ad_id = int(self.columns["ad_id"][slot])
                self._release(ad_id, slot, int(self.columns["version"][slot]), batch)
            self._write(batch)
            self._free.extend(reversed(batch.freed))
            return len(slots)

    def _current(self, ad_id: int, batch: "_Batch") -> tuple[int | None, int]:
        """(slot or None, newest version or -1) as of the ops planned so far in `batch`."""
        slot = self._slot_of.get(ad_id)
        if slot is None:
            return None, self._tombstones.get(ad_id, -1)
        if slot in batch.status:
            return slot, batch.status[slot][1]
        return slot, int(self.columns["version"][slot])

    def _plan(self, op: IndexOp, batch: "_Batch") -> bool:
        ad_id = op.ad.ad_id if isinstance(op, PreparedAd) else op.ad_id
        version = op.ad.version if isinstance(op, PreparedAd) else op.version
        slot, current = self._current(ad_id, batch)
        if version <= current:
            return False
        if isinstance(op, PreparedAd):
            if slot is None:
                slot = self._take_slot()
                self._slot_of[ad_id] = slot
                self._tombstones.pop(ad_id, None)
            status = LIVE | (ACTIVE if op.ad.status == "active" else 0) | (SATISFIABLE if op.targeting.satisfiable else 0)
            batch.rows[slot] = op
            batch.status[slot] = (status, version)
        elif isinstance(op, DeleteEvent):
            if slot is None:
                self._tombstones[ad_id] = version  # a late, older upsert must not resurrect it
            else:
                self._release(ad_id, slot, version, batch)
        else:
            if slot is None:
                return False  # nothing to pause or resume
            bits = batch.status[slot][0] if slot in batch.status else int(self.columns["status"][slot])
            bits = bits | ACTIVE if op.op == "resume" else bits & ~ACTIVE
            batch.status[slot] = (bits, version)
        return True

    def _release(self, ad_id: int, slot: int, version: int, batch: "_Batch") -> None:
        del self._slot_of[ad_id]
        self._tombstones[ad_id] = version
        batch.rows.pop(slot, None)
        batch.status.pop(slot, None)
        batch.freed.append(slot)

    def _take_slot(self) -> int:
        if not self._free:
            self._grow(2 * self.capacity)
        slot = self._free.pop()
        self.high_water = max(self.high_water, slot + 1)
        return slot

    def _grow(self, capacity: int) -> None:
        old = self.capacity
        for name, spec in self.specs.items():
            grown = self._filled(spec, capacity)
            grown[:old] = self.columns[name]
            self.columns[name] = grown
        self._free = list(range(capacity - 1, old - 1, -1)) + self._free

    def _write(self, batch: "_Batch") -> None:
        """Write whole rows, then status/version; freed slots are reset to the fill values."""
        n = len(batch.rows)
        if n:
            values: dict[str, np.ndarray] = {
                name: np.full((n, *spec.shape), spec.fill, dtype=np.float32 if name == "embedding" else _numpy_dtype(spec.dtype))
                for name, spec in self.specs.items() if name not in ("status", "version")
            }
            for i, prepared in enumerate(batch.rows.values()):
                ad = prepared.ad
                values["ad_id"][i], values["advertiser_id"][i], values["bid"][i] = ad.ad_id, ad.advertiser_id, ad.bid
                values["start"][i] = INT64_MIN if ad.start_time is None else ad.start_time
                values["end"][i] = INT64_MAX if ad.end_time is None else ad.end_time
                values["embedding"][i] = prepared.embedding
                for name, row in prepared.targeting.rows.items():
                    values[name][i] = row
            if "embedding_exact" in values:
                values["embedding_exact"] = values["embedding"].copy()
            if "embedding_scale" in values:
                q, scale = quantize_int8(torch.from_numpy(values["embedding"]))
                values["embedding"], values["embedding_scale"] = q.numpy(), scale.numpy()
            slots = torch.tensor(list(batch.rows), dtype=torch.int64, device=self.device)
            for name, array in values.items():
                self.columns[name][slots] = torch.from_numpy(array).to(self.device, self.specs[name].dtype)
        if batch.freed:
            slots = torch.tensor(batch.freed, dtype=torch.int64, device=self.device)
            for name, spec in self.specs.items():
                self.columns[name][slots] = spec.fill
        if batch.status:
            slots = torch.tensor(list(batch.status), dtype=torch.int64, device=self.device)
            bits, versions = zip(*batch.status.values())
            self.columns["status"][slots] = torch.tensor(bits, dtype=torch.int8, device=self.device)
            self.columns["version"][slots] = torch.tensor(versions, dtype=torch.int64, device=self.device)


class _Batch:
    """Writes planned for one atomic batch: full rows, status/version per slot, freed slots."""

    def __init__(self) -> None:
        self.rows: dict[int, PreparedAd] = {}
        self.status: dict[int, tuple[int, int]] = {}
        self.freed: list[int] = []


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype
