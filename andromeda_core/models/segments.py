"""A user's segments: the cohort ids and declared attribute values its segment expert reads, hashed.

Cohort ids come with the request (`user.cohorts`; repeats left out). Declared attributes are the schema's enum-kind user
categories (interests, behaviors, country, language, ...): each value of the vocabulary is the token
"category=value" (values outside it, which targeting ignores too, and repeats are left out).
Id-kind categories (custom audiences, city) and ordinals (age) are left out: too many distinct values
for a hashed table, or numbers. Tokens hash with CRC-32 (stable across processes and machines); the
tower takes them modulo its table size."""
from __future__ import annotations

import zlib
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from andromeda_core.models.text import encode_texts_cached
from andromeda_core.schema import Schema, attribute_values

SEGMENTS = 32  # at most this many per user: cohorts first, then attributes in schema order
DESCRIBED = ("interests", "behaviors")  # user categories whose values are words: their text is read too


def segment_ids(cohorts: Sequence[int], attributes: Mapping[str, Any], schema: Schema) -> list[int]:
    """A user's cohorts and declared enum attributes -> up to SEGMENTS non-negative int ids."""
    tokens = [f"cohort={c}" for c in dict.fromkeys(cohorts)]  # once each, in order, as the attributes
    for category in schema.categories:
        if category.kind == "enum" and category.source == "user" and category.name in attributes:
            values = attributes[category.name]
            values = dict.fromkeys(attribute_values(values))  # once each, in order
            tokens += [f"{category.name}={v}" for v in values if category.value_index(v) is not None]
    return [_hash(t) for t in tokens[:SEGMENTS]]


def _hash(token: str) -> int:
    return zlib.crc32(token.encode())


def described_values(schema: Schema) -> tuple[np.ndarray, list[str]]:
    """(hashes (V,) int64 ascending, texts (V,)): every value of the schema's DESCRIBED user categories, as
    segment_ids hashes its token and as words ("running_shoes" -> "running shoes")."""
    pairs = sorted({_hash(f"{c.name}={v}"): v.replace("_", " ") for c in schema.categories
                    if c.name in DESCRIBED and c.kind == "enum" and c.source == "user" for v in c.vocabulary}.items())
    return np.array([h for h, _ in pairs], np.int64), [t for _, t in pairs]


@lru_cache(maxsize=4)
def described_table(schema: Schema) -> tuple[np.ndarray, np.ndarray]:
    """(hashes (V,) int64 ascending, texts (V, 384) float16 unit MiniLM embeddings) of described_values."""
    hashes, texts = described_values(schema)
    return hashes, encode_texts_cached(texts, progress=False)
