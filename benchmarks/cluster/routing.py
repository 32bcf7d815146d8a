"""`Router`: the routing policies compared by `benchmarks.cluster_sim`, on scraped gauges."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from benchmarks.cluster.replica import Replica
from benchmarks.cluster.workload import Request, SimConfig

GIE_WEIGHTS = {"queue": 2.0, "kv": 2.0, "lora": 2.0}  # deploy/kubernetes/epp.yaml


@dataclass(frozen=True)
class Gauges:
    """What a replica's /metrics says at a scrape."""

    waiting: int
    running: int
    kv: float
    running_adapters: frozenset[int]
    waiting_adapters: frozenset[int]


class Router:
    def __init__(self, cfg: SimConfig, replicas: list[Replica], rng: random.Random) -> None:
        self.cfg, self.replicas, self.rng = cfg, replicas, rng
        self.next = 0
        self.gauges: list[Gauges] = []
        self.sent: list[int] = []  # since the last scrape, per replica (affinity_hrw only)
        self.scrape()

    def scrape(self) -> None:
        self.gauges = [
            Gauges(len(r.waiting), r.num_running, r.kv_usage(), frozenset(r.adapters),
                   frozenset(r.waiting_adapters()))
            for r in self.replicas
        ]  # fmt: skip
        self.sent = [0] * len(self.replicas)

    def route(self, request: Request) -> int:
        policy = self.cfg.policy
        n = len(self.replicas)
        if policy == "round_robin":
            self.next = (self.next + 1) % n
            return self.next
        if policy == "least_load":
            loads = [g.waiting + g.running for g in self.gauges]
            return self._argmin(loads, range(n))
        if policy == "gie":
            return self._gie(request)
        return self._hrw(request)

    def _argmin(self, values: list[float], among) -> int:
        best = min(values[i] for i in among)
        return self.rng.choice([i for i in among if values[i] == best])

    def _gie(self, request: Request) -> int:
        queues = [g.waiting for g in self.gauges]
        lo, hi = min(queues), max(queues)
        scores = []
        for g in self.gauges:
            queue = 1.0 if hi == lo else (hi - g.waiting) / (hi - lo)
            if request.adapter < 0 or request.adapter in g.running_adapters:
                lora = 1.0
            elif len(g.running_adapters) + len(g.waiting_adapters) < self.cfg.max_loras:
                lora = 0.8
            elif request.adapter in g.waiting_adapters:
                lora = 0.6
            else:
                lora = 0.0
            w = GIE_WEIGHTS
            scores.append(w["queue"] * queue + w["kv"] * (1 - g.kv) + w["lora"] * lora)
        best = max(scores)
        return self.rng.choice([i for i, s in enumerate(scores) if s == best])

    def _hrw(self, request: Request) -> int:
        n = len(self.replicas)
        loads = [g.waiting + g.running + s for g, s in zip(self.gauges, self.sent)]
        if request.adapter < 0:
            chosen = self._argmin(loads, range(n))
        else:
            homes = sorted(range(n), key=lambda i: _hrw_key(request.adapter, i))[: min(2, n)]
            chosen = min(homes, key=lambda i: loads[i])
            bound = 1.25 * sum(loads) / n + self.cfg.max_num_seqs / 16
            if loads[chosen] > bound:
                chosen = self._argmin(loads, range(n))
        self.sent[chosen] += 1
        return chosen


def _hrw_key(adapter: int, replica: int) -> bytes:
    return hashlib.blake2b(f"{adapter}:{replica}".encode(), digest_size=8).digest()
