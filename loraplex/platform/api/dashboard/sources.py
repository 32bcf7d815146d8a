"""What the dashboard asks the engine for, between its steps: the adapters' statistics and each
tenant's running and waiting requests. One function per question, each an engine command, so an
engine in another process answers as one in this process does.
"""

from __future__ import annotations

from typing import Any

from loraplex.platform.core.commands import AdapterStatsReport
from loraplex.platform.core.errors import EngineDeadError
from loraplex.platform.engine.protocol import EngineClient


async def tenant_queues(engine: EngineClient) -> dict[str, tuple[int, int]]:
    """Tenant -> (running, waiting) sequences in the scheduler now; {} if the engine stopped."""
    try:
        report = await engine.tenant_stats()
    except EngineDeadError:
        return {}
    return {t.tenant: (t.running_requests, t.waiting_requests) for t in report.tenants}


async def adapter_report(engine: EngineClient) -> dict[str, Any] | None:
    """The adapters the engine knows and its slot pool (`GetAdapterStats`), as JSON; None when
    LoRA is off or the engine stopped."""
    try:
        report = await engine.adapter_stats()
    except EngineDeadError:
        return None
    except ValueError:  # LoRA adapters are disabled on this engine
        return None
    return report_json(report)


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
