"""The writers of the ad table: they compile a batch's upsert rows into the table's columns (checked, in the
storage format, on the device, targeting turned into clause references) and list the whole-slot writes a
batch's plan makes. They read the table's layout; the index applies what they produce under its lock."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from andromeda_core.clauses import row_clauses
from andromeda_core.errors import InvalidInput
from andromeda_core.quantization import quantize_int8
from andromeda_core.schema import Schema
from andromeda_core.slots import SlotPlan
from andromeda_core.targeting import ColumnSpec, targeting_columns
from kernels.reference.match import ACTIVE

CORE_ROW_COLUMNS = ("ad_id", "advertiser_id", "start", "end", "bid", "status", "embedding")  # in every upsert row


def bits_within(size: int, words: int) -> np.ndarray:
    """(words,) int64: per int32 word of a bitset, the bits of value indices below `size` (as unsigned 32 bits)."""
    return np.array([0xFFFFFFFF if 32 * (w + 1) <= size else (1 << max(0, size - 32 * w)) - 1 for w in range(words)],
                    dtype=np.int64)


def largest_stored(dtype: torch.dtype) -> float:
    """The largest magnitude of an embedding element that a table of this storage dtype holds finite (int8: float32's,
    scaled per block)."""
    return float(torch.finfo(dtype if dtype.is_floating_point else torch.float32).max)


class RowWriter:
    """Writes for a table of `specs` (column -> ColumnSpec) holding `dim`-wide embeddings on `device`."""

    def __init__(self, schema: Schema, dim: int, specs: dict[str, ColumnSpec], device: torch.device):
        self.schema, self.specs, self.device = schema, specs, device
        self.targeting = targeting_columns(schema)  # the compiled rows an upsert brings (turned into refs)
        # what an upsert row of each column must look like, whatever the storage format
        self.row_specs = {**{name: specs[name] for name in CORE_ROW_COLUMNS},
                          "embedding": ColumnSpec((dim,), torch.float32, 0), **self.targeting}
        # value indices a list column may hold: -1 (padding) up to the category's size (exclusive)
        self.list_sizes = {f"{c.name}.{side}": c.size for c in schema.list_categories for side in ("pos", "neg")}
        # bits a bitset column may set, per int32 word: the category's values only (a bit past them reads as no value
        # a compiler writes: a forged or corrupt entry)
        self.bitset_bits = {f"{c.name}.{side}": (c.size, bits_within(c.size, c.words))
                            for c in schema.bitset_categories for side in ("pos", "neg")}

    def stage(self, rows: dict[str, np.ndarray]) -> dict[str, Any]:
        """Upsert rows -> device tensors in the columns' dtypes (the embedding in the storage format, with its
        scale and exact copy where kept) and, under "clauses", each row's clause refs (interned when written).
        Raises InvalidInput for rows that do not fit the table."""
        self.check(rows)
        if not len(rows["ad_id"]):
            return {}  # no upserts: nothing to convert (and nothing to quantise)
        staged: dict[str, Any] = {name: torch.from_numpy(np.ascontiguousarray(values)).to(self.device, self.specs[name].dtype)
                                  for name, values in rows.items() if name in self.specs and name != "embedding"}
        staged["clauses"] = row_clauses(self.schema, {n: v for n, v in rows.items() if n in self.targeting},
                                        len(rows["ad_id"]))
        exact = torch.from_numpy(np.ascontiguousarray(rows["embedding"], dtype=np.float32))
        if "embedding_scale" in self.specs:  # on the CPU whatever the device: replicas store the same bytes
            quantized, scale = quantize_int8(exact)
            staged["embedding"], staged["embedding_scale"] = quantized.to(self.device), scale.to(self.device)
        else:
            staged["embedding"] = exact.to(self.device, self.specs["embedding"].dtype)
        if "embedding_exact" in self.specs:
            staged["embedding_exact"] = exact.to(self.device)
        return staged

    def check(self, rows: dict[str, np.ndarray]) -> None:
        """Raise InvalidInput unless every row column is known, shaped (u, *row shape), of the right kind, finite in
        the storage format (embeddings: until 2026-12-07 a float32 1e5 became inf in fp16) and within its category
        (list value indices: a scan would index past the user's table)."""
        u = len(rows["ad_id"])
        for name, values in rows.items():
            spec = self.row_specs.get(name)
            if spec is None:
                raise InvalidInput(f"no row column {name} in this index", name)
            if values.shape != (u, *spec.shape) or (values.dtype.kind == "f") != spec.dtype.is_floating_point:
                raise InvalidInput(f"{values.dtype} rows of shape {values.shape}; the column takes "
                                   f"{'float' if spec.dtype.is_floating_point else 'integer'} rows of shape {spec.shape}", name)
            size = self.list_sizes.get(name)
            if size is not None and ((values < -1) | (values >= size)).any():
                raise InvalidInput(f"value indices outside [-1, {size})", name)
            if name in self.bitset_bits:
                size, allowed = self.bitset_bits[name]
                if (values.astype(np.int64) & 0xFFFFFFFF & ~allowed).any():  # any integer width
                    raise InvalidInput(f"bits past the category's {size} values", name)
        largest = largest_stored(self.specs["embedding"].dtype)
        if not (np.abs(rows["embedding"]) <= largest).all():  # NaN fails too
            raise InvalidInput(f"embeddings must be finite, of magnitude at most {largest:g} (what the table's "
                               f"{str(self.specs['embedding'].dtype).removeprefix('torch.')} storage holds)", "embedding")

    def writes(self, plan: SlotPlan, staged: dict[str, Any],
                columns: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, torch.Tensor | int]]:
        """(column, slots, values) for whole rows, freed slots (reset to fill), then status and version."""
        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        writes: list[tuple[str, torch.Tensor, torch.Tensor | int]] = []
        if plan.row_at:
            slots, rows = index(list(plan.row_at)), index(list(plan.row_at.values()))
            writes += [(name, slots, staged[name][rows] if name in staged else spec.fill)
                       for name, spec in self.specs.items() if name not in ("status", "version")]
        if plan.freed:
            slots = index(plan.freed)
            writes += [(name, slots, spec.fill) for name, spec in self.specs.items()]
        if plan.ad_at:
            touched = list(plan.ad_at)
            status = columns["status"][index(touched)]
            with_row = [j for j, slot in enumerate(touched) if slot in plan.row_at]
            if with_row:
                status[index(with_row)] = staged["status"][index([plan.row_at[touched[j]] for j in with_row])]
            flipped = [j for j, slot in enumerate(touched) if slot in plan.active]
            if flipped:
                bits = index([ACTIVE if plan.active[touched[j]] else 0 for j in flipped]).to(torch.int8)
                status[index(flipped)] = (status[index(flipped)] & ~ACTIVE) | bits
            versions = index([plan.newest(plan.ad_at[slot]) for slot in touched])
            writes += [("status", index(touched), status), ("version", index(touched), versions)]
        return writes
