"""HTTP concerns of the ingress: the FastAPI app, the wire models only HTTP has (error body, batch
and publish results), the refusals only HTTP has (403, 413, 429, 503 overloaded, 504), the guard in
front of every request (body size, in-flight bound, deadline), and the one place errors map to HTTP
status codes."""
from __future__ import annotations

import asyncio
import codecs
import contextvars
import json
import logging
import time
import traceback
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel

from andromeda_core import strict_json
from andromeda_core.errors import (ECHOED_CHARS, AndromedaError, DeadlineExceeded, ErrorCategory, InvalidInput,
                                   Overloaded, TooLarge, Unauthorized, sendable, shown)
from andromeda_core.types import RetrieveResponse, error_field
from deployments.limits import Admission, LatencyShedder, past_wire_bound, retry_after

log = logging.getLogger(__name__)

STATUS = {ErrorCategory.INVALID_INPUT: 422, ErrorCategory.NOT_FOUND: 404, ErrorCategory.UNAUTHORIZED: 401,
          ErrorCategory.FORBIDDEN: 403, ErrorCategory.TOO_LARGE: 413, ErrorCategory.RATE_LIMITED: 429,
          ErrorCategory.UNAVAILABLE: 503, ErrorCategory.OVERLOADED: 503, ErrorCategory.DEADLINE_EXCEEDED: 504,
          ErrorCategory.CORRUPT: 500}
HEADERS = {401: {"WWW-Authenticate": "Bearer"}, 503: {"Retry-After": "1"}}


class ErrorDetail(BaseModel):
    category: str
    field: str | None = None
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class BatchResponse(BaseModel):
    responses: list[RetrieveResponse]


class PublishResponse(BaseModel):
    ids: list[str]
    """Stream ids of the appended events, in request order."""


class AdState(BaseModel):
    """GET /v1/ads/{ad_id}: the ad as its shard has indexed it."""

    ad_id: int
    version: int
    advertiser_id: int
    status: str
    satisfiable: bool
    start_time: int | None
    end_time: int | None
    bid: float
    slot: int
    shard: int
    servable_now: bool
    """Active, satisfiable and inside its time window now (targeting still decides per request)."""


class Health(BaseModel):
    status: str
    shards: list[dict] = []


TIMEOUT_HEADER = "X-Request-Timeout-Ms"
ONCE_HEADERS = (TIMEOUT_HEADER, "Authorization", "Content-Type")  # refused when sent twice
DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("deadline", default=None)
"""Wall-clock time (time.time()) by which the current request must be answered; set by the guard."""


def current_deadline() -> float | None:
    """The current request's deadline (time.time()), None outside a request. (Callers use this function,
    not DEADLINE: Ray pickles the router class by value, and a ContextVar cannot be pickled.)"""
    return DEADLINE.get()


def lift_deadline() -> None:
    """No deadline for the rest of the current request (a write: not bound by X-Request-Timeout-Ms; each shard call
    still has shard_timeout_s)."""
    DEADLINE.set(None)


def remaining_s() -> float | None:
    """Seconds left before the current request's deadline (None: no deadline); DeadlineExceeded once past."""
    deadline = DEADLINE.get()
    if deadline is None:
        return None
    left = deadline - time.time()
    if left <= 0:
        raise DeadlineExceeded(f"the request's deadline passed ({TIMEOUT_HEADER} or overload.request_timeout_s)",
                               TIMEOUT_HEADER)
    return left


ERRORS = {status: {"model": ErrorBody} for status in (401, 404, 413, 422, 429, 503, 504)}  # 401: a wrong token, on
# reads too (or none, with auth.read_auth)
BODY_ERRORS = {**ERRORS, 415: {"model": ErrorBody}}  # a POST whose body is not JSON
WRITE_ERRORS = {**BODY_ERRORS, 403: {"model": ErrorBody}}


def error_response(status: int, category: str, message: str, field: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(category=category, field=None if field is None else sendable(field),
                                       message=sendable(message)))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def http_error(exc: AndromedaError, retry_after_s: int = 1) -> JSONResponse:
    status = STATUS.get(exc.category, 500)
    headers = dict(HEADERS.get(status, {}))
    if status in (429, 503):
        wait = getattr(exc, "retry_after", None)
        headers["Retry-After"] = retry_after(wait if wait is not None else retry_after_s)
    return error_response(status, exc.category.value, exc.message, exc.field, headers or None)


