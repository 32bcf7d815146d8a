"""GET /health, GET /metrics (Prometheus text format) and GET /adapters/resident (the adapters in
this replica's GPU slots, for a router's resync after a restart)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex.platform.api.metrics.adapter_metrics import render_adapter_metrics
from loraplex.platform.api.metrics.gie_metrics import LoRAInfoGauge, served_name
from loraplex.platform.api.metrics.server_metrics import CONTENT_TYPE
from loraplex.platform.api.metrics.vllm_metrics import render_vllm_metrics
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
    report = None
    if state.engine.adapter_validator is not None and state.engine.is_running:
        report = await state.engine.command(GetAdapterStats())
    # NOTE: the snapshot after the report (which waits for a pause between steps), so the load
    # gauges are no older than the adapter series.
    snapshot = state.engine.snapshot()
    text = state.metrics.render(snapshot)
    text += render_vllm_metrics(state.metrics, snapshot)
    text += state.tenancy.metrics.render(snapshot.stats.lora, state.tenancy.registry.disk_count())
    if report is not None:
        text += _lora_info(request).render(report)
        text += render_adapter_metrics(report)
    return Response(text, media_type=CONTENT_TYPE)


@router.get("/adapters/resident")
async def resident_adapters(request: Request) -> JSONResponse:
    """The adapters in this replica's GPU slots, as `/metrics`' `lora_requests_info` names them,
    with their tenant and load: what a router needs to rebuild its affinity table after it (or
    this replica) restarts. Public, like /metrics."""
    state = server_state(request)
    if state.engine.adapter_validator is None or not state.engine.is_running:
        return JSONResponse({"object": "list", "max_lora": 0, "data": []})
    report = await state.engine.command(GetAdapterStats())
    data = [
        {
            "id": served_name(stat),
            "object": "resident_adapter",
            "tenant": stat.tenant,
            "engine_name": stat.name,
            "pinned": stat.pinned,
            "running_requests": stat.running_requests,
            "waiting_requests": stat.waiting_requests,
            "last_used": stat.last_used,
        }
        for stat in sorted(report.adapters, key=lambda s: (s.tenant, s.name))
        if stat.residency == "gpu"
    ]
    return JSONResponse({"object": "list", "max_lora": report.gpu_slots_total, "data": data})


def _lora_info(request: Request) -> LoRAInfoGauge:
    """The app's one `LoRAInfoGauge` (it remembers when its label set last changed)."""
    gauge = getattr(request.app.state, "lora_info", None)
    if gauge is None:
        gauge = request.app.state.lora_info = LoRAInfoGauge()
    return gauge
