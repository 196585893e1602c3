"""A user's segments: the cohort ids and declared attribute values its segment expert reads, hashed.

Cohort ids come with the request (`user.cohorts`; repeats left out). Declared attributes are the schema's enum-kind user
categories (interests, behaviors, country, language, ...): each value of the vocabulary is the token
"category=value" (values outside it, which targeting ignores too, and repeats are left out).
Id-kind categories (custom audiences, city) and ordinals (age) are left out: too many distinct values
for a hashed table, or numbers. Tokens hash with CRC-32 (stable across processes and machines); the
tower takes them modulo its table size.

An ad's mentions: the described values (DESCRIBED categories' values) whose words occur whole, in order, in its
creative text ("title. body"), hashed as a user's segments are; the ad tower adds their segment embeddings, so an
ad that names an interest sits near the users who declare it."""
from __future__ import annotations

import re
import zlib
from functools import lru_cache
from typing import Any, Mapping, Sequence

import numpy as np

from andromeda_core.models.text import encode_texts_cached
from andromeda_core.schema import Schema, attribute_values

SEGMENTS = 32  # at most this many per user: cohorts first, then attributes in schema order
DESCRIBED = ("interests", "behaviors")  # user categories whose values are words: their text is read too
MENTIONS = 8  # at most this many per ad, in the order the text names them
WORD = re.compile(r"[^\W_]+")  # a word: letters and digits (a value's underscores separate words)


def words(text: str) -> tuple[str, ...]:
    """text -> its words, lower case."""
    return tuple(WORD.findall(text.lower()))


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


@lru_cache(maxsize=4)
def _phrases_by_first_word(schema: Schema) -> dict[str, list[tuple[int, dict[tuple[str, ...], int]]]]:
    """first word -> [(phrase length, {the described value's words: its hash})], longest first."""
    hashes, texts = described_values(schema)
    by_length: dict[str, dict[int, dict[tuple[str, ...], int]]] = {}
    for h, text in zip(hashes.tolist(), texts):
        phrase = words(text)
        if phrase:
            by_length.setdefault(phrase[0], {}).setdefault(len(phrase), {})[phrase] = h
    return {first: sorted(lengths.items(), reverse=True) for first, lengths in by_length.items()}


def mentions(texts: Sequence[str], schema: Schema) -> np.ndarray:
    """(N,) creative texts -> (N, MENTIONS) int64: the hashes of the described values each text mentions as whole
    words in order (case and underscores ignored), each once, in the order of their first word (the longer value
    first at one word); -1 pads. A few dict lookups per word of the text."""
    phrases = _phrases_by_first_word(schema)
    out = np.full((len(texts), MENTIONS), -1, np.int64)
    for i, text in enumerate(texts):
        w, found = words(text), {}
        for start, word in enumerate(w):
            for length, of_length in phrases.get(word, ()):
                h = of_length.get(w[start:start + length])
                if h is not None:
                    found[h] = None
            if len(found) >= MENTIONS:
                break
        out[i, :len(found)] = list(found)[:MENTIONS]
    return out
