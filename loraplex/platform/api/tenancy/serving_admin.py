"""Tenant management, for the admin key only (the auth middleware guards `/admin/`, and turns
it off on a server without an admin key)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from loraplex.platform.api.errors import APIError, bad_request
from loraplex.platform.api.request_body import json_body, read_json_model
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.tenant_store import (
    MAX_CAP,
    MAX_WEIGHT,
    TENANT_NAME_PATTERN,
    Tenant,
)

router = APIRouter()


class TenantCreateRequest(BaseModel):
    """POST /admin/tenants. Every value is checked here, before anything is stored."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    name: str = Field(pattern=TENANT_NAME_PATTERN)
    weight: float = Field(1.0, gt=0.0, le=MAX_WEIGHT)  # share in weighted fair queuing
    max_concurrent_requests: int | None = Field(None, ge=1, le=MAX_CAP)  # sequences at once
    tokens_per_minute: int | None = Field(None, ge=1, le=MAX_CAP)  # prompt + max_tokens


def _tenant_not_found(name: str) -> APIError:
    return APIError(404, f"The tenant `{name}` does not exist.", type="not_found_error")


@router.post("/admin/tenants", openapi_extra=json_body(TenantCreateRequest))
async def create_tenant(request: Request) -> JSONResponse:
    """`{"name", "weight"?, "max_concurrent_requests"?, "tokens_per_minute"?}` -> the tenant
    and its API key, shown only this once."""
    state = server_state(request)
    limit = state.settings.max_request_body_bytes
    body = await read_json_model(request, TenantCreateRequest, limit)
    try:
        tenant = Tenant(**body.model_dump())
        key = state.tenancy.tenants.create(tenant)
    except (TypeError, ValueError) as error:
        status = 409 if "already exists" in str(error) else 400
        raise APIError(status, str(error)) from None
    await state.engine.set_tenant_weight(tenant.name, tenant.weight)
    return JSONResponse({**tenant.as_dict(), "api_key": key}, status_code=201)


@router.get("/admin/tenants")
async def list_tenants(request: Request) -> JSONResponse:
    tenants = server_state(request).tenancy.tenants.list()
    return JSONResponse({"object": "list", "data": [t.as_dict() for t in tenants]})


@router.post("/admin/tenants/{name}/rotate-key")
async def rotate_key(name: str, request: Request) -> JSONResponse:
    tenants = server_state(request).tenancy.tenants
    try:
        key = tenants.rotate_key(name)
    except ValueError as error:
        raise bad_request(str(error)) from None
    if key is None:
        raise _tenant_not_found(name)
    return JSONResponse({"name": name, "api_key": key})


@router.delete("/admin/tenants/{name}")
async def delete_tenant(name: str, request: Request) -> JSONResponse:
    """Delete a stored tenant and its adapters."""
    state = server_state(request)
    try:
        deleted = state.tenancy.tenants.delete(name)
    except ValueError as error:
        raise bad_request(str(error)) from None
    if not deleted:
        raise _tenant_not_found(name)
    service = request.app.state.adapters
    for record in state.tenancy.registry.list(name):
        await service.remove(name, record.name)
    return JSONResponse({"name": name, "deleted": True})


async def sync_weights(state: ServerState) -> None:
    """Give the engine every tenant's fair-queuing weight (at startup)."""
    for tenant in state.tenancy.all_tenants():
        await state.engine.set_tenant_weight(tenant.name, tenant.weight)
