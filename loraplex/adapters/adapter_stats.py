"""Adapter statistics: what the slot pool's counters do not know (each version's last use and
load latencies), and the two typed snapshots built from everything, here and nowhere else:
`LoRAStats` (in every `EngineStats`, for Prometheus' LoRA gauges and counters) and
`AdapterStatsReport` (the `GetAdapterStats` result: the dashboard and per-adapter metrics).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraplex.adapters.adapter_names import AdapterNames
from loraplex.adapters.loader import AdapterLoader
from loraplex.adapters.slot_pool import LoRASlotPool
from loraplex.platform.core.commands import (
    LOAD_LATENCY_BUCKETS_S,
    AdapterStat,
    AdapterStatsReport,
)
from loraplex.platform.core.stats import LoRAStats

if TYPE_CHECKING:
    from loraplex.adapters.slot_admission import SlotAdmission


@dataclass
class KeyStats:
    """One adapter version's last use and load latencies (disk or host -> slot written)."""

    last_used: float = 0.0  # unix time a request last started or ended on it
    load_started: float | None = None  # monotonic time the pending load was asked for
    latency_counts: list[int] = field(default_factory=lambda: [0] * len(LOAD_LATENCY_BUCKETS_S))
    latency_sum_s: float = 0.0
    latency_count: int = 0

    def load_asked(self) -> None:
        """A load was asked for (the first ask of a pending load starts its clock)."""
        if self.load_started is None:
            self.load_started = time.monotonic()

    def load_ready(self) -> None:
        """The slot is written: the pending load, if any, took until now."""
        if self.load_started is not None:
            seconds = time.monotonic() - self.load_started
            self.load_started = None
            self.latency_counts[bisect.bisect_left(LOAD_LATENCY_BUCKETS_S, seconds)] += 1
            self.latency_sum_s += seconds
            self.latency_count += 1


class AdapterStats:
    """`KeyStats` per adapter version, and the snapshots."""

    def __init__(self) -> None:
        self._keys: dict[str, KeyStats] = {}

    def of(self, key: str) -> KeyStats:
        stats = self._keys.get(key)
        if stats is None:
            stats = self._keys[key] = KeyStats()
        return stats

    @staticmethod
    def snapshot(names: AdapterNames, pool: LoRASlotPool) -> LoRAStats:
        """The gauges and counters of every step's `EngineStats`."""
        c = pool.counters
        return LoRAStats(
            registered=len(names),
            gpu_resident=pool.gpu_resident(),
            gpu_pinned=pool.pinned(),
            cpu_resident=pool.cpu_resident(),
            gpu_loads=c.gpu_loads,
            gpu_evictions=c.gpu_evictions,
            disk_loads=c.disk_loads,
            cpu_evictions=c.cpu_evictions,
        )

    def report(
        self,
        names: AdapterNames,
        admission: SlotAdmission,
        loader: AdapterLoader,
        waiting: Counter[str],
    ) -> AdapterStatsReport:
        """Every registered adapter (and every version removed or replaced while requests
        still run on it), and the pools behind them; `waiting` counts queued requests per key."""
        pool = admission.pool
        c = pool.counters
        running = admission.running_requests()
        rows = [(name, e.key, e.tenant, e.label, True) for name, e in names.items()]
        registered = {key for _, key, *_ in rows}
        rows += [(k, k, "", "", False) for k in sorted(admission.held_keys() - registered)]
        adapters = []
        for name, key, tenant, label, is_registered in rows:
            stats = self.of(key)
            if pool.slot_of(key) is not None:
                residency = "gpu"
            elif pool.has_host(key):
                residency = "cpu"
            else:
                residency = "disk"
            adapters.append(
                AdapterStat(
                    name=name,
                    key=key,
                    tenant=tenant,
                    label=label,
                    residency=residency,
                    loading=loader.is_reading(key) or stats.load_started is not None,
                    pinned=is_registered and admission.is_pinned(name),
                    registered=is_registered,
                    failed=admission.failure(key) or "",
                    last_used=stats.last_used,
                    gpu_loads=c.gpu_loads_by_key[key],
                    disk_loads=c.disk_loads_by_key[key],
                    evictions=c.gpu_evictions_by_key[key],
                    load_latency_buckets=tuple(stats.latency_counts),
                    load_latency_sum_s=stats.latency_sum_s,
                    load_latency_count=stats.latency_count,
                    running_requests=running[key],
                    waiting_requests=waiting[key],
                )
            )
        return AdapterStatsReport(
            adapters=tuple(adapters),
            gpu_slots_used=pool.gpu_resident(),
            gpu_slots_total=pool.num_slots,
            gpu_slots_in_use=pool.pinned(),
            cpu_cache_used=pool.cpu_resident(),
            cpu_cache_total=pool.max_cpu_loras,
            loads_in_flight=loader.num_in_flight,
        )
