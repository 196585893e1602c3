"""JSON read as its exchanges are meant: no key twice in one object. Parsers disagree on which of two values of one
key counts (Python's keeps the last, others the first), so a proxy and this service, or a file's author and the CLI,
could read different data from the same bytes."""
from __future__ import annotations

import json
from typing import Any


class NotJSON(ValueError):
    """Text json.loads takes that JSON (RFC 8259) does not: a key twice, NaN or Infinity."""


class DuplicateKey(NotJSON):
    """A JSON object names a key twice."""


def no_constant(name: str) -> float:
    """json.loads' parse_constant: NaN, Infinity and -Infinity are refused."""
    raise NotJSON(f"{name} is not a JSON number")


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook: the object, or DuplicateKey naming the key."""
    out = dict(pairs)
    if len(out) < len(pairs):  # rare: then find the key
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKey(f'the key "{key[:100]}" appears twice in one object: send each key once')
            seen.add(key)
    return out


def loads(text: str | bytes) -> Any:
    """json.loads refusing a key twice and NaN or Infinity (NotJSON, a ValueError); json.JSONDecodeError as
    json.loads."""
    return json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant)
