"""A user's segments: the cohort ids and declared attribute values its segment expert reads, hashed.

Cohort ids come with the request (`user.cohorts`). Declared attributes are the schema's enum-kind user
categories (interests, behaviors, country, language, ...): each value of the vocabulary is the token
"category=value" (values outside it, which targeting ignores too, and repeats are left out).
Id-kind categories (custom audiences, city) and ordinals (age) are left out: too many distinct values
for a hashed table, or numbers. Tokens hash with CRC-32 (stable across processes and machines); the
tower takes them modulo its table size."""
from __future__ import annotations

import zlib
from typing import Any, Mapping, Sequence

from andromeda_core.schema import Schema

SEGMENTS = 32  # at most this many per user: cohorts first, then attributes in schema order


def segment_ids(cohorts: Sequence[int], attributes: Mapping[str, Any], schema: Schema) -> list[int]:
    """A user's cohorts and declared enum attributes -> up to SEGMENTS non-negative int ids."""
    tokens = [f"cohort={c}" for c in cohorts]
    for category in schema.categories:
        if category.kind == "enum" and category.source == "user" and category.name in attributes:
            values = attributes[category.name]
            values = dict.fromkeys(values if isinstance(values, list) else [values])  # once each, in order
            tokens += [f"{category.name}={v}" for v in values if category.value_index(v) is not None]
    return [zlib.crc32(t.encode()) for t in tokens[:SEGMENTS]]
