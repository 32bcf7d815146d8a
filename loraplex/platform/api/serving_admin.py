"""Tenant management, for the admin key only (the auth middleware guards `/admin/`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.platform.api.errors import APIError, bad_request
from loraplex.platform.api.request_body import parse_json
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenants import Tenant

router = APIRouter()
_FIELDS = ("name", "weight", "max_concurrent_requests", "tokens_per_minute")


def _tenant_not_found(name: str) -> APIError:
    return APIError(404, f"The tenant `{name}` does not exist.", type="not_found_error")


@router.post("/admin/tenants")
async def create_tenant(request: Request) -> JSONResponse:
    """`{"name", "weight"?, "max_concurrent_requests"?, "tokens_per_minute"?}` -> the tenant
    and its API key, shown only this once."""
    state = server_state(request)
    body = parse_json(await request.body())
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise bad_request(f"unknown field(s) {unknown}; known: {list(_FIELDS)}")
    try:
        tenant = Tenant(**{k: v for k, v in body.items() if v is not None})
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
