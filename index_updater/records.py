"""Stream records: one compiled ad event per Redis stream entry, in the stream of the ad's shard.

Streams: shard s of a stream `base` is `shard_stream(base, s)`; poison entries go to
`dead_letter_stream(base)`. One stream per shard lets shards live on different Redis Cluster nodes.

Fields (bytes): op, ad_id, version, shard, published_ms, schema (name:version), model (the ad tower's
tag), dim, event (the validated event JSON) and, for upserts, payload: the compiled targeting rows, the
satisfiable flag and the ad-tower embedding as little-endian arrays behind a JSON header (4-byte header
length, then {"arrays": [[name, dtype, shape], ...]}, then the raw bytes in that order). Consumers never
re-run the ad tower; they decode a whole read at once (`EntryDecoder`), reading together the payloads
that share a header.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from andromeda_core.errors import InvalidInput, sendable
from andromeda_core.ops import UPSERT, IndexOp, OpBatch, OpRow, PreparedAd
from andromeda_core.schema import Schema
from andromeda_core.sharding import shard_of
from andromeda_core.targeting import targeting_columns
from andromeda_core.types import UpsertEvent, parse_event
from andromeda_core.writer import largest_stored


class InvalidRecord(InvalidInput):
    """A stream entry that cannot be applied; it goes to the dead-letter stream. Its message and field are cut to
    ECHOED_CHARS (both may echo the entry: until 2026-12-07 a 20 MB `model` field made a 20 MB dead-letter reason, and
    as much in each replica's log)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(sendable(message), field and sendable(field))


DTYPES = {"i4": np.dtype("<i4"), "i2": np.dtype("<i2"), "u1": np.dtype("u1"), "f4": np.dtype("<f4")}


def shard_stream(base: str, shard: int) -> str:
    """The stream that carries the entries of shard `shard` (the one place that names it)."""
    return f"{base}:{shard}"


def dead_letter_stream(base: str) -> str:
    """Where consumers of every shard of `base` put the entries they cannot apply."""
    return f"{base}:dead-letters"


def text(value: bytes | str) -> str:
    """A Redis reply as str: redis-py gives bytes unless the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value


def layout_key(base: str) -> str:
    """Redis hash where the replicas reading the shard streams of `base` record the layout they read them with
    (stream_layout), so that a publisher can check it writes what they read; it expires when none reports."""
    return f"{base}:layout"


def stream_layout(shards: int, schema: Schema, model: str, dim: int) -> dict[str, str]:
    """What an entry must agree with to be applied: the shard count, schema, model and vector dims."""
    return {"shards": str(shards), "schema": schema_tag(schema), "model": model, "dim": str(dim)}


def applied_key(base: str, shard: int) -> str:
    """Redis hash where the replicas of shard `shard` report how far they have applied (replica -> "id time")."""
    return f"{shard_stream(base, shard)}:applied"


def snapshot_writer_key(base: str, shard: int) -> str:
    """Redis key the replicas of shard `shard` claim, one per round of snapshot_every_s, to write its snapshot."""
    return f"{shard_stream(base, shard)}:snapshot-writer"


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    header, blobs = [], []
    for name, array in arrays.items():
        code = next(c for c, d in DTYPES.items() if d == array.dtype.newbyteorder("<"))
        header.append([name, code, list(array.shape)])
        blobs.append(np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes())
    head = json.dumps({"arrays": header}, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "little") + head + b"".join(blobs)


def schema_tag(schema: Schema) -> str:
    """name:version:fingerprint: an entry's compiled targeting means values by their place in the schema's
    vocabularies, so one written under the same name and version with other vocabularies is another schema's."""
    return f"{schema.name}:{schema.version}:{schema.fingerprint}"


def encode(op: IndexOp, shards: int, schema: Schema, model: str, dim: int,
           now_ms: int | None = None) -> dict[str, bytes | str | int]:
    """An index op -> stream entry fields."""
    is_upsert = isinstance(op, PreparedAd)
    event = UpsertEvent(op="upsert", ad=op.ad) if is_upsert else op
    ad_id = op.ad.ad_id if is_upsert else op.ad_id
    fields: dict[str, bytes | str | int] = {
        "op": event.op, "ad_id": ad_id, "version": op.ad.version if is_upsert else op.version,
        "shard": shard_of(ad_id, shards), "published_ms": now_ms if now_ms is not None else int(time.time() * 1000),
        "schema": schema_tag(schema), "model": model, "dim": dim, "event": event.model_dump_json(),
    }
    if is_upsert:
        arrays = {name: np.ascontiguousarray(row) for name, row in op.targeting.rows.items()}
        arrays["satisfiable"] = np.array([op.targeting.satisfiable], dtype=np.uint8)
        arrays["embedding"] = np.ascontiguousarray(op.embedding, dtype=np.float32)
        fields["payload"] = pack_arrays(arrays)
    return fields


def _text(fields: dict[bytes, bytes], key: str) -> str:
    try:
        return fields[key.encode()].decode()
    except KeyError:
        raise InvalidRecord("missing field", key) from None
    except UnicodeDecodeError:
        raise InvalidRecord("not UTF-8", key) from None


def header(fields: dict[bytes, bytes]) -> tuple[int, int]:
    """(shard, published_ms) of an entry, read without decoding the rest; InvalidRecord naming the field that is
    missing, not an integer, or out of its range (a publish time past 2**53 ms has no float seconds to wait from)."""
    return _integer(fields, "shard", 1 << 31), _integer(fields, "published_ms", 1 << 53)


def _integer(fields: dict[bytes, bytes], key: str, bound: int) -> int:
    """The integer field `key`, in [0, bound); raises InvalidRecord."""
    try:
        value = int(fields[key.encode()])
    except KeyError:
        raise InvalidRecord("missing field", key) from None
    except ValueError:
        raise InvalidRecord("not an integer", key) from None
    if not 0 <= value < bound:
        raise InvalidRecord(f"must be at least 0 and less than {bound}", key)
    return value


Entry = tuple[bytes | str, dict[bytes, bytes]]  # (stream id, fields) as XREAD returns it
GOES_ON = "more"  # field of each entry of a shard's part of a published batch but its last (value 1): an entry
# without it ends its batch (each entry published before 2026-12-07 ends one), where a replica's read may end


def marked_batch(entries: Sequence[dict]) -> list[dict]:
    """A shard's part of a batch (n entries' fields) -> the same with GOES_ON on all but the last."""
    return [{**fields, GOES_ON: 1} for fields in entries[:-1]] + list(entries[-1:])


def whole_batches(entries: Sequence[Entry]) -> int:
    """How many of a read's entries come before the first entry after its last batch end (0: none ends one)."""
    flag = GOES_ON.encode()
    return next((i + 1 for i in range(len(entries) - 1, -1, -1) if flag not in entries[i][1]), 0)


@dataclass(frozen=True)
class DecodedRead:
    """The entries of one read: the ops to apply as one batch, and the poison ones."""

    batch: OpBatch
    positions: list[int]  # position in the read of each op of `batch`
    published_ms: list[int]  # publish time of each op of `batch`
    dead: list[tuple[int, InvalidRecord]]  # position in the read of each entry that cannot be applied, and why


class EntryDecoder:
    """Decodes the entries of one shard's stream for an index of `schema`, `model` embeddings of width `dim`.

    Payloads written for the same targeting categories share a header; each distinct header is checked once
    (and cached), and the payloads that share it are read together through one structured numpy dtype."""

    MAX_LAYOUTS = 4096  # distinct headers kept; a stream of ever-new ones cannot grow the cache without bound

    def __init__(self, schema: Schema, model: str, dim: int, shard: int = 0, shards: int = 1,
                 largest: float = largest_stored(torch.float32)):
        self.dim, self.shard, self.shards, self.largest = dim, shard, shards, largest  # largest: what the table's
        # storage holds finite (writer.largest_stored)
        self.columns = targeting_columns(schema)
        self._tags = {"schema": schema_tag(schema), "model": model, "dim": str(dim)}
        self._tag_bytes = {key.encode(): value.encode() for key, value in self._tags.items()}
        self._layouts: dict[bytes, np.dtype | InvalidRecord] = {}

    def decode(self, entries: Sequence[Entry]) -> DecodedRead:
        """A read -> one OpBatch of its good entries, in stream order; poison entries are set aside."""
        ops, positions, published, payloads, dead = [], [], [], [], []
        for i, (_, fields) in enumerate(entries):
            try:
                published_ms, op = self._entry(fields)
                if op.code == UPSERT:
                    payloads.append(fields[b"payload"])
            except InvalidRecord as exc:
                dead.append((i, exc))
                continue
            ops.append(op)
            positions.append(i)
            published.append(published_ms)
        satisfiable, embedding, targeting, unreadable = self._rows(payloads)
        batch = OpBatch.build(ops, satisfiable, embedding, targeting)
        if unreadable:  # drop the upserts whose payload could not be read
            upserts = np.flatnonzero(batch.op == UPSERT)
            bad = {int(upserts[k]): exc for k, exc in unreadable.items()}
            keep = [j for j in range(len(ops)) if j not in bad]
            dead = sorted(dead + [(positions[j], exc) for j, exc in bad.items()], key=lambda d: d[0])
            batch, positions, published = batch.take(keep), [positions[j] for j in keep], [published[j] for j in keep]
        return DecodedRead(batch, positions, published, dead)

    def _entry(self, fields: dict[bytes, bytes]) -> tuple[int, OpRow]:
        """(published_ms, op) of one entry; raises InvalidRecord."""
        _, published_ms = header(fields)
        for key, value in self._tag_bytes.items():
            if fields.get(key) != value:
                self._refuse(fields, key.decode())
        try:
            event = parse_event(fields[b"event"], "event", strict=False)  # as the publisher wrote it
        except KeyError:
            raise InvalidRecord("missing field", "event") from None
        except InvalidInput as exc:
            raise InvalidRecord(exc.message, exc.field) from None
        op = OpRow.of(event.ad if isinstance(event, UpsertEvent) else event)
        owner = shard_of(op.ad_id, self.shards)
        if owner != self.shard:  # e.g. published with another shard count
            raise InvalidRecord(f"ad {op.ad_id} belongs to shard {owner} of {self.shards}", "ad_id")
        if op.code == UPSERT and b"payload" not in fields:
            raise InvalidRecord("upsert without compiled payload", "payload")
        return published_ms, op

    def _refuse(self, fields: dict[bytes, bytes], key: str) -> None:
        found, wanted = _text(fields, key), self._tags[key]
        raise InvalidRecord({"schema": f"written for schema {found}, this index uses {wanted}",
                             "model": f"embedded by model {found}, this index serves {wanted}",
                             "dim": f"embedding width {found}, this index stores {wanted}"}[key], key)

    def _rows(self, payloads: list[bytes]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray], dict[int, InvalidRecord]]:
        """u payloads -> satisfiable (u,) bool, embedding (u, D) float32, the targeting columns they mention
        (u, *shape) int32 (fill elsewhere), and the unreadable ones by position."""
        u = len(payloads)
        satisfiable, embedding = np.ones(u, dtype=bool), np.zeros((u, self.dim), dtype=np.float32)
        targeting: dict[str, np.ndarray] = {}
        unreadable: dict[int, InvalidRecord] = {}
        groups: dict[bytes, tuple[np.dtype, list[int]]] = {}
        for k, payload in enumerate(payloads):
            try:
                head, layout = self._layout_of(payload)
            except InvalidRecord as exc:
                unreadable[k] = exc
                continue
            groups.setdefault(head, (layout, []))[1].append(k)
        for head, (layout, members) in groups.items():
            records = np.frombuffer(b"".join(payloads[k][4 + len(head):] for k in members), dtype=layout)
            at = np.array(members)
            for name in records.dtype.names:
                if name == "embedding":
                    embedding[at] = records[name]
                elif name == "satisfiable":
                    satisfiable[at] = records[name][:, 0] != 0
                else:
                    if name not in targeting:
                        spec = self.columns[name]
                        targeting[name] = np.full((u, *spec.shape), spec.fill, dtype=np.int32)
                    targeting[name][at] = records[name]
        for k in np.flatnonzero(~(np.abs(embedding) <= self.largest).all(1)).tolist():  # NaN too
            unreadable[k] = InvalidRecord(f"embedding must be {self.dim} finite floats of magnitude at most "
                                          f"{self.largest:g} (what this index's storage holds)", "payload.embedding")
        return satisfiable, embedding, targeting, unreadable

    def _layout_of(self, payload: bytes) -> tuple[bytes, np.dtype]:
        """(header, layout) of a payload whose layout fits this index and whose length matches it."""
        size = int.from_bytes(payload[:4], "little")
        head = payload[4:4 + size]
        layout = self._layouts.get(head)
        if layout is None:
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            layout = self._layouts[head] = self._layout(head)
        if isinstance(layout, InvalidRecord):
            raise layout
        body = len(payload) - 4 - len(head)
        if body != layout.itemsize:
            raise InvalidRecord(f"unreadable compiled payload: {body} bytes of arrays, the header describes "
                                f"{layout.itemsize}", "payload")
        return head, layout

    def _layout(self, head: bytes) -> np.dtype | InvalidRecord:
        """The structured dtype of one payload with this header, or why it does not fit this index."""
        try:
            arrays = [(str(name), DTYPES[code], tuple(shape)) for name, code, shape in json.loads(head)["arrays"]]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:  # any malformed header (nested too deeply:
            return InvalidRecord(f"unreadable compiled payload: {exc!r}", "payload")  # RecursionError)
        expected = {"embedding": ((self.dim,), "f"), "satisfiable": ((1,), "u"),
                    **{name: (spec.shape, "i") for name, spec in self.columns.items()}}
        names = [name for name, _, _ in arrays]
        if "embedding" not in names or len(set(names)) != len(names):
            return InvalidRecord(f"embedding must be {self.dim} finite floats, once", "payload.embedding")
        for name, dtype, shape in arrays:
            if expected.get(name, (None, None)) != (shape, dtype.kind):
                field = "payload.embedding" if name == "embedding" else "payload"
                return InvalidRecord(f"array {name} ({dtype}, {list(shape)}) does not fit this index", field)
        return np.dtype([(name, dtype, expected[name][0]) for name, dtype, _ in arrays])
