"""Reading a JSON request body safely: a size cap, strict UTF-8, JSON (finite numbers only), and
a pydantic model; and `json_body`, which documents that model as the route's OpenAPI body."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
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


def declared_length(request: Request) -> int | None:
    """The body size the Content-Length header declares (None without a number there)."""
    value = request.headers.get("content-length", "")
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value) if len(value) <= 18 else 10**18  # more digits: more than any limit


async def read_body_bytes(request: Request, limit: int) -> bytes:
    """The raw body, refusing (413) anything over `limit` bytes before reading it all."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


# NOTE: UTF-8 cannot encode a surrogate, so a lone one comes only from a `\uD800`-`\uDFFF`
# escape: a body without such an escape (nearly every body) skips the walk over its values.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _NonFiniteNumber(ValueError):
    pass


class _HugeInt:
    """Stands in for an integer over Python's digit limit while a refused body is decoded
    again to name the field that holds it."""


def _no_constant(name: str) -> float:
    raise _NonFiniteNumber(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # e.g. 1e400
        raise _NonFiniteNumber(f"{text} is out of the range of a 64-bit float")
    return value


def _int_or_huge(text: str) -> int | _HugeInt:
    try:
        return int(text)
    except ValueError:  # over sys.get_int_max_str_digits() digits
        return _HugeInt()


def _path_of(value: Any, bad: Callable[[Any], bool], path: tuple[str, ...] = ()) -> str | None:
    """The dotted path (e.g. `messages.0.content`) of the first value `bad` holds for ('' for
    the whole body; a bad key names its object), or None."""
    if bad(value):
        return ".".join(path)
    if isinstance(value, dict):
        for key, item in value.items():
            if bad(key):
                return ".".join(path)
            found = _path_of(item, bad, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _path_of(item, bad, (*path, str(index)))
            if found is not None:
                return found
    return None


def _is_lone_surrogate(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _refused(message: str, path: str | None) -> APIError:
    """A 400 naming the field at `path` (the body itself when it is '')."""
    return bad_request(f"{message} ({path})" if path else message, param=path or None)


def parse_json(raw: bytes) -> dict[str, Any]:
    """Decode strict UTF-8 JSON whose top level is an object; 400 otherwise. NaN, Infinity,
    numbers that overflow a float, integers of more digits than Python converts (4300) and
    lone surrogates are refused, naming their field (Python's json module would accept the
    first three and the last, and fail on the fourth)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise bad_request(f"The request body is not valid UTF-8: {error}") from None
    try:
        data = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except _NonFiniteNumber as error:
        raise bad_request(f"The request body holds a non-finite number: {error}") from None
    except json.JSONDecodeError as error:
        raise bad_request(f"The request body is not valid JSON: {error}") from None
    except ValueError:  # an integer over Python's digit limit (the only other ValueError)
        decoded = json.loads(
            text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_int_or_huge
        )
        path = _path_of(decoded, lambda value: isinstance(value, _HugeInt))
        raise _refused("The request body holds an integer with too many digits", path) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    if _SURROGATE_ESCAPE.search(text):
        path = _path_of(data, _is_lone_surrogate)
        if path is not None:
            raise _refused("The request body holds invalid Unicode text (a lone surrogate)", path)
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
