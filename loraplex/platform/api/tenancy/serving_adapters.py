"""Adapter routes, scoped to the caller's tenant: upload, register (admin), list, get, delete;
and vLLM's `load_lora_adapter` / `unload_lora_adapter`, which load and unload server-wide
adapters (as `--lora-modules` makes them) on a server that allows runtime updates, beside their
tenant-scoped form (README, "Tenants and adapters", says who may call what)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
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
    adapter_not_found,
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
    """POST /v1/load_lora_adapter (vLLM's route): a server-wide adapter from a server-local
    PEFT folder, or with `tenant` (admin key) one tenant's."""

    lora_name: str
    lora_path: str
    tenant: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's route): a server-wide adapter, or one of the
    caller's (a tenant key, or `tenant` with the admin key)."""

    lora_name: str
    tenant: str | None = None


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


async def _register(
    request: Request, body: dict[str, Any], name_field: str, path_field: str
) -> JSONResponse:
    require_admin(request)
    service = _service(request)
    name = check_adapter_name(body.get(name_field), service.base_name, name_field)
    path = _server_path(body, path_field)
    tenant = _target_tenant(request, body)
    record, replaced = await service.install(tenant, name, files_from_path(path))
    return JSONResponse({**card(record, service.base_name), "replaced": replaced}, status_code=201)


def _server_path(body: dict[str, Any], field: str) -> str:
    path = body.get(field)
    if not isinstance(path, str) or not path:
        raise bad_request(f"`{field}` must be a server-local folder", param=field)
    return path


@router.post("/v1/adapters/register", openapi_extra=json_body(RegisterAdapterRequest))
async def register_adapter(request: Request) -> JSONResponse:
    """Admin only: `{"name", "path", "tenant"}`, a PEFT folder on the server."""
    return await _register(request, parse_json(await _read_body(request)), "name", "path")


_SWITCH = (
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING=1, or "
    "--allow-runtime-lora-updating)"
)


def _forbidden(message: str, code: str) -> APIError:
    return APIError(403, message, type="permission_error", code=code)


def _check_server_wide(request: Request, action: str) -> None:
    """403 unless the caller may change server-wide adapters: runtime updates allowed (vLLM's
    switch), and the admin key on a server that has one (an open server needs no key, as
    vLLM's)."""
    caller = caller_of(request)
    tenants = server_state(request).tenancy.tenants
    if not tenants.is_open and not (caller.is_admin and caller.tenant is None):
        raise _forbidden(
            f"{action} a server-wide adapter takes the admin key; a tenant "
            + ("uploads its adapters with POST /v1/adapters (multipart: name, files)"
               if action == "loading" else "unloads its own adapters by their names"),
            "admin_key_required",
        )  # fmt: skip
    if not server_state(request).settings.runtime_lora_updating:
        hint = (
            "; or give `tenant` to act on that tenant's adapters"
            if tenants.has_admin
            else "; or upload the adapter's files with POST /v1/adapters"
        )
        raise _forbidden(
            f"runtime LoRA updating is off on this server: start it with {_SWITCH} to "
            f"{'load' if action == 'loading' else 'unload'} server-wide adapters{hint}",
            "runtime_lora_updating_disabled",
        )


def _vllm_success(message: str) -> PlainTextResponse:
    """vLLM's answer to a runtime adapter update: 200 and a line of text."""
    return PlainTextResponse(message, status_code=200)


@router.post("/v1/load_lora_adapter", openapi_extra=json_body(LoadLoRAAdapterRequest))
async def load_lora_adapter(request: Request) -> Response:
    """vLLM's route: `{"lora_name", "lora_path"}` serves a server-local PEFT folder to every
    tenant as `lora_name` (runtime updates allowed; the admin key where the server has one);
    with `tenant` (admin key), that tenant's adapter, as /v1/adapters/register."""
    body = parse_json(await _read_body(request))
    if body.get("tenant") is not None:
        return await _register(request, body, "lora_name", "lora_path")
    _check_server_wide(request, "loading")
    service = _service(request)
    name = check_adapter_name(body.get("lora_name"), service.base_name, "lora_name")
    path = _server_path(body, "lora_path")
    await service.load_server_wide(name, str(Path(path).expanduser().resolve()))
    return _vllm_success(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=json_body(UnloadLoRAAdapterRequest))
async def unload_lora_adapter(request: Request) -> Response:
    """vLLM's route: `{"lora_name"}`. A server-wide adapter (runtime updates allowed; the
    admin key where the server has one), else one of the caller's tenant's adapters (a tenant
    key, or `tenant` with the admin key)."""
    body = parse_json(await _read_body(request))
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise bad_request("`lora_name` is required: the adapter's name", param="lora_name")
    caller = caller_of(request)
    service = _service(request)
    if body.get("tenant") is not None:
        require_admin(request)
        tenant = _target_tenant(request, body)
    elif name in server_state(request).models.server_wide:
        _check_server_wide(request, "unloading")
        await service.unload_server_wide(name)
        return _vllm_success(f"Success: LoRA adapter '{name}' removed successfully.")
    elif caller.tenant is not None:
        tenant = caller.tenant.name  # a tenant's key, or the open server's one tenant
    else:  # the admin key, naming no tenant: a server-wide adapter or nothing
        _check_server_wide(request, "unloading")  # 403 naming the switch and `tenant`
        raise adapter_not_found(name, "lora_name")
    record = await service.remove(tenant, name, param="lora_name")
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