def bearer_token(credentials: HTTPAuthorizationCredentials | None) -> str:
    """The bearer token of a request; Unauthorized without one (the header is never echoed or logged)."""
    if credentials is None or credentials.scheme.lower() != "bearer" or not credentials.credentials:
        raise Unauthorized("send Authorization: Bearer <token>", "Authorization")
    return credentials.credentials


@dataclass(frozen=True)
class GuardSettings:
    """What the guard in front of the app enforces (set by the router from its ServiceConfig)."""

    body_bytes: int = 8 << 20
    inflight: int = 128
    request_timeout_s: float = 10.0
    max_request_timeout_s: float = 60.0
    retry_after_s: int = 1
    latency_target_s: float = 0.0  # LatencyShedder's target (0: off) and interval
    latency_interval_s: float = 1.0


def content_encoding(request: Request) -> tuple[str, str]:
    """(the header, the codings lower case: "a, b" when several) of the first of Content-Encoding and
    Transfer-Encoding that names a coding the body went through and the service does not undo (the server undoes
    Transfer-Encoding's chunked alone); ("", "identity") when neither does."""
    for header, read in (("Content-Encoding", {"", "identity"}), ("Transfer-Encoding", {"", "identity", "chunked"})):
        codings = [c.strip().lower() for value in request.headers.getlist(header) for c in value.split(",")]
        if left := [c for c in codings if c not in read]:
            return header, ", ".join(left)
    return "", "identity"


class StrictJSONRequest(Request):
    """A request whose JSON body must be what RFC 8259 exchanges: UTF-8 (a byte order mark is ignored; UTF-16 and
    UTF-32, which Python's json.loads would guess, are refused) with no key twice in an object, sent with no
    Content-Encoding but identity, nor a Transfer-Encoding but chunked, nor a charset but UTF-8. Every refusal is a
    json.JSONDecodeError, which FastAPI answers as json_invalid (invalid_body below: 422 naming the body, or 415
    naming the Content-Type or the encoding header)."""

    async def json(self):
        if not hasattr(self, "_json"):
            if content_encoding(self)[0] or not json_media_type(self.headers.get("content-type", "")):  # refused
                raise json.JSONDecodeError("the body is encoded", "", 0)  # (415) by invalid_body, whatever it holds
            body = await self.body()
            try:
                text = body.decode("utf-8-sig")
            except UnicodeDecodeError as exc:  # its offset counts from after a byte order mark
                at = exc.start + (3 if body.startswith(codecs.BOM_UTF8) else 0)
                raise json.JSONDecodeError(f"not UTF-8 at byte {at} (send JSON as UTF-8)", "", 0) from None
            try:
                self._json = strict_json.loads(text)
            except json.JSONDecodeError as exc:  # "Unterminated string starting at": not "at at"
                where = "character" if exc.msg.endswith(" at") else "at character"
                raise json.JSONDecodeError(f"{exc.msg} {where} {exc.pos}", exc.doc, exc.pos) from None
            except strict_json.NotJSON as exc:
                raise json.JSONDecodeError(str(exc), text, 0) from None
        return self._json


