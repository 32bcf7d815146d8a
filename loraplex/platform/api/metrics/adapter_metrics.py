"""Per-adapter Prometheus metrics, rendered from the engine's `AdapterStatsReport`.

/metrics asks the engine for the report by a `GetAdapterStats` command at scrape time, so the
step loop does no metrics work. Every series of one adapter version carries its `tenant` and
`adapter` (`name@digest`, as the per-tenant token counters label it) labels.
"""

from __future__ import annotations

import math

from loraplex.platform.api.metrics.server_metrics import _labels
from loraplex.platform.api.metrics.tenant_metrics import adapter_label
from loraplex.platform.core.commands import (
    LOAD_LATENCY_BUCKETS_S,
    RESIDENCIES,
    AdapterStat,
    AdapterStatsReport,
)


def _ids(stat: AdapterStat) -> dict[str, str]:
    return {"tenant": stat.tenant, "adapter": adapter_label(stat.name)}


def _header(name: str, help: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]


def render_adapter_metrics(report: AdapterStatsReport | None) -> str:
    """The report as Prometheus text: pool gauges, then per-adapter series; '' without LoRA."""
    if report is None:
        return ""
    lines: list[str] = []
    pools = (
        ("loraplex:lora_gpu_slots_used", "GPU adapter slots holding an adapter.",
         report.gpu_slots_used),
        ("loraplex:lora_gpu_slots_total", "GPU adapter slots (max_loras).",
         report.gpu_slots_total),
        ("loraplex:lora_gpu_slots_in_use", "GPU adapter slots pinned by running requests or "
         "PinAdapter.", report.gpu_slots_in_use),
        ("loraplex:lora_cpu_cache_used", "Adapters in the host cache.", report.cpu_cache_used),
        ("loraplex:lora_cpu_cache_total", "Host cache capacity (max_cpu_loras).",
         report.cpu_cache_total),
        ("loraplex:lora_loads_in_flight", "Adapter reads under way.", report.loads_in_flight),
    )  # fmt: skip
    for name, help, value in pools:
        lines += _header(name, help, "gauge") + [f"{name} {value}"]
    adapters = sorted(report.adapters, key=lambda a: (a.tenant, a.name))
    name = "loraplex:adapter_residency"
    lines += _header(name, "1 for the tier holding the adapter's weights (gpu, cpu, disk).",
                     "gauge")  # fmt: skip
    for stat in adapters:
        for tier in RESIDENCIES:
            labels = _labels({**_ids(stat), "tier": tier})
            lines.append(f"{name}{labels} {int(stat.residency == tier)}")
    per_adapter = (
        ("loraplex:adapter_loads_total", "counter", "Adapter loads, by source tier.",
         lambda s: [({"tier": "disk"}, s.disk_loads), ({"tier": "gpu"}, s.gpu_loads)]),
        ("loraplex:adapter_evictions_total", "counter", "Times the adapter lost its GPU slot.",
         lambda s: [({}, s.evictions)]),
        ("loraplex:adapter_running_requests", "gauge", "Requests running on the adapter.",
         lambda s: [({}, s.running_requests)]),
        ("loraplex:adapter_waiting_requests", "gauge", "Requests queued for the adapter.",
         lambda s: [({}, s.waiting_requests)]),
        ("loraplex:adapter_pinned", "gauge", "1 while PinAdapter keeps it in a GPU slot.",
         lambda s: [({}, int(s.pinned))]),
        ("loraplex:adapter_last_used_timestamp_seconds", "gauge",
         "Unix time a request last started or ended on the adapter.",
         lambda s: [({}, s.last_used)]),
    )  # fmt: skip
    for name, kind, help, values in per_adapter:
        lines += _header(name, help, kind)
        for stat in adapters:
            for extra, value in values(stat):
                lines.append(f"{name}{_labels({**_ids(stat), **extra})} {value}")
    name = "loraplex:adapter_load_latency_seconds"
    lines += _header(name, "From the request for an adapter's load to its GPU slot written.",
                     "histogram")  # fmt: skip
    for stat in adapters:
        cumulative = 0
        for bound, count in zip(LOAD_LATENCY_BUCKETS_S, stat.load_latency_buckets):
            cumulative += count
            le = "+Inf" if math.isinf(bound) else f"{bound:g}"
            lines.append(f"{name}_bucket{_labels({**_ids(stat), 'le': le})} {cumulative}")
        lines.append(f"{name}_sum{_labels(_ids(stat))} {stat.load_latency_sum_s}")
        lines.append(f"{name}_count{_labels(_ids(stat))} {stat.load_latency_count}")
    return "\n".join(lines) + "\n"
