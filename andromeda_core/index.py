"""AdIndex: the device-resident, slot-addressed, structure-of-arrays ad table of one replica.

Columns (N = capacity slots): ad_id, version, advertiser_id (N,) int64; status (N,) int8 bits
(kernels.reference.match.LIVE | ACTIVE | SATISFIABLE); start, end (N,) int64 seconds (start <= now < end);
bid (N,) float32; embedding (N, D) in the scan's storage format (fp32, fp16 or int8 + per-block
embedding_scale); when that format is not fp32 and the index keeps an exact copy, embedding_exact
(N, D) float32, read only for the few rows a request rescores and for user-history lookups; refs (N, C)
int32, the ad's targeting as references into the index's clause dictionary (andromeda_core.clauses).
The scan reads status, start, end, refs and the head's part of the embedding (kernels.reference.fused).

Every operation is idempotent by (ad_id, version): an event whose version is not newer than the
indexed one (or than the version that deleted or expired the ad) is a no-op. Content (upserts) and status
(pauses, resumes) are versioned apart, so reordered ops converge (andromeda_core.slots.SlotPlan); the
version column holds the newer of the two.

A batch is all or nothing: its rows are checked and converted to device tensors, and its effect on the
slot bookkeeping is planned on an overlay, before the first column is written; the bookkeeping takes
the plan only once every write is made. Scans share the read side of a writer-preferring read/write
lock and a batch is written under its write side, so any number of scans run together and none sees
part of a batch. Batches take the writers' turn one at a time and work everything out in it beside the
scans (plan, clauses, writes), taking the write side only to write and commit (and to grow the table).

Parts, one job each: andromeda_core.ops (batches of ops in columns), andromeda_core.slots (which slot
holds which ad, versions, tombstones, free slots; a batch's plan), andromeda_core.writer (upsert rows into
the columns' formats, and the writes of a plan), andromeda_core.clauses (the clause dictionary),
andromeda_core.export (a copy of the table taken while it goes on applying batches), andromeda_core.locks; this
module holds the table, applies batches and serves reads.
"""
from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from andromeda_core.clauses import ClauseDictionary
from andromeda_core.errors import InvalidInput, NotFound, OutOfMemory
from andromeda_core.export import TableCopy
from andromeda_core.locks import ReadWriteLock
from andromeda_core.ops import INT64_MAX, INT64_MIN, IndexOp, OpBatch
from andromeda_core.quantization import aligned_rows, dequantize, int8_blocks, quantize_int8
from andromeda_core.schema import Schema
from andromeda_core.slots import SlotBook, SlotPlan
from andromeda_core.targeting import ColumnSpec, UserValues
from andromeda_core.writer import RowWriter
from kernels import dispatch
from kernels.reference.fused import ALWAYS
from kernels.reference.match import ACTIVE, LIVE, SATISFIABLE

REFS_WIDTH = 6  # clause refs per ad; an ad with more keeps 5 and a compound of the rest


def core_columns(dim: int, embedding_dtype: torch.dtype, exact_copy: bool, refs_width: int) -> dict[str, ColumnSpec]:
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
        "refs": ColumnSpec((refs_width,), torch.int32, ALWAYS),
    }


def holds_an_ad(status: torch.Tensor) -> torch.Tensor:
    """(n,) bool: the slots of a status column (n,) int8 that hold an ad (LIVE), paused or not."""
    return (status.to(torch.int32) & LIVE) != 0


def dtype_name(dtype: torch.dtype) -> str:
    """"int8" for torch.int8: how layouts name a dtype (torch's getattr name)."""
    return str(dtype).removeprefix("torch.")


MEMORY_USABLE = 0.9  # the share of the available memory a table may take: the process needs the rest
CGROUP = Path("/sys/fs/cgroup")


