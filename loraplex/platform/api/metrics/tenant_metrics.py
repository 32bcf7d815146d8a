"""Per-tenant and per-adapter series for /metrics: requests, errors, tokens, and the adapters'
residency (GPU / CPU / disk), loads and evictions.

Request and error counts come from the auth middleware (one per HTTP generation request);
token counts come from the engine's timing observer (tenants' token budgets are charged in the
engine loop: `engine/tenant_limits.py`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from loraplex.platform.api.metrics.server_metrics import _labels
from loraplex.platform.core.stats import LoRAStats
from loraplex.platform.core.timing import RequestTiming


def adapter_label(engine_name: str | None) -> str:
    """`tenant/name@digest` -> `name@digest` (the tenant is a label of its own); '' = base."""
    if engine_name is None:
        return ""
    return engine_name.split("/", 1)[-1]


@dataclass(frozen=True)
class TenantCounts:
    """A copy of TenantMetrics' counters at one moment (the dashboard reads these)."""

    requests: dict[str, int]
    errors: dict[str, int]
    rate_limited: dict[str, int]  # answered 429
    prompt_tokens: dict[tuple[str, str], int]  # (tenant, adapter label) -> tokens
    generation_tokens: dict[tuple[str, str], int]
    adapter_requests: dict[tuple[str, str], int]


class TenantMetrics:
    """Counters keyed by tenant (and adapter); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.rate_limited: Counter[str] = Counter()
        self.prompt_tokens: Counter[tuple[str, str]] = Counter()
        self.generation_tokens: Counter[tuple[str, str]] = Counter()
        self.adapter_requests: Counter[tuple[str, str]] = Counter()

    def count_request(self, tenant: str, status: int) -> None:
        with self._lock:
            self.requests[tenant] += 1
            if status >= 400:
                self.errors[tenant] += 1
            if status == 429:
                self.rate_limited[tenant] += 1

    def counts(self) -> TenantCounts:
        """A consistent copy of every counter."""
        with self._lock:
            return TenantCounts(
                dict(self.requests),
                dict(self.errors),
                dict(self.rate_limited),
                dict(self.prompt_tokens),
                dict(self.generation_tokens),
                dict(self.adapter_requests),
            )

    def observe(self, timing: RequestTiming) -> None:
        """A TimingObserver: tokens per tenant and adapter."""
        key = (timing.tenant, adapter_label(timing.adapter))
        with self._lock:
            self.prompt_tokens[key] += timing.num_prompt_tokens
            self.generation_tokens[key] += timing.num_generation_tokens
            self.adapter_requests[key] += 1

    def render(self, lora: LoRAStats | None, adapters_on_disk: int, with_names: bool = True) -> str:
        """The series as Prometheus text; without names, only the residency by tier (no series
        that names a tenant or an adapter)."""
        lines: list[str] = []
        with self._lock:
            per_tenant = (
                ("loraplex:tenant_requests_total", "HTTP generation requests.", self.requests),
                ("loraplex:tenant_request_errors_total", "Requests answered 4xx/5xx.", self.errors),
                ("loraplex:tenant_rate_limited_total", "Requests answered 429.", self.rate_limited),
            )
            per_adapter = (
                ("loraplex:tenant_prompt_tokens_total", "Prompt tokens of finished requests.",
                 self.prompt_tokens),
                ("loraplex:tenant_generation_tokens_total", "Tokens generated.",
                 self.generation_tokens),
                ("loraplex:adapter_requests_total", "Finished engine requests.",
                 self.adapter_requests),
            )  # fmt: skip
            if not with_names:
                per_tenant = per_adapter = ()
            for name, help, counter in per_tenant:
                lines += [f"# HELP {name} {help}", f"# TYPE {name} counter"]
                for tenant, value in sorted(counter.items()):
                    lines.append(f"{name}{_labels({'tenant': tenant})} {value}")
            for name, help, counter in per_adapter:
                lines += [f"# HELP {name} {help} By tenant and adapter.", f"# TYPE {name} counter"]
                for (tenant, adapter), value in sorted(counter.items()):
                    labels = _labels({"tenant": tenant, "adapter": adapter})
                    lines.append(f"{name}{labels} {value}")
        lines += _residency(lora, adapters_on_disk)
        return "\n".join(lines) + "\n"


def _residency(lora: LoRAStats | None, adapters_on_disk: int) -> list[str]:
    name = "loraplex:lora_adapters_resident"
    lines = [f"# HELP {name} Adapter versions resident, by tier.", f"# TYPE {name} gauge"]
    tiers = {"disk": adapters_on_disk}
    if lora is not None:
        tiers.update(gpu=lora.gpu_resident, cpu=lora.cpu_resident)
    for tier, value in sorted(tiers.items()):
        lines.append(f"{name}{_labels({'tier': tier})} {value}")
    if lora is None:
        return lines
    counters = (
        ("loraplex:lora_loads_total", "Adapter loads, by source tier.",
         {"gpu": lora.gpu_loads, "disk": lora.disk_loads}),
        ("loraplex:lora_evictions_total", "Adapter evictions, by tier.",
         {"gpu": lora.gpu_evictions, "cpu": lora.cpu_evictions}),
    )  # fmt: skip
    for name, help, values in counters:
        lines += [f"# HELP {name} {help}", f"# TYPE {name} counter"]
        for tier, value in sorted(values.items()):
            lines.append(f"{name}{_labels({'tier': tier})} {value}")
    return lines
