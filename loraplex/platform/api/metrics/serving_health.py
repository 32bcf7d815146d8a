"""GET /health, GET /metrics (Prometheus text format) and GET /adapters/resident (the adapters in
this replica's GPU slots, for a router's resync after a restart).

What they show without a key. On an open server (no admin key, no tenant) everything: there is
one tenant, and nothing is private. On a closed server, only what names no tenant and no
tenant's adapter: the engine's series, latency histograms, adapter pool gauges and residency by
tier, and `lora_requests_info` listing only the server-wide adapters (`--lora-modules`, which
every tenant's `/v1/models` shows), or every adapter by the name clients send in `model` with
`--metrics-public-adapter-names` (the GIE endpoint picker sends no key and needs them for LoRA
affinity; tenant names stay hidden). `Authorization: Bearer` with the metrics key
(`--metrics-key`, LORAPLEX_METRICS_KEY) or the admin key shows everything, as does any request
to an open server; /adapters/resident answers 401 on a closed server without one of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from loraplex import envs
from loraplex.platform.api.metrics.adapter_metrics import render_adapter_metrics
from loraplex.platform.api.metrics.gie_metrics import LoRAInfoGauge, served_name
from loraplex.platform.api.metrics.server_metrics import CONTENT_TYPE
from loraplex.platform.api.metrics.vllm_metrics import render_vllm_metrics
from loraplex.platform.api.state import ServerState, server_state
from loraplex.platform.api.tenancy.auth import unauthorized
from loraplex.platform.api.tenancy.tenancy import BEARER
from loraplex.platform.core.commands import AdapterStatsReport, GetAdapterStats

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
    full = sees_names(request)
    report = None
    if state.engine.adapter_validator is not None and state.engine.is_running:
        report = await state.engine.command(GetAdapterStats())
    # NOTE: the snapshot after the report (which waits for a pause between steps), so the load
    # gauges are no older than the adapter series.
    snapshot = state.engine.snapshot()
    text = state.metrics.render(snapshot)
    text += render_vllm_metrics(state.metrics, snapshot)
    text += state.tenancy.metrics.render(
        snapshot.stats.lora, state.tenancy.registry.disk_count(), with_names=full
    )
    if report is not None:
        public = full or state.settings.metrics_public_adapter_names
        text += _lora_info(request, full).render(report if public else _server_wide(report))
        text += render_adapter_metrics(report if full else _server_wide(report))
    return Response(text, media_type=CONTENT_TYPE)


@router.get("/adapters/resident")
async def resident_adapters(request: Request) -> JSONResponse:
    """The adapters in this replica's GPU slots, as `/metrics`' `lora_requests_info` names them,
    with their tenant and load: what a router needs to rebuild its affinity table after it (or
    this replica) restarts. On a closed server, for the metrics or admin key only (401)."""
    state = server_state(request)
    if not sees_names(request):
        raise unauthorized(
            "/adapters/resident takes the metrics key (--metrics-key) or the admin key"
        )
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


def sees_names(request: Request) -> bool:
    """Whether the caller may see tenants' and adapters' names: any caller of an open server,
    and a caller with the metrics key or the admin key."""
    state = server_state(request)
    if state.tenancy.tenants.is_open:
        return True
    header = request.headers.get("authorization") or ""
    if not header.lower().startswith(BEARER):
        return False
    key = header[len(BEARER) :].strip()
    return bool(key) and (state.tenancy.tenants.is_admin_key(key) or _is_metrics_key(state, key))


def _is_metrics_key(state: ServerState, key: str) -> bool:
    expected = state.settings.metrics_key or envs.metrics_key()
    if not expected:
        return False
    digest = hashlib.sha256(key.encode()).digest()
    return secrets.compare_digest(digest, hashlib.sha256(expected.encode()).digest())


def _server_wide(report: AdapterStatsReport) -> AdapterStatsReport:
    """The report with only the server-wide adapters (no tenant's): what a caller without a key
    may see named."""
    return dataclasses.replace(report, adapters=tuple(s for s in report.adapters if not s.tenant))


def _lora_info(request: Request, full: bool) -> LoRAInfoGauge:
    """The app's `LoRAInfoGauge` for a caller who sees every name, or for one who does not (each
    remembers when its own label set last changed)."""
    gauges = getattr(request.app.state, "lora_info", None)
    if gauges is None:
        gauges = request.app.state.lora_info = {True: LoRAInfoGauge(), False: LoRAInfoGauge()}
    return gauges[full]
