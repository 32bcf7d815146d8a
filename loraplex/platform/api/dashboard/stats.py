"""`StatsCollector`: the figures behind `GET /admin/stats` and the dashboard page.

Nothing here is measured anew: the engine's snapshot (gauges, token and step counters), the
tenants' counters (`TenantMetrics`), the tenants' caps and weights, and the adapter statistics
the engine reports. The collector samples the snapshot and the counters once a second into a
ring of `history_s` seconds, so that rates (tokens per second, step time) and the page's time
series come from differences of counters, as Prometheus' `rate()` would compute them.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from loraplex.platform.api.dashboard.sources import (
    adapter_report,
    split_engine_name,
    tenant_queues,
)
from loraplex.platform.api.metrics.tenant_metrics import TenantCounts
from loraplex.platform.api.state import ServerState
from loraplex.platform.core.stats import EngineSnapshot

SAMPLE_PERIOD_S = 1.0
HISTORY_S = 600.0  # the page's chart: the last ten minutes
NOW_WINDOW_S = 5.0  # "now" rates: over the last few seconds
TENANT_WINDOW_S = 60.0  # per-tenant rates and shares: over the last minute
LATENCY_WINDOW_S = 300.0  # latency quantiles: requests finished in the last five minutes
QUANTILES = (0.5, 0.95)


@dataclass(frozen=True)
class StatsSample:
    """The counters at one moment."""

    monotonic: float
    wall: float  # unix seconds
    snapshot: EngineSnapshot
    tenants: TenantCounts
    latency: dict[str, tuple[int, ...]]  # histogram name -> its bucket counts


def _tenant_tokens(counts: TenantCounts) -> dict[str, tuple[int, int]]:
    """Tenant -> (prompt, generated) tokens over all its adapters."""
    totals: dict[str, tuple[int, int]] = {}
    for (tenant, _), value in counts.prompt_tokens.items():
        prompt, generated = totals.get(tenant, (0, 0))
        totals[tenant] = (prompt + value, generated)
    for (tenant, _), value in counts.generation_tokens.items():
        prompt, generated = totals.get(tenant, (0, 0))
        totals[tenant] = (prompt, generated + value)
    return totals


def _rate(new: float, old: float, seconds: float) -> float:
    return max(0.0, new - old) / seconds if seconds > 0 else 0.0


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """The q-quantile of observations counted per bucket (`counts` has one more entry than
    `bounds`: those above every bound), interpolated linearly inside its bucket as Prometheus'
    `histogram_quantile` does; None without observations. In the top bucket it answers the
    highest bound."""
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    below = 0
    for i, count in enumerate(counts):
        if count and below + count >= rank:
            if i == len(bounds):
                return bounds[-1]
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / count
        below += count
    return bounds[-1]


class StatsCollector:
    """Samples the server's counters and builds the `/admin/stats` document."""

    def __init__(
        self, state: ServerState, period_s: float = SAMPLE_PERIOD_S, history_s: float = HISTORY_S
    ) -> None:
        if period_s <= 0 or history_s < period_s:
            raise ValueError(f"need 0 < period_s <= history_s, got {period_s}, {history_s}")
        self.state = state
        self.period_s = period_s
        self._samples: deque[StatsSample] = deque(maxlen=int(history_s / period_s) + 1)

    # -- sampling ---------------------------------------------------------------------------

    def sample(self) -> StatsSample:
        """Record the counters now (skipped when the last sample is under half a period old)."""
        now = time.monotonic()
        if self._samples and now - self._samples[-1].monotonic < self.period_s / 2:
            return self._samples[-1]
        metrics = self.state.metrics
        sample = StatsSample(
            now,
            time.time(),
            self.state.engine.snapshot(),
            self.state.tenancy.metrics.counts(),
            {h.name: h.bucket_counts() for h in (metrics.ttft, metrics.itl, metrics.e2e)},
        )
        self._samples.append(sample)
        return sample

    async def run(self) -> None:
        """Sample every `period_s` until cancelled."""
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    @asynccontextmanager
    async def sampling(self) -> AsyncIterator[None]:
        """Run the sampler for the lifetime of the server."""
        task = asyncio.create_task(self.run(), name="loraplex-dashboard-sampler")
        try:
            yield
        finally:
            task.cancel()

    def _since(self, seconds: float) -> StatsSample:
        """The oldest sample at most `seconds` old (the latest one if none is)."""
        latest = self._samples[-1]
        for sample in self._samples:
            if latest.monotonic - sample.monotonic <= seconds:
                return sample
        return latest

    # -- the document -----------------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        """The `/admin/stats` document (see docs in the README's dashboard section)."""
        latest = self.sample()
        queues = await tenant_queues(self.state.engine)
        adapters = await adapter_report(self.state.engine)
        return {
            "object": "loraplex.stats",
            "time": latest.wall,
            "model": self.state.engine.served_model_name,
            "engine": self._engine(latest),
            "latency": self._latency(latest),
            "series": self._series(),
            "tenants": self._tenants(latest, queues),
            "adapters": self._adapters(latest, adapters),
        }

    def _engine(self, latest: StatsSample) -> dict[str, Any]:
        s = latest.snapshot
        stats = s.stats
        old = self._since(NOW_WINDOW_S)
        seconds = latest.monotonic - old.monotonic
        steps = s.num_steps - old.snapshot.num_steps
        if steps <= 0:  # idle lately: the mean since start
            steps, step_s = s.num_steps, s.step_seconds_total
        else:
            step_s = s.step_seconds_total - old.snapshot.step_seconds_total
        return {
            "num_requests_running": stats.num_running,
            "num_requests_waiting": stats.num_waiting,
            "kv_cache_usage_perc": stats.kv_usage,
            "num_kv_blocks_used": stats.num_total_blocks - stats.num_free_blocks,
            "num_kv_blocks_free": stats.num_free_blocks,
            "num_kv_blocks_total": stats.num_total_blocks,
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "num_preemptions": stats.num_preemptions,
            "requests_watchdog_aborted": s.watchdog_aborted_total,
            "prompt_tokens_total": s.prompt_tokens_total,
            "generation_tokens_total": s.generation_tokens_total,
            "prompt_tokens_per_s": _rate(
                s.prompt_tokens_total, old.snapshot.prompt_tokens_total, seconds
            ),
            "generation_tokens_per_s": _rate(
                s.generation_tokens_total, old.snapshot.generation_tokens_total, seconds
            ),
            "num_steps": s.num_steps,
            "step_time_ms": 1000.0 * step_s / steps if steps else None,
        }

    def _latency(self, latest: StatsSample) -> dict[str, Any]:
        """p50 and p95 of TTFT, inter-token latency and end-to-end latency (seconds) over the
        requests that finished in the last LATENCY_WINDOW_S (None when none did)."""
        old = self._since(LATENCY_WINDOW_S)
        metrics = self.state.metrics
        out: dict[str, Any] = {"window_s": latest.monotonic - old.monotonic}
        for key, histogram in (("ttft_s", metrics.ttft), ("itl_s", metrics.itl),
                               ("e2e_s", metrics.e2e)):  # fmt: skip
            now, before = latest.latency[histogram.name], old.latency[histogram.name]
            counts = [a - b for a, b in zip(now, before)]
            out[key] = {
                "count": sum(counts),
                **{
                    f"p{round(100 * q)}": histogram_quantile(q, histogram.buckets, counts)
                    for q in QUANTILES
                },  # fmt: skip
            }
        return out

    def _series(self) -> dict[str, Any]:
        """Per sample interval: token rates and the gauges at its end."""
        points = []
        samples = list(self._samples)
        for old, new in zip(samples, samples[1:]):
            seconds = new.monotonic - old.monotonic
            stats = new.snapshot.stats
            points.append(
                {
                    "t": new.wall,
                    "prompt_tokens_per_s": _rate(
                        new.snapshot.prompt_tokens_total, old.snapshot.prompt_tokens_total, seconds
                    ),
                    "generation_tokens_per_s": _rate(
                        new.snapshot.generation_tokens_total,
                        old.snapshot.generation_tokens_total,
                        seconds,
                    ),
                    "kv_cache_usage_perc": stats.kv_usage,
                    "num_requests_running": stats.num_running,
                    "num_requests_waiting": stats.num_waiting,
                }
            )
        return {"period_s": self.period_s, "points": points}

    def _tenants(
        self, latest: StatsSample, queues: dict[str, tuple[int, int]] | None
    ) -> list[dict[str, Any]]:
        """Per tenant: caps, queues (None when the engine cannot say), tokens, shares."""
        counts = latest.tenants
        configured = {t.name: t for t in self.state.tenancy.all_tenants()}
        now_tokens = _tenant_tokens(counts)
        old = self._since(TENANT_WINDOW_S)
        old_tokens = _tenant_tokens(old.tenants)
        seconds = latest.monotonic - old.monotonic
        names = sorted(set(configured) | set(now_tokens) | set(counts.requests))
        recent = {}  # tenant -> tokens in the window
        for name in names:
            prompt, generated = now_tokens.get(name, (0, 0))
            old_prompt, old_generated = old_tokens.get(name, (0, 0))
            recent[name] = (prompt - old_prompt, generated - old_generated)
        # NOTE: the engine's count, for the whole server: sequences running or queued
        in_flight = {name: sum((queues or {}).get(name, (0, 0))) for name in names}
        active = [n for n in names if sum(recent[n]) or in_flight[n]]
        weights = {n: configured[n].weight if n in configured else 1.0 for n in names}
        share_total = sum(weights[n] for n in active or names)
        used_total = sum(sum(recent[n]) for n in names)
        rows = []
        for name in names:
            tenant = configured.get(name)
            prompt, generated = now_tokens.get(name, (0, 0))
            running, waiting = (None, None) if queues is None else queues.get(name, (0, 0))
            in_share = name in active or not active
            rows.append(
                {
                    "name": name,
                    "weight": weights[name],
                    "max_concurrent_requests": tenant.max_concurrent_requests if tenant else None,
                    "tokens_per_minute": tenant.tokens_per_minute if tenant else None,
                    "num_requests_running": running,
                    "num_requests_waiting": waiting,
                    "num_requests_in_flight": in_flight[name],
                    "prompt_tokens_total": prompt,
                    "generation_tokens_total": generated,
                    "prompt_tokens_per_s": _rate(recent[name][0], 0, seconds),
                    "generation_tokens_per_s": _rate(recent[name][1], 0, seconds),
                    "requests_total": counts.requests.get(name, 0),
                    "errors_total": counts.errors.get(name, 0),
                    "rate_limited_total": counts.rate_limited.get(name, 0),
                    "fair_share": weights[name] / share_total if in_share else 0.0,
                    "use_share": sum(recent[name]) / used_total if used_total else 0.0,
                }
            )
        return rows

    def _adapters(self, latest: StatsSample, report: dict[str, Any] | None) -> dict[str, Any]:
        """The engine's adapters, plus every catalogued adapter it has not seen yet (on disk)."""
        report = report or {"pool": None, "items": []}
        requests = latest.tenants.adapter_requests
        items = []
        seen = set()
        for item in report["items"]:
            key = (item["tenant"], item["label"])
            seen.add((item["tenant"], item["engine_name"]))
            items.append({**item, "requests_total": requests.get(key, 0)})
        for record in self.state.tenancy.registry.list():
            if (record.tenant, record.engine_name) in seen:
                continue
            label = split_engine_name(record.engine_name)[2]
            items.append(
                {
                    "tenant": record.tenant,
                    "name": record.name,
                    "label": label,
                    "engine_name": record.engine_name,
                    "residency": "disk",
                    "loading": False,
                    "pinned": False,
                    "failed": "",
                    "last_used": None,
                    "loads": 0,
                    "disk_loads": 0,
                    "load_latency_mean_s": None,
                    "evictions": 0,
                    "num_requests_running": 0,
                    "num_requests_waiting": 0,
                    "requests_total": requests.get((record.tenant, label), 0),
                }
            )
        items.sort(key=lambda i: (i["tenant"], i["name"], i["engine_name"]))
        return {"pool": report["pool"], "items": items}
