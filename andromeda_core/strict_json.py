"""JSON read as its exchanges are meant: no key twice in one object. Parsers disagree on which of two values of one
key counts (Python's keeps the last, others the first), so a proxy and this service, or a file's author and the CLI,
could read different data from the same bytes."""
from __future__ import annotations

import json
import re
from typing import Any, Callable

from andromeda_core.errors import InvalidInput


class NotJSON(ValueError):
    """Text json.loads takes that JSON (RFC 8259) does not: a key twice, NaN or Infinity; or a number it reads as
    another (a nonzero one below float64's range, as 0)."""


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


class _Underflow(float):
    """0.0 read from a nonzero number literal below float64's smallest (1e-400): marked, to be refused by loads."""

    def __new__(cls, literal: str) -> "_Underflow":
        number = super().__new__(cls, 0.0)
        number.literal = literal
        return number


def path_of(doc: Any, wanted: Callable[[Any], bool], path: str = "") -> tuple[str, Any] | None:
    """(the field path of the first value in doc that is `wanted`, e.g. `ad.bid` or `events[1]`; "" for doc itself,
    that value), or None."""
    if wanted(doc):
        return path, doc
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, (list, tuple)) else ()
    for key, value in items:
        if found := path_of(value, wanted, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else
                            str(key)):
            return found
    return None


UNDERFLOW_HINT = r"[eE]-0*[1-9][0-9]{2}|0{100}"  # an exponent of -100 or less, or 100 zeros in a row: with fewer of
# both a nonzero number is at least 1e-200, so only text that has one pays for the parse_float hook
_HINTS = {str: re.compile(UNDERFLOW_HINT), bytes: re.compile(UNDERFLOW_HINT.encode())}


def loads(text: str | bytes) -> Any:
    """json.loads refusing a key twice, NaN or Infinity, and a nonzero number too small for a float64 (NotJSON, a
    ValueError; until 2026-12-07 a bid of 1e-400 was read, and stored, as 0, where 1e-50 is refused);
    json.JSONDecodeError as json.loads."""
    underflows = []

    def number(literal: str) -> float:
        value = float(literal)
        if value == 0 and any(c in "123456789" for c in literal.lower().partition("e")[0]):
            underflows.append(_Underflow(literal))
            return underflows[-1]
        return value

    hook = number if _HINTS[type(text)].search(text) else None  # a Python call per float costs (+50% on its parse)
    doc = json.loads(text, object_pairs_hook=unique_keys, parse_constant=no_constant, parse_float=hook)
    if underflows and (found := path_of(doc, lambda value: isinstance(value, _Underflow))):
        raise NotJSON(f"the number {found[1].literal[:50]} at {found[0] or 'the top'} is too small for a float64 and "
                      f"would read as 0: send 0, or a number float64 holds (from about 5e-324)")
    return doc


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
