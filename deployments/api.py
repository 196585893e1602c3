"""HTTP concerns of the ingress: the FastAPI app, the wire models only HTTP has (error body, batch
and publish results), write-token auth, and the one place errors map to HTTP status codes."""
from __future__ import annotations

import hmac
import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import BaseModel

from andromeda_core.errors import AndromedaError, ErrorCategory
from andromeda_core.types import RetrieveResponse, error_field

log = logging.getLogger(__name__)

STATUS = {ErrorCategory.INVALID_INPUT: 422, ErrorCategory.NOT_FOUND: 404, ErrorCategory.UNAUTHORIZED: 401,
          ErrorCategory.UNAVAILABLE: 503, ErrorCategory.CORRUPT: 500}
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


class Unauthorized(AndromedaError):
    """A write without a valid bearer token."""

    category = ErrorCategory.UNAUTHORIZED


ERRORS = {status: {"model": ErrorBody} for status in (404, 422, 503)}
WRITE_ERRORS = {**ERRORS, 401: {"model": ErrorBody}}


def error_response(status: int, category: str, message: str, field: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    body = ErrorBody(error=ErrorDetail(category=category, field=field, message=message))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def http_error(exc: AndromedaError) -> JSONResponse:
    status = STATUS.get(exc.category, 500)
    return error_response(status, exc.category.value, exc.message, exc.field, HEADERS.get(status))


def check_write_token(expected: str | None, credentials: HTTPAuthorizationCredentials | None) -> None:
    """Raise Unauthorized unless the bearer token equals `expected` (compared in constant time)."""
    if not expected:
        raise Unauthorized("writes are disabled: the service has no ANDROMEDA_WRITE_TOKEN", "Authorization")
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Unauthorized("send Authorization: Bearer <token>", "Authorization")
    if not hmac.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise Unauthorized("invalid token", "Authorization")


def create_app(on_error: Callable[[str], None]) -> FastAPI:
    """The app with its error handlers; `on_error(cause)` counts each error response by cause."""
    app = FastAPI(title="Andromeda", version="0.1.0",
                  description="Ads retrieval: targeting match, MoE scoring and top-k over sharded, live-updated indexes.")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        if request.method == "POST" and request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
            on_error("unsupported_media_type")
            return error_response(415, "unsupported_media_type", "send the body as JSON with Content-Type: application/json",
                                  "Content-Type")
        err = exc.errors()[0]
        loc = tuple(err.get("loc", ()))
        where = loc[1:] if loc[:1] in (("body",), ("path",), ("query",)) else loc
        field = "body" if err.get("type") == "json_invalid" else error_field(where, err.get("type", ""))
        on_error(ErrorCategory.INVALID_INPUT.value)
        return error_response(422, ErrorCategory.INVALID_INPUT.value, err.get("msg", "invalid"), field)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths, wrong methods, unreadable bodies: the same error shape as everything else."""
        cause = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_input")
        on_error(cause)
        return error_response(exc.status_code, cause, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(AndromedaError)
    async def andromeda_error(request: Request, exc: AndromedaError) -> JSONResponse:
        on_error(exc.category.value)
        return http_error(exc)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        on_error("internal")
        return error_response(500, "internal", f"{type(exc).__name__}: internal error")

    return app
