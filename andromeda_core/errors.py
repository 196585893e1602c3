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
    """Malformed event, request or schema. `field` names the offending field path."""

    category = ErrorCategory.INVALID_INPUT


class NotFound(AndromedaError):
    category = ErrorCategory.NOT_FOUND


class SnapshotCorrupt(AndromedaError):
    """A snapshot file failed its checksum or could not be parsed."""

    category = ErrorCategory.CORRUPT
