"""What the dashboard asks the engine for, between its steps: the adapters' statistics and each
tenant's running and waiting requests. One function per question, so that how the engine is
asked (an engine command, a call on its thread) changes in one place.
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.core.commands import AdapterStatsReport, GetAdapterStats
from loraplex.platform.core.errors import EngineDeadError
from loraplex.platform.engine.async_engine import AsyncEngine
from loraplex.platform.engine.engine import Engine


async def tenant_queues(engine: AsyncEngine) -> dict[str, tuple[int, int]] | None:
    """Tenant -> (running, waiting) sequences in the scheduler now; {} if the engine stopped.

    None for an engine in another process (`--api-server-count`): no engine command reports
    tenants' queues yet, and the page shows each tenant's requests in flight instead."""
    if not isinstance(engine, AsyncEngine):
        return None

    def count(core: Engine) -> dict[str, tuple[int, int]]:
        counts: dict[str, list[int]] = {}
        for request in core.scheduler.running:
            counts.setdefault(request.tenant, [0, 0])[0] += 1
        for request in core.scheduler.waiting:
            counts.setdefault(request.tenant, [0, 0])[1] += 1
        return {tenant: (running, waiting) for tenant, (running, waiting) in counts.items()}

    try:
        return await engine.call(count)  # type: ignore[return-value]
    except EngineDeadError:
        return {}


async def adapter_report(engine: AsyncEngine) -> dict[str, Any] | None:
    """The adapters the engine knows and its slot pool (`GetAdapterStats`), as JSON; None when
    LoRA is off or the engine stopped."""
    try:
        report = await engine.command(GetAdapterStats())
    except EngineDeadError:
        return None
    except ValueError:  # LoRA adapters are disabled on this engine
        return None
    return report_json(report)  # type: ignore[arg-type]


def split_engine_name(name: str) -> tuple[str, str, str]:
    """`tenant/name@digest` -> (tenant, name, `name@digest`); ("", name, name) otherwise."""
    tenant, sep, rest = name.partition("/")
    if not sep:
        return "", name, name
    return tenant, rest.rsplit("@", 1)[0], rest


def report_json(report: AdapterStatsReport) -> dict[str, Any]:
    """The report as the dashboard shows it: per adapter its tenant, its name inside the tenant,
    residency, last use (unix seconds, None if never), loads and their mean latency."""
    items = []
    for stat in report.adapters:
        tenant, name, label = split_engine_name(stat.name)
        count = stat.load_latency_count
        items.append(
            {
                "tenant": stat.tenant or tenant,
                "name": stat.label or name,
                "label": label,
                "engine_name": stat.name,
                "residency": stat.residency,
                "loading": stat.loading,
                "pinned": stat.pinned,
                "failed": stat.failed,
                "last_used": stat.last_used or None,
                "loads": stat.gpu_loads,
                "disk_loads": stat.disk_loads,
                "load_latency_mean_s": stat.load_latency_sum_s / count if count else None,
                "evictions": stat.evictions,
                "num_requests_running": stat.running_requests,
                "num_requests_waiting": stat.waiting_requests,
            }
        )
    pool = {
        "gpu_slots_used": report.gpu_slots_used,
        "gpu_slots_total": report.gpu_slots_total,
        "gpu_slots_in_use": report.gpu_slots_in_use,
        "cpu_cache_used": report.cpu_cache_used,
        "cpu_cache_total": report.cpu_cache_total,
        "loads_in_flight": report.loads_in_flight,
    }
    return {"pool": pool, "items": items}
