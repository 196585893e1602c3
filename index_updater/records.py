"""Stream records: one compiled ad event per Redis stream entry.

Fields (bytes): op, ad_id, version, shard, published_ms, schema (name:version), dim, event (the
validated event JSON) and, for upserts, payload: a safetensors blob with the compiled targeting rows,
the satisfiable flag and the ad-tower embedding. Consumers never re-run the ad tower.
"""
from __future__ import annotations

import json
import time

import numpy as np
from safetensors.numpy import load as load_arrays
from safetensors.numpy import save as save_arrays

from andromeda_core.errors import InvalidInput
from andromeda_core.index import IndexOp, PreparedAd
from andromeda_core.schema import Schema
from andromeda_core.sharding import shard_of
from andromeda_core.targeting import CompiledTargeting, targeting_columns
from andromeda_core.types import UpsertEvent, parse_event


class InvalidRecord(InvalidInput):
    """A stream entry that cannot be applied; it goes to the dead-letter stream."""


def schema_tag(schema: Schema) -> str:
    return f"{schema.name}:{schema.version}"


def encode(op: IndexOp, shards: int, schema: Schema, dim: int, now_ms: int | None = None) -> dict[str, bytes | str | int]:
    """An index op -> stream entry fields."""
    is_upsert = isinstance(op, PreparedAd)
    event = UpsertEvent(op="upsert", ad=op.ad) if is_upsert else op
    ad_id = op.ad.ad_id if is_upsert else op.ad_id
    fields: dict[str, bytes | str | int] = {
        "op": event.op, "ad_id": ad_id, "version": op.ad.version if is_upsert else op.version,
        "shard": shard_of(ad_id, shards), "published_ms": now_ms if now_ms is not None else int(time.time() * 1000),
        "schema": schema_tag(schema), "dim": dim, "event": event.model_dump_json(),
    }
    if is_upsert:
        arrays = {name: np.ascontiguousarray(row) for name, row in op.targeting.rows.items()}
        arrays["satisfiable"] = np.array([op.targeting.satisfiable], dtype=np.uint8)
        arrays["embedding"] = np.ascontiguousarray(op.embedding, dtype=np.float32)
        fields["payload"] = save_arrays(arrays)
    return fields


def _text(fields: dict[bytes, bytes], key: str) -> str:
    try:
        return fields[key.encode()].decode()
    except KeyError:
        raise InvalidRecord("missing field", key) from None
    except UnicodeDecodeError:
        raise InvalidRecord("not UTF-8", key) from None


def decode(fields: dict[bytes, bytes], schema: Schema, dim: int) -> IndexOp:
    """Stream entry fields -> index op; raises InvalidRecord naming the field."""
    if _text(fields, "schema") != schema_tag(schema):
        raise InvalidRecord(f"written for schema {_text(fields, 'schema')}, this index uses {schema_tag(schema)}", "schema")
    if _text(fields, "dim") != str(dim):
        raise InvalidRecord(f"embedding width {_text(fields, 'dim')}, this index stores {dim}", "dim")
    event = parse_event(_text(fields, "event"), "event")
    if not isinstance(event, UpsertEvent):
        return event
    try:
        arrays = load_arrays(fields[b"payload"])
    except KeyError:
        raise InvalidRecord("upsert without compiled payload", "payload") from None
    except Exception as exc:  # any malformed safetensors blob
        raise InvalidRecord(f"unreadable compiled payload: {exc}", "payload") from None
    columns = targeting_columns(schema)
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


def event_json(fields: dict[bytes, bytes]) -> dict:
    """The entry's event as JSON (for the dead-letter stream and inspection), best effort."""
    try:
        return json.loads(fields.get(b"event", b"{}"))
    except ValueError:
        return {}