class StrictJSONRoute(APIRoute):
    """A route that reads its body as StrictJSONRequest."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict(request: Request):
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict


def local_path(scope) -> str:
    """The request's path inside the app (without the route prefix the app is mounted at)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class Guard:
    """ASGI middleware in front of every /v1/ request, before any parsing: at most `inflight` requests at
    once in this process, and no new retrieval while LatencyShedder sees a standing queue of retrievals (more:
    503 + Retry-After at once, so latency does not grow with a queue; writes and ad lookups, which the
    retrievals' latency says nothing of, go on up to `inflight`), a body
    of at most `body_bytes` (413; also for bodies without Content-Length), and the request's deadline
    (`X-Request-Timeout-Ms`, else the default) in DEADLINE for everything the request awaits."""

    def __init__(self, app, on_error: Callable[[str], None]):
        self.app, self.on_error = app, on_error
        self.inflight = 0
        self.retrievals = 0  # of those in flight, the retrievals (what the shedder watches)
        self.shedder: LatencyShedder | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not local_path(scope).startswith("/v1/"):
            return await self.app(scope, receive, send)
        g = getattr(scope["app"].state, "guard", None) or GuardSettings()  # the router sets app.state.guard
        if self.shedder is None:
            self.shedder = LatencyShedder(g.latency_target_s, g.latency_interval_s)
        retrieval, admission = local_path(scope).startswith("/v1/retrieve"), None
        try:
            if self.inflight >= g.inflight:
                raise Overloaded(f"this router has {self.inflight} requests in flight (overload.router_inflight = "
                                 f"{g.inflight}); retry after Retry-After", "request", g.retry_after_s)
            pairs = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())]
            headers = dict(pairs)
            for once in ONCE_HEADERS:  # which would count? A proxy in front may judge the other one
                if sum(k == once.lower() for k, _ in pairs) > 1:
                    raise InvalidInput("sent more than once: send it once", once)
            budget_s = self.budget_s(g, headers.get(TIMEOUT_HEADER.lower()))
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or len(length) > 18 or int(length) > g.body_bytes):  # int()
                # refuses more than 4,300 digits: a ValueError, a 500
                raise TooLarge(f"at most {g.body_bytes} bytes (limits.body_bytes), Content-Length is {length[:20]}",
                               "body")
            if retrieval and not (admission := self.shedder.admit(self.retrievals)):  # after the header checks,
                # before the body is read: refused at once
                raise Overloaded(f"retrievals on this router have waited over {g.latency_target_s * 1000:.0f} ms for "
                                 f"{g.latency_interval_s * 1000:.0f} ms (overload.latency_target_ms); retry after "
                                 "Retry-After", "request", g.retry_after_s)
        except AndromedaError as exc:
            if admission is Admission.PROBE:  # refused after all: the next one may probe
                self.shedder.probe_unused()
            self.on_error(exc.category.value)
            return await http_error(exc, g.retry_after_s)(scope, receive, send)
        self.inflight += 1  # from here, while its body still arrives too (until 2026-12-07 a body sent without
        self.retrievals += retrieval  # Content-Length was not counted: any number passed the bound while theirs came)
        started, status = None, 500

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if scope["method"] in ("POST", "PUT", "PATCH"):  # the whole body, within the default budget (a longer
                # X-Request-Timeout-Ms, which writes are not bound by, may lengthen it): a body that never arrived held
                # its slot for as long as its connection stayed open (until 2026-12-07: 32 such connections, with no
                # token, shut out every caller of the router)
                arrival_s = max(budget_s, g.request_timeout_s)
                try:
                    receive = await asyncio.wait_for(self.buffered(receive, g.body_bytes), arrival_s)
                except (TooLarge, asyncio.TimeoutError) as exc:
                    if not isinstance(exc, TooLarge):
                        exc = DeadlineExceeded(f"the body did not arrive within {arrival_s:g} s "
                                               f"(overload.request_timeout_s, or a longer {TIMEOUT_HEADER})", "body")
                    self.on_error(exc.category.value)
                    return await http_error(exc, g.retry_after_s)(scope, receive, sending)
            started, token = time.monotonic(), DEADLINE.set(time.time() + budget_s)  # from the whole body
            try:
                await self.app(scope, receive, sending)
            finally:
                DEADLINE.reset(token)
        finally:
            self.inflight -= 1
            self.retrievals -= retrieval
            latency = None if started is None else time.monotonic() - started
            # Retrievals feed the shedder; a refusal or error may show a queue (slow) but not its absence (fast).
            if retrieval and latency is not None and (status < 400 or latency > g.latency_target_s):
                self.shedder.done(latency)
            elif admission is Admission.PROBE:
                self.shedder.probe_unused()

    @staticmethod
    def budget_s(g: GuardSettings, header: str | None) -> float:
        if header is None:
            return g.request_timeout_s
        ms = int(header) if header.isascii() and header.isdigit() and len(header) <= 18 else 0  # digits only: not
        # "+100", " 100", "1_000"; and few (int() refuses more than 4,300: a ValueError, a 500)
        if not 1 <= ms <= g.max_request_timeout_s * 1000:
            raise InvalidInput(f"must be an integer number of milliseconds in [1, {int(g.max_request_timeout_s * 1000)}] "
                          f"(overload.max_request_timeout_s)", TIMEOUT_HEADER)
        return ms / 1000

    @staticmethod
    async def buffered(receive, limit: int):
        """Read a body, refusing it past the limit (a Content-Length past it is refused before); a receive that
        replays it."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise TooLarge(f"at most {limit} bytes (limits.body_bytes)", "body")
            more = message.get("more_body", False)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay


def json_media_type(content_type: str) -> bool:
    """Whether a Content-Type names JSON as FastAPI reads it (application/json or application/*+json, in any case)
    in UTF-8 (no charset, or utf-8: the body is read as UTF-8 whatever a charset says, which another reader honours)."""
    media, *params = (part.strip().lower() for part in content_type.split(";"))
    charsets = [p.partition("=")[2].strip().strip('"') for p in params if p.partition("=")[0].strip() == "charset"]
    return (media == "application/json" or (media.startswith("application/") and media.endswith("+json"))) \
        and all(c in ("utf-8", "utf8") for c in charsets)


def create_app(on_error: Callable[[str], None]) -> FastAPI:
    """The app with its error handlers and guard; `on_error(cause)` counts each error response by cause. A path
    with a trailing slash is an unknown path (404), not a redirect built from the request's Host header.

    No /docs or /redoc: FastAPI's pages load their JavaScript and CSS from a third-party CDN, which a
    retrieval tier must not make browsers fetch; the OpenAPI document stays at /openapi.json for any
    local viewer."""
    app = FastAPI(title="Andromeda", version="0.1.0", docs_url=None, redoc_url=None, redirect_slashes=False,
                  description="Ads retrieval: targeting match, MoE scoring and top-k over sharded, live-updated indexes.")
    app.router.route_class = StrictJSONRoute
    app.add_middleware(Guard, on_error=on_error)

    async def auth_refusal(request: Request) -> JSONResponse | None:
        """For a body FastAPI could not read, before which no dependency ran: the refusal (401, 403, 429) of
        the route's auth, run by app.state.authorize(request), which a caller gets before any word about its
        body; None when it passes or the app has no such check."""
        authorize = getattr(request.app.state, "authorize", None)
        try:
            if authorize is not None:
                await authorize(request)
        except AndromedaError as exc:
            on_error(exc.category.value)
            return http_error(exc, getattr(request.app.state, "retry_after_s", 1))
        return None

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        if err.get("type") == "json_invalid" and (refusal := await auth_refusal(request)):
            return refusal
        if request.method == "POST" and not json_media_type(request.headers.get("content-type", "")):
            on_error("unsupported_media_type")
            return error_response(415, "unsupported_media_type", "send the body as JSON in UTF-8 with Content-Type: "
                                  "application/json", "Content-Type")
        header, encoding = content_encoding(request)
        if request.method == "POST" and header:  # compressed bodies are not read: say so
            on_error("unsupported_media_type")
            return error_response(415, "unsupported_media_type", f"{header} {shown(encoding)} is not read: "
                                  "send the body uncompressed", header)
        loc = tuple(err.get("loc", ()))
        if loc == ("body",) and err.get("type") == "missing":  # FastAPI's word for a body of no bytes
            on_error(ErrorCategory.INVALID_INPUT.value)
            return error_response(422, ErrorCategory.INVALID_INPUT.value, "the body is empty: send the request as JSON",
                                  "body")
        where = loc[1:] if loc[:1] in (("body",), ("path",), ("query",)) else loc
        if err.get("type") == "json_invalid":
            field, message = "body", f"the body is not valid JSON: {err.get('ctx', {}).get('error', 'unreadable')}"
        else:
            field = error_field(where, err.get("type", ""))
            limits = getattr(request.app.state, "limits", None)
            named = past_wire_bound(limits, field, err.get("type", ""), err.get("input")) if limits is not None else None
            message = named or err.get("msg", "invalid")
        on_error(ErrorCategory.INVALID_INPUT.value)
        return error_response(422, ErrorCategory.INVALID_INPUT.value, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths, wrong methods, unreadable bodies: the same error shape as everything else."""
        if exc.status_code == 400:  # FastAPI could not decode the body: nested past the parser's depth, or a
            # number of more digits than Python converts
            if refusal := await auth_refusal(request):
                return refusal
            on_error(ErrorCategory.INVALID_INPUT.value)
            return error_response(422, ErrorCategory.INVALID_INPUT.value, "the body is not JSON this service can read "
                                  "(it must nest at most a few hundred levels and hold no number of more than 4,300 "
                                  "digits)", "body")
        cause = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_input")
        on_error(cause)
        return error_response(exc.status_code, cause, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(AndromedaError)
    async def andromeda_error(request: Request, exc: AndromedaError) -> JSONResponse:
        on_error(exc.category.value)
        return http_error(exc, getattr(request.app.state, "retry_after_s", 1))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        on_error("internal")
        log.error("internal error on %s %s\n%s", request.method, request.url.path,
                  sendable("".join(traceback.format_exception(exc)), None))
        return error_response(500, "internal", f"{type(exc).__name__}: internal error")

    return app
