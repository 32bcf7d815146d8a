"""Reading a JSON request body safely: a size cap, strict UTF-8, JSON, and a pydantic model."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

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


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode strict UTF-8 JSON whose top level is an object; 400 otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"The request body is not valid UTF-8: {error}") from None
    try:
        data = json.loads(text)
        _check_strings(data)
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
