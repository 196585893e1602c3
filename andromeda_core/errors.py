"""Error types. Each has a category; only deployments/ maps categories to HTTP status codes."""
from __future__ import annotations

from enum import Enum


class ErrorCategory(str, Enum):
    INVALID_INPUT = "invalid_input"  # the caller's fault; nothing was changed (HTTP 422)
    NOT_FOUND = "not_found"  # (HTTP 404)
    UNAUTHORIZED = "unauthorized"  # no valid credentials for a write (HTTP 401)
    CORRUPT = "corrupt"  # stored data failed its integrity check
    UNAVAILABLE = "unavailable"  # transient; retry (HTTP 503)


class AndromedaError(Exception):
    category = ErrorCategory.UNAVAILABLE

    def __init__(self, message: str, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class InvalidInput(AndromedaError):
    """Malformed event, request, schema, file or setting. `field` names the offending field path (or the
    option, or the environment variable)."""

    category = ErrorCategory.INVALID_INPUT

    def at(self, where: str) -> "InvalidInput":
        """This error with `where` (a file, a file and line) before its field path."""
        return type(self)(self.message, f"{where}.{self.field}" if self.field else where)


class NotFound(AndromedaError):
    category = ErrorCategory.NOT_FOUND


class SnapshotCorrupt(AndromedaError):
    """A snapshot file failed its checksum or could not be parsed."""

    category = ErrorCategory.CORRUPT


def shown(value: object, limit: int = 40) -> str:
    """`repr(value)` cut to `limit` characters, for echoing caller input in a message."""
    text = repr(value[:limit + 1] if isinstance(value, str) else value)  # cut first: a value may be megabytes
    return text if len(text) <= limit else f"{text[:limit]}..."
