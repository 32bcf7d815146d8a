"""Reading a JSON request body safely: a size cap, strict UTF-8, JSON (finite numbers only), and
a pydantic model; and `json_body`, which documents that model as the route's OpenAPI body."""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from loraplex.platform.api.errors import APIError, bad_request, from_validation_error

BodyT = TypeVar("BodyT", bound=BaseModel)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"The request body exceeds the limit of {limit} bytes.",
        code="request_too_large",
    )


async def read_body_bytes(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates (`"\\ud800"`): valid JSON escapes, but not encodable text."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            raise bad_request(f"The request body holds invalid Unicode text: {error}") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key)
            _check_strings(item)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item)


class _NonFiniteNumber(ValueError):
    pass


def _no_constant(name: str) -> float:
    raise _NonFiniteNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e400
        raise _NonFiniteNumber(f"{text} is out of the range of a 64-bit float")
    return value


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode strict UTF-8 JSON whose top level is an object; 400 otherwise. NaN, Infinity
    and numbers that overflow a float are refused (Python's json module would accept them)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"The request body is not valid UTF-8: {error}") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
        _check_strings(data)
    except _NonFiniteNumber as error:
        raise bad_request(f"The request body holds a non-finite number: {error}") from None
    except json.JSONDecodeError as error:
        raise bad_request(f"The request body is not valid JSON: {error}") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    return data


async def read_json_model(request: Request, model: type[BodyT], limit: int) -> BodyT:
    """Read, decode and validate the body as `model`; raises APIError (4xx) on any fault."""
    data = parse_json(await read_body_bytes(request, limit))
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise from_validation_error(error) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` declaring `model` as its required JSON body.

    Routes read their bodies with `read_json_model` (size cap, strict UTF-8, OpenAI-shaped 400s)
    rather than through FastAPI, so FastAPI cannot see the model; `body_schemas` adds it to the
    document's components."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def body_schemas(models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    """The JSON schemas of `models` and of every model they use, by name, for OpenAPI's
    `components.schemas`."""
    _, schemas = models_json_schema(
        [(model, "validation") for model in models],
        ref_template="#/components/schemas/{model}",
    )
    return schemas.get("$defs", {})
