"""The clause dictionary: the shared half of the compact targeting layout.

A clause is "the user holds at least one of these values of this category". Every positive group of
an ad's compiled targeting (an any_of, one all_of group, a min-max range) and every none_of set is one
clause; the ad's row of refs points at it (negated for none_of, see kernels.reference.fused). Ads share
clauses: the dictionary interns each distinct (category, value set) once, counts the refs to it and
recycles the id once nothing refers to it.

Per request every clause is evaluated once, through an inverted index (category, value) -> clauses
holding that value: the cost is the postings of the user's few values, not the number of clauses. The
result is a bit-packed truth table (B, W) int32 that the scan tests per ad.

A row of refs has a fixed width C. An ad with more clauses keeps its first C - 1 refs and points, last,
at a compound clause: the AND of its other refs, evaluated after the simple clauses.

A writer changes the dictionary beside the scans (AdIndex._commit: a batch's clauses are taken before its rows
are written, and the clauses of the rows it overwrote are released after), so its own lock keeps each change
and each read whole; a scan never meets a clause taken or released meanwhile, since no row it reads refers to
one.
"""
from __future__ import annotations

import functools
import hashlib
import threading
from typing import Sequence

import numpy as np
import torch

from andromeda_core.schema import Schema
from andromeda_core.targeting import UserValues
from kernels.reference.fused import ALWAYS

COMPOUND = -1  # category index of a compound clause
FREE = -2  # category index of an unused clause id
Key = tuple[int, tuple[int, ...]]  # (category index, sorted values) or (COMPOUND, member refs)
ClauseRef = tuple[Key, bool]  # (clause, negate)


def _stable_hash(key: Key) -> int:
    """A 62-bit hash of a clause's content, the same in every process (for index digests)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little") >> 2


@functools.lru_cache(maxsize=1 << 20)
def _values(encoding: str, raw: bytes) -> tuple[int, ...]:
    """The sorted distinct value indices of one group as compiled (its int32 bytes): a bitset's set bits,
    or a -1 padded list's values. Cached: ads share most of their groups."""
    row = np.frombuffer(raw, dtype="<i4")
    if encoding == "bitset":
        return tuple(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())
    return tuple(sorted(set(row[row >= 0].tolist())))


def row_clauses(schema: Schema, rows: dict[str, np.ndarray], u: int) -> list[list[ClauseRef]]:
    """The clause refs of u compiled targeting rows (columns `<cat>.pos` (u, G, ...), `<cat>.neg` (u, ...) of
    andromeda_core.targeting; a column left out holds nothing), in schema order: positive groups, then none_of."""
    out: list[list[ClauseRef]] = [[] for _ in range(u)]
    for c, cat in enumerate(schema.categories):
        empty = 0 if cat.encoding == "bitset" else -1
        for side, negate in (("pos", False), ("neg", True)):
            column = rows.get(f"{cat.name}.{side}")
            if column is None:
                continue
            groups = np.ascontiguousarray(column if side == "pos" else column[:, None], dtype="<i4")  # (u, G, ...)
            used = (groups != empty).reshape(u, groups.shape[1], -1).any(-1)  # (u, G)
            for r, g in zip(*np.nonzero(used)):
                out[r].append(((c, _values(cat.encoding, groups[r, g].tobytes())), negate))
    return out


