"""GET /health and GET /metrics (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.platform.api.adapter_metrics import render_adapter_metrics
from loraplex.platform.api.metrics import CONTENT_TYPE
from loraplex.platform.api.state import server_state
from loraplex.platform.core.commands import GetAdapterStats

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine thread runs; 503 once it has stopped."""
    state = server_state(request)
    if state.engine.is_running:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "engine stopped"}, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    snapshot = state.engine.snapshot()
    text = state.metrics.render(snapshot)
    text += state.tenancy.metrics.render(snapshot.stats.lora, state.tenancy.registry.disk_count())
    if state.engine.adapter_validator is not None and state.engine.is_running:
        text += render_adapter_metrics(await state.engine.command(GetAdapterStats()))
    return Response(text, media_type=CONTENT_TYPE)
