"""Adapter routes, scoped to the caller's tenant: upload, register (admin), list, get, delete,
and vLLM's `load_lora_adapter` / `unload_lora_adapter`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from loraplex.adapters.upload import UploadedFile
from loraplex.platform.api.errors import APIError, bad_request
from loraplex.platform.api.request_body import (
    declared_length,
    json_body,
    parse_json,
    read_body_bytes,
)
from loraplex.platform.api.state import server_state
from loraplex.platform.api.tenancy.adapter_service import (
    AdapterService,
    card,
    check_adapter_name,
    files_from_path,
    files_from_upload,
)
from loraplex.platform.api.tenancy.auth import caller_of, require_admin, tenant_of

router = APIRouter()
_MAX_FILES = 8
# the multipart framing and the `name` field an upload may carry beyond its files' bytes
_FORM_OVERHEAD_BYTES = 64 * 1024
ADAPTERS_PREFIX = "/v1/adapters/"


# NOTE: the JSON bodies below are read and checked by the routes themselves (field by field,
# with OpenAI-shaped 400s naming the field); these models document them in /openapi.json.
class RegisterAdapterRequest(BaseModel):
    """POST /v1/adapters/register (admin): a PEFT folder on the server, for a tenant."""

    name: str
    path: str
    tenant: str | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (admin, vLLM's route)."""

    lora_name: str
    lora_path: str
    tenant: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's route): one of the caller's adapters."""

    lora_name: str


BODY_MODELS = (RegisterAdapterRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest)
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "files"],
                    "properties": {
                        "name": {"type": "string"},
                        "files": {"type": "array", "items": {"type": "string", "format": "binary"}},
                    },
                }
            }
        },
    }
}


def _service(request: Request) -> AdapterService:
    return request.app.state.adapters


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the upload is over the limit of {limit} bytes", code="adapter_too_large")


@router.post("/v1/adapters", openapi_extra=_UPLOAD_BODY)
async def upload_adapter(request: Request) -> JSONResponse:
    """multipart/form-data: `name`, and `files` (the two PEFT files, or one .zip / .tar.gz).

    The body is counted as it arrives, chunked or not (413 past `--max-adapter-bytes`, without
    reading the rest), its files are spooled to temporary files rather than held in memory, and
    at most `--max-concurrent-uploads` are read at once per process (503 beyond; 429 for a
    tenant already holding all but one of them)."""
    tenant = tenant_of(request).name
    service = _service(request)
    limit = server_state(request).settings.max_adapter_bytes
    declared = declared_length(request)
    if declared is not None and declared > limit + _FORM_OVERHEAD_BYTES:
        raise _too_large(limit)
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("send the adapter as multipart/form-data: `name` and `files`")
    async with service.upload_slot(tenant):
        form = await _read_form(request, limit)
        try:
            name = check_adapter_name(form.get("name"), service.base_name)
            files = [
                UploadedFile(upload.filename or "", upload.file)
                for upload in form.getlist("files")
                if isinstance(upload, UploadFile)
            ]
            record, replaced = await service.install(tenant, name, files_from_upload(files))
        finally:
            await form.close()
    return JSONResponse({**card(record, service.base_name), "replaced": replaced}, status_code=201)


async def _read_form(request: Request, limit: int) -> FormData:
    """The multipart body, its files spooled to temporary files; 413 as soon as more than
    `limit` bytes (plus the form's own framing) have arrived."""
    budget = limit + _FORM_OVERHEAD_BYTES

    async def counted() -> AsyncIterator[bytes]:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > budget:
                raise _too_large(limit)
            yield chunk

    parser = MultiPartParser(
        request.headers, counted(), max_files=_MAX_FILES, max_fields=_MAX_FILES
    )
    try:
        return await parser.parse()
    except MultiPartException as error:
        raise bad_request(f"unreadable multipart body: {error.message}") from None


async def _read_body(request: Request) -> bytes:
    """A JSON route's body, within --max-request-body-bytes (413 past it, as it arrives)."""
    return await read_body_bytes(request, server_state(request).settings.max_request_body_bytes)


def _target_tenant(request: Request, body: dict[str, Any]) -> str:
    """The tenant an admin acts for: the body's `tenant` (the open server's one by default)."""
    own = caller_of(request).tenant  # set on an open server only
    tenant = body.get("tenant", own.name if own is not None else None)
    if tenant is None:
        raise bad_request("name the tenant to register the adapter for", param="tenant")
    known = own is not None and tenant == own.name
    if not known and (
        not isinstance(tenant, str) or server_state(request).tenancy.tenants.get(tenant) is None
    ):
        raise bad_request(f"no tenant {tenant!r}", param="tenant")
    return tenant


async def _register(request: Request, name_field: str, path_field: str) -> JSONResponse:
    require_admin(request)
    body = parse_json(await _read_body(request))
    service = _service(request)
    name = check_adapter_name(body.get(name_field), service.base_name)
    path = body.get(path_field)
    if not isinstance(path, str) or not path:
        raise bad_request(f"`{path_field}` must be a server-local folder", param=path_field)
    tenant = _target_tenant(request, body)
    record, replaced = await service.install(tenant, name, files_from_path(path))
    return JSONResponse({**card(record, service.base_name), "replaced": replaced}, status_code=201)


@router.post("/v1/adapters/register", openapi_extra=json_body(RegisterAdapterRequest))
async def register_adapter(request: Request) -> JSONResponse:
    """Admin only: `{"name", "path", "tenant"}`, a PEFT folder on the server."""
    return await _register(request, "name", "path")


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> JSONResponse:
    """vLLM-compatible: `{"lora_name", "lora_path"}` (admin only; `tenant` names the tenant)."""
    return await _register(request, "lora_name", "lora_path")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> JSONResponse:
    """vLLM-compatible: `{"lora_name"}`, one of the caller's adapters."""
    body = parse_json(await _read_body(request))
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise bad_request("`lora_name` must be a string", param="lora_name")
    tenant = tenant_of(request).name
    record = await _service(request).remove(tenant, name)
    return JSONResponse({"id": record.name, "object": "adapter", "deleted": True})


@router.get("/v1/adapters")
async def list_adapters(request: Request) -> JSONResponse:
    tenant = tenant_of(request).name
    service = _service(request)
    records = server_state(request).tenancy.registry.list(tenant)
    return JSONResponse({"object": "list", "data": [card(r, service.base_name) for r in records]})


def _name_in_path(request: Request) -> str:
    """The adapter name of `/v1/adapters/{name}` exactly as sent.

    NOTE: starlette's `{name:path}` matches `.*$`, which stops before a trailing newline: for
    `/v1/adapters/x%0A` it would give `x`. The path itself holds the whole name, so a name an
    older version stored with a newline can still be read and deleted (and never another)."""
    path = request.scope["path"]
    return path[path.index(ADAPTERS_PREFIX) + len(ADAPTERS_PREFIX) :]


@router.get(ADAPTERS_PREFIX + "{name:path}")
async def get_adapter(name: str, request: Request) -> JSONResponse:
    service = _service(request)
    record = service.get(tenant_of(request).name, _name_in_path(request))
    return JSONResponse(card(record, service.base_name))


@router.delete(ADAPTERS_PREFIX + "{name:path}")
async def delete_adapter(name: str, request: Request) -> JSONResponse:
    record = await _service(request).remove(tenant_of(request).name, _name_in_path(request))
    return JSONResponse({"id": record.name, "object": "adapter", "deleted": True})