def available_memory(device: torch.device, cgroup: Path = CGROUP) -> int | None:
    """Bytes `device` can still allocate (None where unknown): on CUDA the driver's free memory and what PyTorch holds
    cached unused; on the CPU the least of Linux's MemAvailable (the host's) and the headroom under this process's
    memory cgroup limit (a container's: the limit at which the kernel kills it, reclaimable page cache counted free)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    known = [b for b in (_meminfo_available(), _cgroup_headroom(cgroup)) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _cgroup_headroom(root: Path) -> int | None:
    """Limit minus usage plus inactive page cache of the memory cgroup at `root` (v2, else v1); None without one."""
    for limit, usage, stat, reclaimable in (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                                            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                             "memory/memory.stat", "total_inactive_file")):
        try:
            cap = (root / limit).read_text().strip()
            if cap == "max":
                return None
            counters = dict(line.split() for line in (root / stat).read_text().splitlines())
            return int(cap) - int((root / usage).read_text()) + int(counters.get(reclaimable, 0))
        except (OSError, ValueError):
            continue
    return None


class AdIndex:
    def __init__(self, schema: Schema, dim: int, capacity: int = 1024, device: str | torch.device = "cpu",
                 embedding_dtype: torch.dtype = torch.float32, exact_copy: bool = True, refs_width: int = REFS_WIDTH):
        if dim < 1 or capacity < 1:
            raise ValueError("dim and capacity must be positive")
        self.schema, self.dim, self.device = schema, dim, torch.device(device)
        self.specs = core_columns(dim, embedding_dtype, exact_copy, refs_width)
        self._writer = RowWriter(schema, dim, self.specs, self.device)
        self._check_fits(capacity)
        self.columns = {name: self._filled(name, capacity) for name in self.specs}
        self.clauses = ClauseDictionary(schema, refs_width)
        self._book = SlotBook(capacity)
        self._lock = ReadWriteLock()
        self._exports: list[TableCopy] = []  # copies being taken (begin_export): each batch's slots are noted
        self._exports_lock = threading.Lock()  # the list is replaced, never changed in place: _commit reads it whole

    def _filled(self, name: str, n: int) -> torch.Tensor:
        """Column `name` for n slots, every slot at the column's fill; the scan's embedding rows cache-line aligned."""
        spec = self.specs[name]
        if name == "embedding":
            return aligned_rows(n, self.dim, spec.dtype, spec.fill, self.device)
        return torch.full((n, *spec.shape), spec.fill, dtype=spec.dtype, device=self.device)

    def _check_fits(self, capacity: int, growing: bool = False) -> None:
        """Raise OutOfMemory when columns of `capacity` slots would take more than MEMORY_USABLE of the device's
        available memory (growing: beside the columns it has)."""
        per_slot = sum(self._filled(name, 1).untyped_storage().nbytes() for name in self.specs)
        available = available_memory(self.device)
        if available is None or capacity * per_slot <= MEMORY_USABLE * available:
            return
        remedy = ("add shards (docs/resharding.md) or store smaller vectors (storage fp16 or int8)" if growing else
                  "lower the initial capacity (ANDROMEDA_INITIAL_CAPACITY, or initial_capacity in the service config) "
                  "or add shards")
        raise OutOfMemory(f"a table of {capacity:,} slots needs {capacity * per_slot / 2**30:,.1f} GiB ({per_slot} B a "
                          f"slot), more than {MEMORY_USABLE:.0%} of the {available / 2**30:,.1f} GiB the device "
                          f"({self.device}) has available: {remedy}", "capacity")

    # -- reading ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.columns["ad_id"].shape[0]

    @property
    def high_water(self) -> int:
        """Slots >= high_water have never held an ad; scans stop there."""
        return self._book.high_water

    def __len__(self) -> int:
        return len(self._book.slot_of)

    def __contains__(self, ad_id: int) -> bool:
        return ad_id in self._book.slot_of

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold the table still for a scan: no batch is written meanwhile, other scans run alongside."""
        with self._lock.shared():
            yield

    def request_inputs(self, values: Sequence[UserValues], now: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(now (B,) int64, clause truth table (B, W) int32) of B requests on the device. Call inside
        `reading()`: the truth table holds for the refs as they are now."""
        return torch.tensor(list(now), dtype=torch.int64, device=self.device), self.clauses.truth(values, self.device)

    def eligible(self, values: Sequence[UserValues], now: Sequence[int]) -> list[list[int]]:
        """Ad ids eligible for each of B requests (targeting values and time), ascending."""
        with self.reading():
            status, start, end, refs, _, _ = self.scan_columns()
            ok = dispatch.clause_match(status, start, end, refs, *reversed(self.request_inputs(values, now)))
            ids = self.columns["ad_id"][: self.high_water]
            return [sorted(ids[row].tolist()) for row in ok]

    def ad_ids(self) -> list[int]:
        """Ids of the live ads."""
        with self.reading():
            return list(self._book.slot_of)

    def slot_of(self, ad_id: int) -> int | None:
        return self._book.slot_of.get(ad_id)

    @property
    def keeps_exact(self) -> bool:
        """Whether the scan's format is lossy and an exact float32 copy is kept for rescoring."""
        return "embedding_exact" in self.columns

    @property
    def storage(self) -> str:
        """The embeddings' storage: the scan's dtype, "+exact" where an exact float32 copy is kept (e.g. "int8+exact")."""
        return dtype_name(self.specs["embedding"].dtype) + ("+exact" if self.keeps_exact else "")

    def in_storage_of(self, other: "AdIndex") -> "AdIndex | None":
        """This index with `other`'s embedding storage: itself where they match; else a converted copy when this one
        holds every vector in float32 (stored so, or kept exact), which then holds the bytes an index of that storage
        writes for the same ads; None when it does not (a conversion would round twice)."""
        if self.storage == other.storage:
            return self
        tensors, layout = self.export_state()
        exact = tensors.pop("col.embedding_exact", None)
        exact = tensors["col.embedding"] if exact is None else exact
        if exact.dtype != torch.float32:
            return None
        tensors.pop("col.embedding_scale", None)
        dtype = other.specs["embedding"].dtype
        if dtype == torch.int8:
            tensors["col.embedding"], tensors["col.embedding_scale"] = quantize_int8(exact)
        else:
            tensors["col.embedding"] = exact.to(dtype)
        if other.keeps_exact:
            tensors["col.embedding_exact"] = exact
        layout = {**layout, "embedding_dtype": dtype_name(dtype), "exact_copy": str(other.keeps_exact)}
        return AdIndex.from_state(self.schema, tensors, layout, self.device)

    def _vectors(self, rows: slice | torch.Tensor) -> torch.Tensor:
        """Stored embeddings of `rows` as float32, dequantised when stored as int8."""
        scale = self.columns["embedding_scale"][rows] if "embedding_scale" in self.columns else None
        return dequantize(self.columns["embedding"][rows], scale)

    def embeddings(self, start: int, stop: int) -> torch.Tensor:
        """(stop - start, D) float32 embeddings of slots [start, stop) as the scan reads them."""
        return self._vectors(slice(start, stop))

    def scan_columns(self) -> tuple[torch.Tensor, ...]:
        """(status, start, end, refs, embedding, embedding scale or None) of slots [0, high_water): what the
        fused pass reads (kernels.reference.fused). Call inside `reading()`."""
        c, n = self.columns, self.high_water
        scale = c["embedding_scale"][:n] if "embedding_scale" in c else None
        return c["status"][:n], c["start"][:n], c["end"][:n], c["refs"][:n], c["embedding"][:n], scale

    def vectors_at(self, slots: torch.Tensor) -> torch.Tensor:
        """slots (...) int64, -1 for none -> full-precision float32 embeddings (..., D) (zeros for -1); the
        exact copy where kept, else the stored vectors. Call inside `reading()`."""
        rows = slots.clamp(min=0)
        vectors = self.columns["embedding_exact"][rows] if self.keeps_exact else self._vectors(rows.flatten()).reshape(
            *rows.shape, self.dim)
        return vectors * (slots >= 0)[..., None]

    def embeddings_of(self, ad_ids: Sequence[int], now: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, D) float32 embeddings of `ad_ids` for user towers (zeros where not found; full precision unless a
        lossy index keeps no exact copy) and found (n,) bool. An ad past its end (end <= now, default the clock) is
        not found, whether or not sweep_expired has freed its slot yet: replicas sweep at their own times, and a
        user's history read the ad on one and not on another."""
        with self.reading():  # the slots and the columns of one state (callers may hold it already)
            slots = torch.tensor([self._book.slot_of.get(a, -1) for a in ad_ids], dtype=torch.int64, device=self.device)
            found = (slots >= 0) & (self.columns["end"][slots.clamp(min=0)] > (int(time.time()) if now is None else now))
            return self.vectors_at(torch.where(found, slots, -1)).cpu(), found.cpu()

    def get(self, ad_id: int) -> dict:
        """The indexed state of one ad."""
        with self.reading():
            slot = self._book.slot_of.get(ad_id)
            if slot is None:
                raise NotFound(f"ad {ad_id} is not in the index", "ad_id")
            c = {name: col[slot] for name, col in self.columns.items() if col.dim() == 1}
            status = int(c["status"])
            return {
                "ad_id": ad_id, "version": int(c["version"]), "advertiser_id": int(c["advertiser_id"]),
                "status": "active" if status & ACTIVE else "paused", "satisfiable": bool(status & SATISFIABLE),
                "start_time": None if int(c["start"]) == INT64_MIN else int(c["start"]),
                "end_time": None if int(c["end"]) == INT64_MAX else int(c["end"]),
                "bid": float(c["bid"]), "slot": slot,
            }

    def owners_of(self, ad_ids: Sequence[int]) -> list[tuple[int | None, int | None, int | None]]:
        """(advertiser, or None where not indexed but for an ad that expired: still its advertiser's; content version
        or None where never seen; version of the pause or resume kept or None) of each ad, the advertisers read in
        one gather: what the owner registry takes where newer than its entry (index_updater/owners.py)."""
        with self.reading():
            book = self._book
            slots = [book.slot_of.get(ad_id) for ad_id in ad_ids]
            live = torch.tensor([s for s in slots if s is not None], dtype=torch.int64, device=self.device)
            owners = iter(self.columns["advertiser_id"][live].tolist())
            return [(book.expired.get(ad_id) if slot is None else next(owners), book.version.get(ad_id),
                     book.status[ad_id][0] if ad_id in book.status else None) for ad_id, slot in zip(ad_ids, slots)]

    def content_version_of(self, ad_id: int) -> int | None:
        """Version of `ad_id`'s content: its newest upsert, or the delete or expiry that removed it (None if never
        seen); an upsert or delete applies only when newer."""
        return self._book.version.get(ad_id)

    def version_of(self, ad_id: int) -> int | None:
        """Newest version applied for `ad_id` (live, deleted or expired; its content or its status), or None if
        never seen."""
        return self._book.newest(ad_id)

    def digest(self) -> str:
        """Order-independent hash of the live content (every column of every live slot)."""
        with self.reading():
            live = holds_an_ad(self.columns["status"][: self.high_water])
            total = torch.zeros((), dtype=torch.int64)
            for i, name in enumerate(sorted(self.columns)):
                col = self.columns[name][: self.high_water][live].cpu()
                if name == "refs":  # by clause content: clause ids differ between replicas
                    col = torch.from_numpy(self.clauses.hashes)[col.long() >> 1] * 2 + (col & 1) * (col != ALWAYS)
                ints = col.view(torch.int32) if col.dtype == torch.float32 else (
                    col.view(torch.int16) if col.dtype in (torch.float16, torch.bfloat16) else col)
                ints = ints.to(torch.int64).reshape(ints.shape[0], math.prod(ints.shape[1:]))
                weights = torch.arange(1, ints.shape[1] + 1, dtype=torch.int64) * (2 * i + 1)
                row = (ints * weights).sum(1) + (i + 1) * 0x9E3779B1
                row = (row ^ (row >> 31)) * 0x2545F4914F6CDD1D
                total += row.sum()
            return f"{int(live.sum())}-{int(total) & (2**64 - 1):016x}"

    # -- state (for snapshots) -------------------------------------------------------------------

    def export_state(self, copy: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """(CPU tensors, layout metadata) that `from_state` restores; consistent (no batch is half written). A CPU
        index's columns come as views of its live table, valid until its next write, unless `copy` (a device
        index's always come copied to the host). To copy a large table without stopping its writes for as long,
        begin_export and finish_export."""
        with self.reading():
            n = self.high_water
            return self._state({name: col[:n].to("cpu", copy=copy).contiguous()
                                for name, col in self.columns.items()}, n)

    def begin_export(self) -> TableCopy:
        """Begin a copy of the table that batches go on being applied through (andromeda_core.export): run its
        copy_bulk (in any thread, without the lock), then finish_export, or cancel_export."""
        with self.reading(), self._exports_lock:
            copy = TableCopy(self.columns, self.high_water)
            self._exports = [*self._exports, copy]
            return copy

    def finish_export(self, copy: TableCopy) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """export_state(copy=True) of the table as it is now, from `copy` (begin_export, its bulk copied): under the
        lock only the rows written since it began are copied. None when the table was replaced since (adopt). Ends
        the export, whether it returns or raises (a later finish would miss the batches applied meanwhile)."""
        try:
            with self.reading():
                if copy.dropped:
                    return None
                n = self.high_water
                return self._state(copy.finished(self.columns, n), n)
        finally:
            self.cancel_export(copy)

    def cancel_export(self, copy: TableCopy) -> None:
        """Stop recording the slots written for `copy`."""
        with self._exports_lock:
            self._exports = [e for e in self._exports if e is not copy]

    def _state(self, columns: dict[str, torch.Tensor], n: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """export_state from copies or views of the columns' first n rows (name -> CPU tensor); under the lock."""
        tensors = {f"col.{name}": col for name, col in columns.items()}
        tombstones = self._book.tombstones()
        tensors["tombstones.ad_id"] = torch.tensor(list(tombstones), dtype=torch.int64)
        tensors["tombstones.version"] = torch.tensor(list(tombstones.values()), dtype=torch.int64)
        tensors["expired.ad_id"] = torch.tensor(list(self._book.expired), dtype=torch.int64)
        tensors["expired.advertiser"] = torch.tensor(list(self._book.expired.values()), dtype=torch.int64)
        statuses = self._book.status  # with the content version each is newer than (-1: none)
        tensors["statuses.ad_id"] = torch.tensor(list(statuses), dtype=torch.int64)
        tensors["statuses.version"] = torch.tensor([v for v, _ in statuses.values()], dtype=torch.int64)
        tensors["statuses.active"] = torch.tensor([a for _, a in statuses.values()], dtype=torch.bool)
        tensors["statuses.content_version"] = torch.tensor([self._book.version.get(ad, -1) for ad in statuses],
                                                           dtype=torch.int64)
        live = holds_an_ad(columns["status"])
        tensors.update(self.clauses.export_state(columns["refs"][live].numpy()))
        layout = {"schema_name": self.schema.name, "schema_version": str(self.schema.version),
                  "schema_fingerprint": self.schema.fingerprint,
                  "dim": str(self.dim), "capacity": str(self.capacity), "high_water": str(n),
                  "embedding_dtype": dtype_name(self.specs["embedding"].dtype),
                  "exact_copy": str(self.keeps_exact), "refs_width": str(self.clauses.width)}
        return tensors, layout

    @classmethod
    def from_state(cls, schema: Schema, tensors: dict[str, torch.Tensor], layout: dict[str, str],
                   device: str | torch.device = "cpu") -> "AdIndex":
        if layout["schema_name"] != schema.name or layout["schema_version"] != str(schema.version):
            raise ValueError(f"state was written for schema {layout['schema_name']} v{layout['schema_version']}, "
                             f"not {schema.name} v{schema.version}")
        if not schema.has_fingerprint(layout.get("schema_fingerprint")):
            raise ValueError(f"state was written for another content of schema {schema.name} v{schema.version} "
                             f"(give a schema a new version whenever its content changes)")
        dtype = getattr(torch, layout["embedding_dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"embedding_dtype {layout['embedding_dtype'][:40]!r} is not a torch dtype")
        index = cls(schema, int(layout["dim"]), capacity=int(layout["capacity"]), device=device, embedding_dtype=dtype,
                    exact_copy=layout.get("exact_copy") == "True", refs_width=int(layout["refs_width"]))
        book = index._book
        n = book.high_water = int(layout["high_water"])
        for name, col in index.columns.items():
            col[:n] = tensors[f"col.{name}"].to(device)
        live = torch.nonzero(holds_an_ad(index.columns["status"][:n])).flatten().tolist()
        index.clauses = ClauseDictionary.from_state(schema, index.clauses.width, tensors,
                                                    index.columns["refs"][live].cpu().numpy())
        ad_ids = index.columns["ad_id"][live].tolist()
        book.slot_of = dict(zip(ad_ids, live))
        book.version = dict(zip(tensors["tombstones.ad_id"].tolist(), tensors["tombstones.version"].tolist()))
        book.dead = set(book.version).difference(book.slot_of)
        if "expired.ad_id" in tensors:  # snapshots before 2026-12-06 have none: their expired ads read as deleted
            book.expired = dict(zip(tensors["expired.ad_id"].tolist(), tensors["expired.advertiser"].tolist()))
        book.version.update(zip(ad_ids, index.columns["version"][live].tolist()))  # the newest: content, but
        if "statuses.ad_id" in tensors:  # where a newer pause or resume set it (snapshots before these have none)
            statuses = zip(*(tensors[f"statuses.{name}"].tolist() for name in ("ad_id", "version", "active", "content_version")))
            for ad, version, active, content in statuses:
                book.status[ad] = (version, bool(active))
                if content >= 0:
                    book.version[ad] = content
                else:
                    book.version.pop(ad, None)
                    book.dead.discard(ad)
        used = set(live)
        book.free = [s for s in range(index.capacity - 1, -1, -1) if s not in used]
        return index

    def adopt(self, other: "AdIndex") -> None:
        """Take over `other`'s content (e.g. a restored snapshot) in one step that scans see whole."""
        if other.schema != self.schema or other.dim != self.dim:
            raise ValueError("can only adopt an index with the same schema and embedding width")
        with self._lock.writing(), self._lock.exclusive():
            self.specs, self.columns, self._book, self.clauses = other.specs, other.columns, other._book, other.clauses
            self._writer = other._writer
            with self._exports_lock:
                for copy in self._exports:  # copies of the table replaced
                    copy.dropped = True
                self._exports = []

    # -- writing ---------------------------------------------------------------------------------

    def apply(self, ops: Sequence[IndexOp] | OpBatch) -> list[bool]:
        """Apply a batch atomically; returns, per op, whether it changed the index (False = stale no-op).
        All or nothing: should anything fail (InvalidInput for rows that do not fit), the index is unchanged."""
        writer = self._writer
        batch = ops if isinstance(ops, OpBatch) else OpBatch.from_ops(ops, self.dim, writer.targeting)
        staged = writer.stage(batch.rows)  # before the lock: scans go on while rows are checked and converted
        with self._lock.writing():
            if writer is not self._writer:  # adopt() changed the layout meanwhile
                staged = self._writer.stage(batch.rows)
            plan = SlotPlan(self._book, self.capacity)
            applied = [plan.op(*op) for op in zip(batch.op.tolist(), batch.ad_id.tolist(), batch.version.tolist(),
                                                  batch.row.tolist())]
            self._commit(plan, staged)
            return applied

    def refusals(self, batch: OpBatch) -> dict[int, InvalidInput]:
        """The positions in `batch` of the upserts whose rows apply() refuses (InvalidInput: a row that does not fit
        the table), each with why; changes nothing. The batch without them applies, as one."""
        refused = {}
        for position, row in enumerate(batch.row.tolist()):
            if row >= 0:
                try:
                    self._writer.check(batch.take([position]).rows)
                except InvalidInput as exc:
                    refused[position] = exc
        return refused

    def sweep_expired(self, now: int) -> int:
        """Free the slots of ads whose end_time <= now (they already stopped matching). Returns how many."""
        with self._lock.writing():
            n = self.high_water
            live = holds_an_ad(self.columns["status"][:n])
            slots = torch.nonzero(live & (self.columns["end"][:n] <= now)).flatten().tolist()
            plan = SlotPlan(self._book, self.capacity)
            for ad, slot, advertiser in zip(self.columns["ad_id"][slots].tolist(), slots,
                                            self.columns["advertiser_id"][slots].tolist()):
                plan.expire(ad, slot, advertiser)  # a newer pause outlives it: a late edit comes back paused
            self._commit(plan, {})
            return len(slots)

    def _commit(self, plan: SlotPlan, staged: dict[str, Any]) -> None:
        """Make the plan's writes (into grown copies when the batch needs more slots), then commit its bookkeeping
        and drop the clause references of the rows it overwrote or freed. All or nothing: should a step fail (out
        of memory on the device), the clause references it took are dropped again and the columns are as before.

        Called in the writers' turn (`ReadWriteLock.writing`): nothing else changes the table, the bookkeeping or
        the dictionary's references meanwhile, so the batch's clauses and writes are worked out while scans go on,
        and only the writes and the commit hold them off (for a batch of 10,000 new rows on a 2-core box, about
        200 ms of interning clauses and computing writes out of the scans' way). A batch that grows the table (it
        doubles: rare) is grown and worked out with the scans held off, as before: the copies need the memory
        that the scans' buffers take on a device."""
        taken: list[np.ndarray] = []  # rows of refs whose clauses this batch took
        committed = False
        try:
            if plan.row_at:
                refs = np.full((len(staged["clauses"]), self.clauses.width), ALWAYS, dtype=np.int32)
                for row in plan.row_at.values():
                    refs[row] = self.clauses.refs(staged["clauses"][row])
                    taken.append(refs[row])
                staged = {**staged, "refs": torch.from_numpy(refs).to(self.device)}
            grows = plan.capacity_needed > self.capacity
            # computed in full before any is made
            writes = None if grows else self._writer.writes(plan, staged, self.columns)
            with self._lock.exclusive():
                columns = self._grown(plan.capacity_needed)
                writes = self._writer.writes(plan, staged, columns) if grows else writes
                replaced = columns["refs"][torch.tensor([*plan.row_at, *plan.freed], dtype=torch.int64,
                                                        device=self.device)].cpu().numpy()
                written = torch.cat([slots for _, slots, _ in writes]) if self._exports and writes else None
                try:
                    self._write(columns, writes)
                finally:  # copied again by exports in progress: new, or put back after a failed write they may have read
                    if written is not None:
                        for copy in self._exports:
                            copy.note_written(written)
                committed = True
                self.columns = columns
                plan.commit(self.capacity)
        except BaseException:
            if not committed:
                self.clauses.release(np.array(taken, dtype=np.int32).reshape(-1, self.clauses.width))
            raise
        self.clauses.release(replaced)  # no row refers to them any more: scans that began since never read them

    def _write(self, columns: dict[str, torch.Tensor], writes: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Make the writes (column name, slots, values) into columns, all or none: into the live columns, the values
        they overwrite are kept first and put back should one fail (grown copies are simply not adopted)."""
        kept = [] if columns is not self.columns else [(name, slots, columns[name][slots].clone())
                                                        for name, slots, _ in writes]
        try:
            for name, slots, values in writes:
                columns[name][slots] = values
        except BaseException:
            for name, slots, old in kept:
                columns[name][slots] = old
            raise

    def _grown(self, needed: int) -> dict[str, torch.Tensor]:
        """The columns themselves when `needed` slots fit, else copies doubled in capacity until they do."""
        capacity = self.capacity
        if needed <= capacity:
            return self.columns
        while capacity < needed:
            capacity *= 2
        self._check_fits(capacity, growing=True)  # the old columns stay allocated meanwhile: available leaves them out
        grown = {}
        for name in self.specs:
            grown[name] = self._filled(name, capacity)
            grown[name][: self.capacity] = self.columns[name]
        return grown
