"""GET /v1/models and GET /v1/models/{model}: what the `model` field may name."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import tenant_of
from loraplex.platform.api.tenancy.model_resolver import ServedModel

router = APIRouter()


def _model_card(model: ServedModel, state: ServerState) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "loraplex",
        "root": model.root,
        "parent": None if model.adapter is None else model.root,
        "max_model_len": state.engine.max_model_len,
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = server_state(request)
    tenant = tenant_of(request).name
    cards = [_model_card(m, state) for m in state.models.list_models(tenant)]
    return JSONResponse({"object": "list", "data": cards})


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    state = server_state(request)
    served = state.models.resolve_model(model, tenant_of(request).name)
    return JSONResponse(_model_card(served, state))
