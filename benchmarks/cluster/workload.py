"""The simulated workload: `SimConfig`, `Request`, and Zipf-popular adapters of bursty tenants
(see `benchmarks.cluster_sim`)."""

from __future__ import annotations

import random
from dataclasses import dataclass

POLICIES = ("round_robin", "least_load", "gie", "affinity_hrw")


@dataclass(frozen=True)
class SimConfig:
    replicas: int
    adapters: int
    policy: str
    tenants: int = 200
    zipf_s: float = 1.0
    base_share: float = 0.1  # requests on the base model
    on_s: float = 5.0  # mean burst length of a tenant
    off_s: float = 20.0  # mean pause between bursts
    load: float = 0.7  # offered load over the replicas' capacity
    duration_s: float = 30.0
    warmup_s: float = 5.0
    max_num_seqs: int = 256
    max_loras: int = 32
    kv_tokens: int = 256 * 768
    scrape_s: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.replicas < 1 or self.adapters < 1 or self.tenants < 1:
            raise ValueError("replicas, adapters and tenants must be >= 1")


class Request:
    __slots__ = ("arrival", "adapter", "prompt", "output", "first_token", "admit_step")

    def __init__(self, arrival: float, adapter: int, prompt: int, output: int) -> None:
        self.arrival, self.adapter, self.prompt, self.output = arrival, adapter, prompt, output
        self.first_token = -1.0
        self.admit_step = 0


def make_workload(cfg: SimConfig, rate: float) -> list[Request]:
    """Arrivals over `duration_s` at `rate` req/s on average; adapter -1 = the base model."""
    rng = random.Random(cfg.seed)
    weights = [1.0 / (r + 1) ** cfg.zipf_s for r in range(cfg.adapters)]
    owners = [rng.randrange(cfg.tenants) for _ in range(cfg.adapters)]
    by_tenant: dict[int, list[int]] = {}
    for adapter, owner in enumerate(owners):
        by_tenant.setdefault(owner, []).append(adapter)
    total = sum(weights)
    duty = cfg.on_s / (cfg.on_s + cfg.off_s)
    requests = []
    for _, adapters in sorted(by_tenant.items()):
        share = sum(weights[a] for a in adapters) / total
        on_rate = rate * (1 - cfg.base_share) * share / duty
        cum = [0.0]
        for a in adapters:
            cum.append(cum[-1] + weights[a])
        t = rng.expovariate(1 / cfg.off_s) * rng.random()
        while t < cfg.duration_s:
            end = t + rng.expovariate(1 / cfg.on_s)
            t += rng.expovariate(on_rate)
            while t < min(end, cfg.duration_s):
                pick = rng.random() * cum[-1]
                adapter = adapters[_bisect(cum, pick)]
                requests.append(Request(t, adapter, rng.randint(128, 512), rng.randint(64, 256)))
                t += rng.expovariate(on_rate)
            t = end + rng.expovariate(1 / cfg.off_s)
    t = 0.0
    while True:  # the base model's traffic: steady
        t += rng.expovariate(rate * cfg.base_share)
        if t >= cfg.duration_s:
            break
        requests.append(Request(t, -1, rng.randint(128, 512), rng.randint(64, 256)))
    requests.sort(key=lambda r: r.arrival)
    return requests


def _bisect(cum: list[float], x: float) -> int:
    lo, hi = 0, len(cum) - 2
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid + 1] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
