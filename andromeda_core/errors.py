"""Error types. Each has a category; only deployments/ maps categories to HTTP status codes."""
from __future__ import annotations

from enum import Enum


class ErrorCategory(str, Enum):
    INVALID_INPUT = "invalid_input"  # the caller's fault; nothing was changed (HTTP 422)
    NOT_FOUND = "not_found"  # (HTTP 404)
    UNAUTHORIZED = "unauthorized"  # no valid credentials (HTTP 401)
    FORBIDDEN = "forbidden"  # valid credentials that may not do this (HTTP 403)
    TOO_LARGE = "too_large"  # a body past its limit (HTTP 413)
    RATE_LIMITED = "rate_limited"  # the caller's rate is spent; retry later (HTTP 429)
    CORRUPT = "corrupt"  # stored data failed its integrity check
    UNAVAILABLE = "unavailable"  # transient; retry (HTTP 503)
    OVERLOADED = "overloaded"  # a bounded queue is full; nothing was done, retry later (HTTP 503)
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the request's deadline passed; its work was abandoned (HTTP 504)


ECHOED_CHARS = 512  # the most characters of an error's field or message (either may echo a client's or an entry's input)


def sendable(text: str, limit: int | None = ECHOED_CHARS) -> str:
    """text that encodes as UTF-8 (a lone surrogate from a JSON escape such as "\\ud800" becomes that escape
    again), cut to `limit` characters (None: whole). A client's text goes back in errors and logs only this way:
    encoding the raw text raised inside the error handler, which then answered a plain-text 500. A cut text ends in
    "...", within the limit."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


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


class Unauthorized(AndromedaError):
    """A call without a valid bearer token where one is needed."""

    category = ErrorCategory.UNAUTHORIZED


class Forbidden(AndromedaError):
    """A valid token that may not do this (another advertiser's ad, a reader token writing)."""

    category = ErrorCategory.FORBIDDEN


class TooLarge(AndromedaError):
    category = ErrorCategory.TOO_LARGE


class RetryLater(AndromedaError):
    """A refusal the caller should retry after `retry_after` seconds (None: the service's default)."""

    def __init__(self, message: str, field: str | None = None, retry_after: float | None = None):
        super().__init__(message, field)
        self.retry_after = retry_after


class RateLimited(RetryLater):
    category = ErrorCategory.RATE_LIMITED


class Overloaded(RetryLater):
    """A bounded queue is full: nothing was done."""

    category = ErrorCategory.OVERLOADED


class DeadlineExceeded(AndromedaError):
    """The request's deadline passed before its answer was ready (the work was abandoned)."""

    category = ErrorCategory.DEADLINE_EXCEEDED


class SnapshotCorrupt(AndromedaError):
    """A snapshot file failed its checksum or could not be parsed."""

    category = ErrorCategory.CORRUPT


class OutOfMemory(AndromedaError, MemoryError):
    """A table that would not fit in its device's available memory, refused before it is allocated (filling it would
    get the process killed, not raise). Like any failed allocation, a later try may get past it (out_of_memory)."""


def shown(value: object, limit: int = 40) -> str:
    """`repr(value)` cut to `limit` characters, for echoing caller input in a message."""
    text = repr(value[:limit + 1] if isinstance(value, str) else value)  # cut first: a value may be megabytes
    return text if len(text) <= limit else f"{text[:limit]}..."


def out_of_memory(exc: BaseException) -> bool:
    """Whether exc says an allocation failed (a GPU's allocator, or the CPU's: a table that cannot grow), which a later
    try may get past: no fault of the data being loaded or applied."""
    import torch  # here: the CLI's errors need no torch

    allocation = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))  # torch < 2.5: only
    # torch.cuda has it (pyproject allows torch 2.4)
    return isinstance(exc, allocation) or (isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
