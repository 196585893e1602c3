"""JSON read as its exchanges are meant: no key twice in one object. Parsers disagree on which of two values of one
key counts (Python's keeps the last, others the first), so a proxy and this service, or a file's author and the CLI,
could read different data from the same bytes."""
from __future__ import annotations

import json
from typing import Any

from andromeda_core.errors import InvalidInput


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


def read(text: str | bytes, where: str) -> Any:
    """loads, every refusal an InvalidInput naming `where`: not UTF-8 (bytes), not JSON, nested too deeply, a key
    twice, NaN or Infinity, an integer of more digits than Python converts."""
    try:
        return loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"not UTF-8 (byte {exc.start})", where) from None
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"not JSON: {exc.msg} at character {exc.pos}", where) from None
    except RecursionError:
        raise InvalidInput("JSON nested too deeply", where) from None
    except NotJSON as exc:
        raise InvalidInput(str(exc), where) from None
    except ValueError:  # json's only other error
        raise InvalidInput("a number has thousands of digits", where) from None