class ClauseDictionary:
    """Interned clauses with reference counts, their inverted index and stable content hashes."""

    def __init__(self, schema: Schema, width: int):
        if width < 2:
            raise ValueError(f"a row of refs needs at least 2 places (one may point at a compound), got {width}")
        self.schema, self.width = schema, width
        self._category = {cat.name: c for c, cat in enumerate(schema.categories)}
        self._ids: dict[Key, int] = {}
        self._keys: list[Key | None] = [None]  # id 0: the clause nobody holds (ALWAYS = its negation)
        self._count = [0]
        self._free: list[int] = []
        self._postings: dict[tuple[int, int], set[int]] = {}
        self._arrays: dict[tuple[int, int], np.ndarray] = {}  # postings as arrays, built when first read
        self._compounds: dict[int, tuple[int, ...]] = {}  # id -> member refs
        self._compound_table: tuple[np.ndarray, np.ndarray] | None = None  # (ids (K,), refs (K, L)), built when read
        self.hashes = np.zeros(1, dtype=np.int64)  # per id: _stable_hash of its content (0: free)
        self._lock = threading.Lock()  # around each change and each read of more than one entry

    def __len__(self) -> int:
        """Clauses in use."""
        return len(self._ids)

    @property
    def size(self) -> int:
        """Clause ids handed out so far, free ones included: every ref points below it."""
        return len(self._keys)

    # -- writing ---------------------------------------------------------------------------------

    def refs(self, clauses: Sequence[ClauseRef]) -> np.ndarray:
        """One ad's clauses -> its row of refs (C,) int32 (ALWAYS padded), taking a reference to each clause."""
        with self._lock:
            refs = [2 * self._take(key) + negate for key, negate in clauses]
            if len(refs) > self.width:
                rest = tuple(refs[self.width - 1:])
                shared = (COMPOUND, rest) in self._ids
                refs = refs[: self.width - 1] + [2 * self._take((COMPOUND, rest))]
                if shared:  # the compound already holds its members: this ad's references to them go
                    for ref in rest:
                        self._drop(ref >> 1)
        return np.array(refs + [ALWAYS] * (self.width - len(refs)), dtype=np.int32)

    def release(self, refs: np.ndarray) -> None:
        """Drop the references of rows of refs (..., C) (rows being overwritten or freed), a row at a time."""
        for row in np.asarray(refs).reshape(-1, self.width).tolist():
            with self._lock:
                for ref in row:
                    if ref != ALWAYS:
                        self._drop(ref >> 1)

    def _take(self, key: Key) -> int:
        """The id of `key` (interned if new) with one more reference. A new compound takes over the
        references its caller holds to its members."""
        clause = self._ids.get(key)
        if clause is None:
            clause = self._free.pop() if self._free else self._grow()
            self._ids[key], self._keys[clause], self.hashes[clause] = clause, key, _stable_hash(self._content(key))
            if key[0] == COMPOUND:
                self._compounds[clause], self._compound_table = key[1], None
            else:
                for v in key[1]:
                    self._postings.setdefault((key[0], v), set()).add(clause)
                    self._arrays.pop((key[0], v), None)
        self._count[clause] += 1
        return clause

    def _content(self, key: Key) -> tuple:
        """A compound's content by its members' contents (their ids differ between replicas)."""
        if key[0] != COMPOUND:
            return key
        return (COMPOUND, tuple((self._content(self._keys[ref >> 1]), ref & 1) for ref in key[1]))

    def _grow(self) -> int:
        self._keys.append(None)
        self._count.append(0)
        if len(self._keys) > len(self.hashes):
            self.hashes = np.concatenate([self.hashes, np.zeros(len(self.hashes), dtype=np.int64)])
        return len(self._keys) - 1

    def _drop(self, clause: int) -> None:
        self._count[clause] -= 1
        if self._count[clause]:
            return
        key = self._keys[clause]
        del self._ids[key]
        self._keys[clause], self.hashes[clause] = None, 0
        self._free.append(clause)
        if key[0] == COMPOUND:
            del self._compounds[clause]
            self._compound_table = None
            for ref in key[1]:
                self._drop(ref >> 1)
        else:
            for v in key[1]:
                held = self._postings[(key[0], v)]
                held.discard(clause)
                if not held:
                    del self._postings[(key[0], v)]
                self._arrays.pop((key[0], v), None)

    # -- reading ---------------------------------------------------------------------------------

    def truth(self, users: Sequence[UserValues], device: torch.device | str = "cpu") -> torch.Tensor:
        """(B, W) int32 truth table of B users (W = ceil(size / 32)): bit c set when the user holds a value of
        clause c. Read under the index's read lock, with the refs it is tested against."""
        with self._lock:
            packed = self._truth(users)
        return torch.from_numpy(packed).to(device)

    def _truth(self, users: Sequence[UserValues]) -> np.ndarray:
        words = (self.size + 31) // 32
        held = np.zeros((len(users), words * 32), dtype=bool)
        for b, values in enumerate(users):
            for name, indices in values.items():
                c = self._category[name]
                for v in indices:
                    clauses = self._posting_array(c, v)
                    if clauses is not None:
                        held[b, clauses] = True
        if self._compounds:
            ids, refs = self._compounds_padded()
            held[:, ids] = (held[:, refs >> 1] ^ (refs & 1).astype(bool)).all(-1)
        return np.packbits(held, axis=1, bitorder="little").view("<i4").copy()

    def _posting_array(self, c: int, v: int) -> np.ndarray | None:
        key = (c, v)
        if key not in self._arrays:
            held = self._postings.get(key)
            if held is None:
                return None
            self._arrays[key] = np.fromiter(held, dtype=np.int64, count=len(held))
        return self._arrays[key]

    def _compounds_padded(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids (K,) int64, member refs (K, L) int64, ALWAYS padded) of the compound clauses."""
        if self._compound_table is None:
            members = list(self._compounds.values())
            refs = np.full((len(members), max(map(len, members))), ALWAYS, dtype=np.int64)
            for k, m in enumerate(members):
                refs[k, : len(m)] = m
            self._compound_table = (np.array(list(self._compounds), dtype=np.int64), refs)
        return self._compound_table

    def describe(self, refs: np.ndarray) -> list[dict]:
        """A row of refs (C,) as readable clauses: {"category", "values" (indices), "negate"}; a compound
        is expanded into its members."""
        out = []
        for ref in np.asarray(refs).tolist():
            if ref == ALWAYS:
                continue
            c, content = self._keys[ref >> 1]
            if c == COMPOUND:
                out += self.describe(np.array(content))
            else:
                out.append({"category": self.schema.categories[c].name, "values": list(content), "negate": bool(ref & 1)})
        return out

    # -- state (for snapshots) -------------------------------------------------------------------

    def export_state(self, live_refs: np.ndarray) -> dict[str, torch.Tensor]:
        """Every id's category (FREE, COMPOUND or an index) and content, as CSR: offsets (size + 1,), data; only the
        clauses the live rows of refs (n, C) reach (a compound's members too), the others FREE: a writer may hold
        clauses taken for rows not written yet, or not yet released from rows it overwrote."""
        with self._lock:
            reached = np.zeros(self.size, dtype=bool)
            pending = np.unique(np.asarray(live_refs).ravel() >> 1)
            while pending.size:
                reached[pending] = True
                members = [ref >> 1 for c in pending.tolist() if c in self._compounds for ref in self._compounds[c]]
                pending = np.setdiff1d(np.array(members, dtype=np.int64), np.flatnonzero(reached))
            reached[0] = False  # ALWAYS pads every row: clause 0 is nobody's
            if any(self._keys[c] is None for c in np.flatnonzero(reached).tolist()):
                raise ValueError("a live row refers to a free clause id: the index's clause references are corrupt")
            keys = [k if reached[c] else None for c, k in enumerate(self._keys)]
        category = np.array([FREE if k is None else k[0] for k in keys], dtype=np.int32)
        lengths = [0 if k is None else len(k[1]) for k in keys]
        data = [x for k in keys if k is not None for x in k[1]]
        return {"clauses.category": torch.from_numpy(category),
                "clauses.offsets": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
                "clauses.data": torch.tensor(data, dtype=torch.int64)}

    @classmethod
    def from_state(cls, schema: Schema, width: int, tensors: dict[str, torch.Tensor], live_refs: np.ndarray) -> "ClauseDictionary":
        """The dictionary of export_state, its reference counts taken from the live rows of refs (n, C)."""
        out = cls(schema, width)
        category = tensors["clauses.category"].tolist()
        offsets, data = tensors["clauses.offsets"].tolist(), tensors["clauses.data"].tolist()
        keys = [None if c == FREE else (c, tuple(data[a:b])) for c, a, b in zip(category, offsets, offsets[1:])]
        if keys and keys[0] is not None:
            raise ValueError("clause 0 must be free")
        for clause in range(1, len(keys)):
            out._grow()
        for clause, key in enumerate(keys):  # compounds after their members: ids were reused in any order
            if key is not None and key[0] != COMPOUND:
                out._restore(clause, key)
        for clause, key in enumerate(keys):
            if key is not None and key[0] == COMPOUND:
                out._restore(clause, key)
        out._free = [c for c in range(len(keys) - 1, 0, -1) if keys[c] is None]
        for ref in live_refs.ravel().tolist():
            if ref != ALWAYS:
                if not 0 <= ref >> 1 < len(keys) or keys[ref >> 1] is None:
                    raise ValueError(f"an ad refers to clause {ref >> 1}, which the dictionary does not hold")
                out._count[ref >> 1] += 1
        if any(key is not None and not n for key, n in zip(out._keys, out._count)):
            raise ValueError("a clause no ad refers to")
        return out

    def _restore(self, clause: int, key: Key) -> None:
        """Put `key` back at id `clause` with the references its own structure holds (a compound's members)."""
        self._keys[clause] = key
        self._ids[key] = clause
        if key[0] == COMPOUND:
            self._compounds[clause] = key[1]
            for ref in key[1]:
                self._count[ref >> 1] += 1
        else:
            for v in key[1]:
                self._postings.setdefault((key[0], v), set()).add(clause)
        self.hashes[clause] = _stable_hash(self._content(key))

