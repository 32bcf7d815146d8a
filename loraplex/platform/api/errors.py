"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause maps to a 4xx here; a 500 means a bug of ours, and is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from loraplex.adapters.errors import (
    AdapterLoadError,
    AdapterNotFoundError,
    AdapterValidationError,
)
from loraplex.grammar.errors import (
    GrammarError,
    GrammarMemoryError,
    GrammarTimeoutError,
    UnsupportedSchemaError,
)
from loraplex.platform.core.errors import EngineDeadError, PromptTooLongError, RequestStalledError

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"


class APIError(Exception):
    """An error answered to the client with this status and OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model `{name}` does not exist.",
        param="model",
        code="model_not_found",
    )


def from_validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error, with its field path as `param` (e.g. `messages.0.role`)."""
    details = error.errors()
    if not details:
        return bad_request("invalid request body")
    first = details[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # NOTE: union members show up as extra path parts ("str", "list[int]", "ContentPart"); our
    # field names are lower-case identifiers, so keep only those and list indices.
    path = [part for part in loc if _is_field_part(part)]
    param = ".".join(path) or None
    where = f" ({param})" if param else ""
    message = f"{first.get('msg', 'invalid value')}{where}"
    if len(details) > 1:
        message += f"; and {len(details) - 1} more error(s)"
    return bad_request(message, param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_field_part(part: str) -> bool:
    if part.isdigit():
        return True
    return part.isidentifier() and part[0].islower() and part not in _TYPE_NAMES


def from_engine_error(error: ValueError, fields: Mapping[str, str] | None = None) -> APIError:
    """An error from SamplingParams or Engine.add_request (both ValueError). `fields` names
    the engine's fields (`prompt`, `max_tokens`) as the request does (chat: `messages`)."""
    if isinstance(error, PromptTooLongError):
        param = (fields or {}).get(error.param, error.param)
        return bad_request(str(error), param=param, code="context_length_exceeded")
    if isinstance(error, GrammarError):
        return bad_request(str(error), code=_grammar_code(error))
    if isinstance(error, AdapterNotFoundError):  # removed by the time the engine saw it
        return APIError(404, str(error), type="not_found_error", param="model",
                        code="model_not_found")  # fmt: skip
    if isinstance(error, AdapterValidationError):  # the request's adapter cannot be served
        code = "adapter_load_failed" if isinstance(error, AdapterLoadError) else "invalid_adapter"
        return bad_request(str(error), param="model", code=code)
    return bad_request(str(error), param=getattr(error, "param", None))


def _grammar_code(error: GrammarError) -> str:
    if isinstance(error, UnsupportedSchemaError):
        return "unsupported_schema_feature"
    if isinstance(error, GrammarTimeoutError):
        return "grammar_compile_timeout"
    if isinstance(error, GrammarMemoryError):
        return "grammar_compile_memory"
    return "invalid_structured_output"


def request_failed(message: str, cause: Exception | None = None) -> APIError:
    """A request the engine ended early (`RequestOutput.error`, raised as `cause`): its grammar
    failed to compile, over a time or memory limit or refused by the compiler (the client's
    fault: 400), its adapter failed to load (400, `adapter_load_failed`), or the watchdog ended
    it for making no progress (503)."""
    if isinstance(cause, RequestStalledError):
        return APIError(503, message, type="service_unavailable", code="request_stalled")
    if isinstance(cause, (GrammarError, AdapterValidationError)):
        return from_engine_error(cause)
    return bad_request(message, code="invalid_structured_output")


def engine_unavailable(error: EngineDeadError) -> APIError:
    return APIError(503, str(error), type="service_unavailable", code="engine_dead")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app raises answer in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(ValidationError)
    async def _validation(_: Request, exc: ValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return engine_unavailable(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else INVALID_REQUEST
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error serving %s %r", request.method, request.url.path)
        return APIError(500, "internal server error", type="internal_server_error").response()
