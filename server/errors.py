"""Structured JSON errors: every failure the service returns has the same body.

    {"error": {"type": "not_found", "message": "unknown session 'abc'", "code": 404}}

The shape follows OpenAI's error object, so chat clients that already parse it keep working.
Exceptions of kvtier's hierarchy map to the status a caller can act on; anything else is a
500 that is logged with its traceback and counted, and never takes the service down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.engine.engine import (
    EngineStepError,
    RequestError,
    SessionBusyError,
    UnknownSessionError,
)
from kvtier.errors import (
    ChunkError,
    DescriptorsExhaustedError,
    InvalidArgumentError,
    KVTierError,
    PoolError,
)

log = logging.getLogger(__name__)

_STATUS_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "payload_too_large",
    422: "invalid_request",
    500: "internal_error",
    503: "unavailable",
    507: "insufficient_storage",
}


class ErrorDetail(BaseModel):
    type: str
    message: str
    code: int


class ErrorBody(BaseModel):
    """The body of every error response."""

    error: ErrorDetail


def error_responses(*codes: int) -> dict[int | str, dict]:
    """OpenAPI ``responses`` entries documenting the error body for ``codes``."""
    return {code: {"model": ErrorBody} for code in codes}


class RouteError(Exception):
    """Raised by a route to answer with a given status and error type (the client side of
    such an answer is :class:`kvtier.client.ServiceError`)."""

    def __init__(self, status: int, message: str, type_: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_ or _STATUS_TYPES.get(status, "error")


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    return {
        "error": {
            "type": type_ or _STATUS_TYPES.get(status, "error"),
            "message": message,
            "code": status,
        }
    }


def error_response(
    status: int, message: str, type_: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, type_), status_code=status, headers=headers)


def status_of(exc: BaseException) -> tuple[int, str]:
    """The HTTP status and error type a kvtier exception stands for."""
    if isinstance(exc, RouteError):
        return exc.status, exc.type
    if isinstance(exc, EngineStepError):
        return 500, "engine_error"
    if isinstance(exc, UnknownSessionError):
        return 404, "not_found"
    if isinstance(exc, SessionBusyError):
        return 409, "session_busy"  # docs/server.md: one turn at a time per session
    if isinstance(exc, DescriptorsExhaustedError):
        return 503, "descriptors_exhausted"  # whether it is stored is unknown: retry
    if isinstance(exc, ChunkError):
        return 400, "invalid_chunk"
    if isinstance(exc, PoolError):
        return 503, "pool_full"  # a capacity condition of this server; retry later
    if isinstance(exc, RequestError | InvalidArgumentError):
        return 400, "invalid_request"
    if isinstance(exc, KVTierError):
        return 400, "invalid_request"
    return 500, "internal_error"


def install_error_handlers(app: FastAPI, count_error: Callable[[str], None]) -> None:
    """Route every exception to a structured body; ``count_error`` feeds the metrics."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_error(_STATUS_TYPES.get(exc.status_code, "http"))
        return error_response(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError) -> JSONResponse:
        count_error("invalid_request")
        parts = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{where}: {err.get('msg', 'invalid')}")
        return error_response(422, "; ".join(parts) or "invalid request")

    async def _known(_request: Request, exc: Exception) -> JSONResponse:
        status, type_ = status_of(exc)
        count_error(type_)
        headers = {"Retry-After": "1"} if status == 503 else None
        return error_response(status, str(exc), type_, headers)

    app.add_exception_handler(KVTierError, _known)
    app.add_exception_handler(RouteError, _known)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        count_error("internal_error")
        log.error("unhandled error in request", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
