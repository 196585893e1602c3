"""Stream records: one compiled ad event per Redis stream entry, in the stream of the ad's shard.

Streams: shard s of a stream `base` is `shard_stream(base, s)`; poison entries go to
`dead_letter_stream(base)`. One stream per shard lets shards live on different Redis Cluster nodes.

Fields (bytes): op, ad_id, version, shard, published_ms, schema (name:version), model (the ad tower's
tag), dim, event (the
validated event JSON) and, for upserts, payload: the compiled targeting rows, the satisfiable flag and
the ad-tower embedding as little-endian arrays behind a JSON header (4-byte header length, then
{"arrays": [[name, dtype, shape], ...]}, then the raw bytes in that order). Consumers never re-run
the ad tower.
"""
from __future__ import annotations

import json
import math
import time

import numpy as np

from andromeda_core.errors import InvalidInput
from andromeda_core.index import IndexOp, PreparedAd
from andromeda_core.schema import Schema
from andromeda_core.sharding import shard_of
from andromeda_core.targeting import CompiledTargeting, targeting_columns
from andromeda_core.types import UpsertEvent, parse_event


class InvalidRecord(InvalidInput):
    """A stream entry that cannot be applied; it goes to the dead-letter stream."""


DTYPES = {"i4": np.dtype("<i4"), "i2": np.dtype("<i2"), "u1": np.dtype("u1"), "f4": np.dtype("<f4")}


def shard_stream(base: str, shard: int) -> str:
    """The stream that carries the entries of shard `shard` (the one place that names it)."""
    return f"{base}:{shard}"


def dead_letter_stream(base: str) -> str:
    """Where consumers of every shard of `base` put the entries they cannot apply."""
    return f"{base}:dead-letters"


def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    header, blobs = [], []
    for name, array in arrays.items():
        code = next(c for c, d in DTYPES.items() if d == array.dtype.newbyteorder("<"))
        header.append([name, code, list(array.shape)])
        blobs.append(np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes())
    head = json.dumps({"arrays": header}, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "little") + head + b"".join(blobs)


def unpack_arrays(payload: bytes) -> dict[str, np.ndarray]:
    """Inverse of pack_arrays; raises ValueError on any malformed payload."""
    size = int.from_bytes(payload[:4], "little")
    spec = json.loads(payload[4:4 + size])["arrays"]
    out, offset = {}, 4 + size
    for name, code, shape in spec:
        dtype = DTYPES[code]
        if not all(isinstance(d, int) and 0 <= d < 1 << 20 for d in shape):
            raise ValueError(f"array {name} has a bad shape {shape}")
        count = math.prod(shape)
        end = offset + count * dtype.itemsize
        if end > len(payload):
            raise ValueError(f"array {name} runs past the payload")
        out[name] = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
        offset = end
    if offset != len(payload):
        raise ValueError("trailing bytes after the arrays")
    return out


def schema_tag(schema: Schema) -> str:
    return f"{schema.name}:{schema.version}"


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


def decode(fields: dict[bytes, bytes], schema: Schema, model: str, dim: int, columns: dict | None = None) -> IndexOp:
    """Stream entry fields -> index op; raises InvalidRecord naming the field.
    `columns`: targeting_columns(schema), passed in by callers that decode many entries."""
    if _text(fields, "schema") != schema_tag(schema):
        raise InvalidRecord(f"written for schema {_text(fields, 'schema')}, this index uses {schema_tag(schema)}", "schema")
    if _text(fields, "model") != model:
        raise InvalidRecord(f"embedded by model {_text(fields, 'model')}, this index serves {model}", "model")
    if _text(fields, "dim") != str(dim):
        raise InvalidRecord(f"embedding width {_text(fields, 'dim')}, this index stores {dim}", "dim")
    event = parse_event(_text(fields, "event"), "event")
    if not isinstance(event, UpsertEvent):
        return event
    try:
        arrays = unpack_arrays(fields[b"payload"])
    except KeyError:
        raise InvalidRecord("upsert without compiled payload", "payload") from None
    except (ValueError, KeyError, TypeError, IndexError) as exc:  # any malformed payload
        raise InvalidRecord(f"unreadable compiled payload: {exc}", "payload") from None
    columns = columns or targeting_columns(schema)
    rows = {}
    for name, row in arrays.items():
        if name in ("satisfiable", "embedding"):
            continue
        if name not in columns or tuple(row.shape) != columns[name].shape:
            raise InvalidRecord(f"column {name} of shape {row.shape} does not fit the schema", "payload")
        rows[name] = row
    embedding = arrays.get("embedding")
    if embedding is None or embedding.shape != (dim,) or not np.isfinite(embedding).all():
        raise InvalidRecord(f"embedding must be {dim} finite floats", "payload.embedding")
    satisfiable = arrays.get("satisfiable")
    return PreparedAd(event.ad, CompiledTargeting(rows, bool(satisfiable[0]) if satisfiable is not None else True), embedding)


def header(fields: dict[bytes, bytes]) -> tuple[int, int]:
    """(shard, published_ms) of an entry, read without decoding the rest."""
    try:
        return int(fields[b"shard"]), int(fields[b"published_ms"])
    except (KeyError, ValueError):
        raise InvalidRecord("missing or malformed shard/published_ms", "shard") from None

