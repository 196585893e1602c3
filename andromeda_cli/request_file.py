"""Request files for `andromeda retrieve`: one JSON object or JSON lines, each request checked in full
(its targeting values too) before any work, an error naming the file, line and field."""
from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from andromeda_core import strict_json
from andromeda_core.errors import InvalidInput
from andromeda_core.schema import Schema
from andromeda_core.targeting import compile_user
from andromeda_core.types import RetrieveRequest, parse_request


def read_text(path: Path) -> str:
    data = path.read_bytes()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # as HTTP bodies may start with
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        line = exc.object[:exc.start].count(b"\n") + 1
        raise InvalidInput(f"not UTF-8 text (byte {bom + exc.start})", f"{path}:{line}") from None


def read_requests(path: Path, schema: Schema, k: int | None = None) -> list[RetrieveRequest]:
    """The requests in `path` (one JSON object, or one per line), with `k` overriding each one's k."""
    text = read_text(path)
    lines = [(f"{path}:{n}", line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise InvalidInput("no requests: the file is empty", str(path))
    whole = lines[0][0] if len(lines) == 1 else str(path)
    try:
        docs = [(whole, strict_json.read(text, whole))]
    except InvalidInput:
        if len(lines) == 1 or _goes_on(lines[0][1]):  # one document over several lines: its own error
            raise
        docs = [(where, strict_json.read(line, where)) for where, line in lines]
    return [_request(doc, where, schema, k) for where, doc in docs]


def _goes_on(line: str) -> bool:
    """Whether a line starts a JSON document that goes on past it (JSON cut off at the line's end, as the first line
    of a pretty-printed request is), rather than being one of JSON lines, good or broken within the line."""
    try:
        json.loads(line)
    except json.JSONDecodeError as exc:
        return exc.pos >= len(line.rstrip())
    except (ValueError, RecursionError):
        return False
    return False


def _request(doc: Any, where: str, schema: Schema, k: int | None) -> RetrieveRequest:
    if not isinstance(doc, dict):  # (parse_request would read a string as JSON text: a quoted request, until 2026-12-07)
        raise InvalidInput(f"a request is a JSON object, got {type(doc).__name__}", where)
    if k is not None:  # the override is validated like the request's own k
        doc = {**doc, "k": k}
    request = parse_request(doc, where)
    try:
        compile_user(schema, request.user.attributes, request.context.targeting_values())
    except InvalidInput as exc:
        raise exc.at(where) from None
    return request
