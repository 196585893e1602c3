"""Index operations: a validated upsert ready for the table (PreparedAd), and batches of ops in columns
(OpBatch) as the updater decodes them from the stream and the index applies them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import numpy as np

from andromeda_core.errors import InvalidInput
from andromeda_core.targeting import ColumnSpec, CompiledTargeting
from andromeda_core.types import Ad, DeleteEvent, StatusEvent
from kernels.reference.match import ACTIVE, LIVE, SATISFIABLE

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UPSERT, DELETE, PAUSE, RESUME = 0, 1, 2, 3
OP_CODES = {"upsert": UPSERT, "delete": DELETE, "pause": PAUSE, "resume": RESUME}

@dataclass(frozen=True)
class PreparedAd:
    """An upsert ready for the table: the validated ad, its compiled targeting, its ad-tower embedding (D,)."""

    ad: Ad
    targeting: CompiledTargeting
    embedding: np.ndarray


IndexOp = Union[PreparedAd, DeleteEvent, StatusEvent]


class OpRow(NamedTuple):
    """One op's scalars (code UPSERT, DELETE, PAUSE or RESUME); an upsert's row carries the ad's columns too.
    Kept instead of the validated event so that a batch of thousands holds no object graphs."""

    code: int
    ad_id: int
    version: int
    advertiser_id: int = -1
    active: bool = False
    start: int = INT64_MIN
    end: int = INT64_MAX
    bid: float = 0.0

    @classmethod
    def of(cls, op: Ad | DeleteEvent | StatusEvent) -> "OpRow":
        """An Ad stands for its upsert."""
        if not isinstance(op, Ad):
            return cls(OP_CODES[op.op], op.ad_id, op.version)
        return cls(UPSERT, op.ad_id, op.version, op.advertiser_id, op.status == "active",
                   INT64_MIN if op.start_time is None else op.start_time,
                   INT64_MAX if op.end_time is None else op.end_time, op.bid)


_OP_ROW = np.dtype([("code", np.int8), ("ad_id", np.int64), ("version", np.int64), ("advertiser_id", np.int64),
                    ("active", bool), ("start", np.int64), ("end", np.int64), ("bid", np.float64)])


@dataclass(frozen=True)
class OpBatch:
    """n ops in columns, applied in order.

    op (n,) int8 (UPSERT, DELETE, PAUSE, RESUME); ad_id, version (n,) int64; row (n,) int64: an upsert's
    row in `rows`, -1 for the other ops. rows: the u upserts' slot contents by column name: ad_id,
    advertiser_id, start, end (u,) int64; bid (u,) float32; status (u,) int8; embedding (u, D) float32;
    any targeting column (u, *shape) int32 (one left out holds its fill value in every row).
    """

    op: np.ndarray
    ad_id: np.ndarray
    version: np.ndarray
    row: np.ndarray
    rows: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.op)

    @classmethod
    def build(cls, ops: Sequence[OpRow], satisfiable: np.ndarray, embedding: np.ndarray,
              targeting: dict[str, np.ndarray]) -> "OpBatch":
        """ops in order; satisfiable (u,) bool, embedding (u, D) float32 and the targeting columns
        (u, *shape) are the rows of its u upserts in the order they appear."""
        table = np.array(ops, dtype=_OP_ROW).reshape(len(ops))
        upsert = table["code"] == UPSERT
        row = np.full(len(ops), -1, dtype=np.int64)
        row[upsert] = np.arange(int(upsert.sum()))
        ads = table[upsert]
        status = LIVE | np.where(ads["active"], ACTIVE, 0) | np.where(satisfiable, SATISFIABLE, 0)
        rows = {**{name: ads[name].copy() for name in ("ad_id", "advertiser_id", "start", "end")},  # own, packed memory
                "bid": ads["bid"].astype(np.float32), "status": status.astype(np.int8),
                "embedding": np.asarray(embedding, dtype=np.float32), **targeting}
        return cls(table["code"].copy(), table["ad_id"].copy(), table["version"].copy(), row, rows)

    @classmethod
    def from_ops(cls, ops: Sequence[IndexOp], dim: int, targeting_specs: dict[str, ColumnSpec]) -> "OpBatch":
        """Stack prepared ops (embeddings (D,) = (dim,)); `targeting_specs` gives each targeting column's row
        shape and fill value."""
        prepared = [op for op in ops if isinstance(op, PreparedAd)]
        targeting: dict[str, np.ndarray] = {}
        for i, p in enumerate(prepared):
            for name, row in p.targeting.rows.items():
                if name not in targeting:
                    spec = targeting_specs.get(name)
                    if spec is None:
                        raise InvalidInput(f"no targeting column {name} in this index", f"ad {p.ad.ad_id}.targeting")
                    targeting[name] = np.full((len(prepared), *spec.shape), spec.fill, dtype=np.int32)
                if np.shape(row) != targeting[name].shape[1:]:
                    raise InvalidInput(f"row of shape {np.shape(row)}, the column holds {targeting[name].shape[1:]}",
                                       f"ad {p.ad.ad_id}.targeting.{name}")
                targeting[name][i] = row
        satisfiable = np.array([p.targeting.satisfiable for p in prepared], dtype=bool)
        embedding = np.array([p.embedding for p in prepared], dtype=np.float32).reshape(len(prepared), dim)
        return cls.build([OpRow.of(p.ad if isinstance(p, PreparedAd) else p) for p in ops], satisfiable, embedding,
                         targeting)

    def take(self, positions: Sequence[int]) -> "OpBatch":
        """The ops at `positions`, in that order, with their rows."""
        pos = np.asarray(positions, dtype=np.int64)
        row = self.row[pos]
        kept = row[row >= 0]
        renumbered = np.full(len(pos), -1, dtype=np.int64)
        renumbered[row >= 0] = np.arange(len(kept))
        return OpBatch(self.op[pos], self.ad_id[pos], self.version[pos], renumbered,
                       {name: values[kept] for name, values in self.rows.items()})
