"""The LoRA gauge of the Gateway API Inference Extension's model-server protocol.

GIE's endpoint picker (EPP) routes a request to a replica where its adapter is already in GPU
memory by reading one gauge per replica, `vllm:lora_requests_info` in vLLM, here
`loraplex:lora_requests_info`. Its labels carry the information:

- `max_lora`: GPU adapter slots (`max_loras`): beyond that many, a new adapter waits for a slot;
- `running_lora_adapters`: comma-separated adapters that requests are running on (their slots
  are pinned), as vLLM reports them;
- `waiting_lora_adapters`: comma-separated adapters with requests queued and none running;

and its value is the unix time the label set last changed: the EPP keeps the series of the
highest value, so a scrape that saw an older set (another API process) never wins. Adapters are
named as clients name them in `model` (the tenant-facing name), which is what the EPP matches.

NOTE: an adapter in a GPU slot with no request on it is in neither list, as in vLLM: the EPP's
`lora-affinity-scorer` reads `len(running) + len(waiting) < max_lora` as "room to load one
more", and an idle slot is room (it is evicted on demand). GET /adapters/resident lists every
adapter in a GPU slot.

The other gauges the protocol reads (`num_requests_waiting`, `num_requests_running`,
`kv_cache_usage_perc`) are `ServerMetrics`' engine series under the same prefix.
"""

from __future__ import annotations

import threading
import time

from loraplex.platform.api.metrics.server_metrics import _labels
from loraplex.platform.core.commands import AdapterStat, AdapterStatsReport

LORA_INFO = "loraplex:lora_requests_info"


def served_name(stat: AdapterStat) -> str:
    """The adapter's name as a client sends it in `model` (its engine name without a label)."""
    return stat.label or stat.name


def running_names(report: AdapterStatsReport) -> tuple[str, ...]:
    """Adapters requests run on, sorted and without repeats (two tenants may share a name)."""
    return tuple(sorted({served_name(s) for s in report.adapters if s.running_requests > 0}))


def waiting_names(report: AdapterStatsReport) -> tuple[str, ...]:
    """Adapters with queued requests and none running, sorted and without repeats."""
    running = set(running_names(report))
    queued = {served_name(s) for s in report.adapters if s.waiting_requests > 0}
    return tuple(sorted(queued - running))


class LoRAInfoGauge:
    """Renders `loraplex:lora_requests_info`, remembering when its label set last changed."""

    def __init__(self, clock=time.time) -> None:
        self._clock = clock
        self._labels: dict[str, str] | None = None
        self._since = 0.0
        self._lock = threading.Lock()

    def render(self, report: AdapterStatsReport | None) -> str:
        """The gauge's HELP, TYPE and one series; '' on a server without LoRA."""
        if report is None:
            return ""
        labels = {
            "max_lora": str(report.gpu_slots_total),
            "running_lora_adapters": ",".join(running_names(report)),
            "waiting_lora_adapters": ",".join(waiting_names(report)),
        }
        with self._lock:
            if labels != self._labels:
                # NOTE: strictly increasing even if the clock stands still between two changes,
                # so the EPP's "highest value wins" always picks the newest set.
                self._since = max(self._clock(), self._since + 1e-3)
                self._labels = labels
            since = self._since
        return (
            f"# HELP {LORA_INFO} Adapters requests run on and adapters requests wait for (GIE "
            "model-server protocol); the value is the unix time this label set was first seen.\n"
            f"# TYPE {LORA_INFO} gauge\n"
            f"{LORA_INFO}{_labels(labels)} {since!r}\n"
        )
