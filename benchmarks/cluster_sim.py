"""Cluster simulator: N loraplex replicas behind a router, many tenants' adapters, H200 costs.

A discrete-event replay (seeded, CPU only) of a multi-tenant LoRA workload over N replicas, to
compare routing policies where no cluster is at hand:

- workload: Zipf(s) popularity over M adapters owned by T tenants; each tenant is bursty
  (on/off periods, exponential; all its traffic falls in its on periods); a share of requests
  on the base model; prompt and output lengths uniform as in `benchmarks.multi_lora`;
- replica: continuous batching as the engine does it (one token per running request per step,
  a new request prefills in its first step), at most `max_num_seqs` running, `max_loras` GPU
  slots (LRU; a slot with running requests is pinned), one adapter load at a time, requests
  whose adapter is not in a slot wait while later ones run;
- costs, from the H200 records in benchmarks/results (see `CostModel.from_records`): the
  decode step and prefill per token fitted to two throughput records, the slowdown with the
  number of distinct adapters in a batch fitted to the multi-LoRA record, the adapter load from
  the adapter-upload record;
- routers see what they would see: replica gauges scraped every `scrape_s` (the EPP's 50 ms).

Policies: round-robin; least-load (fewest waiting + running, as scraped); GIE (the v1.4.0 EPP
scorers our deploy/kubernetes/epp.yaml configures: queue 2, KV-cache 2, lora-affinity 2, max
score, on vLLM-semantics `lora_requests_info`); affinity-hrw (ours: each adapter's home replicas
by rendezvous hashing, the least loaded of them unless it is over the mean load by a bound,
then the least loaded of all; load = scraped plus the router's own sends since the scrape).

`python -m benchmarks.cluster_sim` writes benchmarks/results/cluster_sim.json.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import json
import math
import random
from collections import Counter, OrderedDict, deque
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
POLICIES = ("round_robin", "least_load", "gie", "affinity_hrw")
GIE_WEIGHTS = {"queue": 2.0, "kv": 2.0, "lora": 2.0}  # deploy/kubernetes/epp.yaml


@dataclass(frozen=True)
class CostModel:
    """One replica's costs (seconds): step = (t1 + k (B-1) + p * prefill tokens) * f(A), with
    f(A) = 1 + b log2(A) for A >= 1 distinct adapters in the batch; `load_s` per adapter load."""

    t1: float  # decode step of one sequence
    k: float  # each further running sequence
    p: float  # each prompt token prefilled in the step
    b: float  # slowdown per doubling of distinct adapters
    load_s: float  # disk/host -> GPU slot, one adapter
    sources: dict[str, str]

    def step(self, batch: int, adapters: int, prefill_tokens: int) -> float:
        base = self.t1 + self.k * max(batch - 1, 0) + self.p * prefill_tokens
        return base * (1.0 + self.b * math.log2(adapters)) if adapters else base

    @classmethod
    def from_records(cls, results: Path = RESULTS) -> CostModel:
        """Fit the costs to the recorded H200 runs (Llama-3.1-8B shapes, bf16)."""
        multi = json.loads((results / "h200_multi_lora.json").read_text())
        sampling = json.loads((results / "h200_sampling.json").read_text())
        upload = json.loads((results / "h200_adapter_upload.json").read_text())
        t1 = multi["baseline"]["tpot_bs1_base_s"]
        # Each run: P prompt tokens, S steps (the longest output), D output tokens, in D / tok_s
        # seconds: P p + S t1 + (D - S) k = T. Two runs, two unknowns (p, k).
        n = 256
        runs = [  # (P, S, D, tok/s)
            (n * 128, 256, n * 256, sampling["metrics"]["greedy_out_tok_s"]),
            (n * 320, 256, n * 160, multi["baseline"]["base_out_tok_s_t1"]),
        ]
        (p1, s1, d1, r1), (p2, s2, d2, r2) = runs
        rhs1, rhs2 = d1 / r1 - s1 * t1, d2 / r2 - s2 * t1
        det = p1 * (d2 - s2) - p2 * (d1 - s1)
        p = (rhs1 * (d2 - s2) - rhs2 * (d1 - s1)) / det
        k = (p1 * rhs2 - p2 * rhs1) / det
        points = [(8, 1 / multi["metrics"]["ratio_vs_base_8_t1"]),
                  (64, 1 / multi["metrics"]["ratio_vs_base_64_t1"])]  # fmt: skip
        b = sum(math.log2(a) * (f - 1) for a, f in points) / sum(
            math.log2(a) ** 2 for a, _ in points
        )
        load_s = (upload["metrics"]["first_token_after_upload_s_median"]
                  - upload["baseline"]["base_model_first_token_s_median"])  # fmt: skip
        sources = {
            "t1": "h200_multi_lora.json baseline.tpot_bs1_base_s",
            "p, k": "fitted to h200_sampling.json metrics.greedy_out_tok_s (256 x 128 in, 256 "
            "out) and h200_multi_lora.json baseline.base_out_tok_s_t1 (256 x U[128,512] in, "
            "U[64,256] out)",
            "b": "least squares on h200_multi_lora.json metrics.ratio_vs_base_8_t1 and "
            "ratio_vs_base_64_t1 (8 and 64 distinct adapters)",
            "load_s": "h200_adapter_upload.json first_token_after_upload_s_median - "
            "base_model_first_token_s_median (rank 16, all 7 projections, 168 MB)",
        }
        return cls(t1, k, p, b, load_s, sources)


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


class Replica:
    """One engine: continuous batching over GPU adapter slots, stepped by the event loop."""

    def __init__(self, index: int, cfg: SimConfig, costs: CostModel) -> None:
        self.index, self.cfg, self.costs = index, cfg, costs
        self.waiting: deque[Request] = deque()
        self.finishing: list[tuple[int, int, Request]] = []  # (finish step, tie, request)
        self.num_running = 0
        self.adapters = Counter()  # running requests per adapter
        self.queued = Counter()  # waiting requests per adapter
        self.slots: OrderedDict[int, None] = OrderedDict()  # resident adapters, LRU first
        self.loading: int | None = None
        self.load_queue: deque[int] = deque()
        self.steps = 0
        self.busy = False
        self.loads = 0
        self.kv_prompt = 0
        self.kv_admit_steps = 0
        self.window_tokens = 0  # tokens generated in steps ending in [warmup_s, duration_s)

    def kv_usage(self) -> float:
        generated = self.num_running * self.steps - self.kv_admit_steps
        return min(1.0, (self.kv_prompt + generated) / self.cfg.kv_tokens)

    def waiting_adapters(self) -> set[int]:
        return {a for a, n in self.queued.items() if n and a >= 0} - set(self.adapters)

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)
        self.queued[request.adapter] += 1

    def start_step(self, now: float) -> float | None:
        """Admit what can run, start loads; the step's end time, or None if idle."""
        admitted, prefill, kept = [], 0, []
        while self.waiting and self.num_running + len(admitted) < self.cfg.max_num_seqs:
            request = self.waiting.popleft()
            if request.adapter < 0 or request.adapter in self.slots:
                admitted.append(request)
                self.queued[request.adapter] -= 1
                prefill += request.prompt
                if request.adapter >= 0:
                    self.slots.move_to_end(request.adapter)
                    self.adapters[request.adapter] += 1
            else:
                if request.adapter != self.loading and request.adapter not in self.load_queue:
                    self.load_queue.append(request.adapter)
                kept.append(request)
                if len(kept) >= 256:  # look no further this step
                    break
        self.waiting.extendleft(reversed(kept))  # back in arrival order, O(len(kept))
        for request in admitted:
            request.admit_step = self.steps
            self.num_running += 1
            self.kv_prompt += request.prompt
            self.kv_admit_steps += self.steps
            heapq.heappush(self.finishing, (self.steps + request.output, id(request), request))
        if not self.num_running:
            self.busy = False
            return None
        self.busy = True
        self._new = admitted
        distinct = sum(1 for c in self.adapters.values() if c)
        return now + self.costs.step(self.num_running, distinct, prefill)

    def end_step(self, now: float, done: list[Request]) -> None:
        self.steps += 1
        if self.cfg.warmup_s <= now < self.cfg.duration_s:
            self.window_tokens += self.num_running
        for request in self._new:
            request.first_token = now
        while self.finishing and self.finishing[0][0] <= self.steps:
            _, _, request = heapq.heappop(self.finishing)
            self.num_running -= 1
            self.kv_prompt -= request.prompt
            self.kv_admit_steps -= request.admit_step
            if request.adapter >= 0:
                self.adapters[request.adapter] -= 1
                if not self.adapters[request.adapter]:
                    del self.adapters[request.adapter]
            done.append(request)

    def next_load(self) -> int | None:
        """The adapter to load next, its slot made free (an LRU slot nothing runs on)."""
        if self.loading is not None or not self.load_queue:
            return None
        if len(self.slots) >= self.cfg.max_loras:
            victim = next((a for a in self.slots if a not in self.adapters), None)
            if victim is None:
                return None
            del self.slots[victim]
        self.loading = self.load_queue.popleft()
        self.loads += 1
        return self.loading


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


def capacity_req_s(cfg: SimConfig, costs: CostModel) -> float:
    """Requests per second one replica sustains full (mean lengths, half its slots' adapters)."""
    mean_prompt, mean_out = 320, 160
    per_request = (mean_out * costs.step(cfg.max_num_seqs, 0, 0) / cfg.max_num_seqs
                   + mean_prompt * costs.p)  # fmt: skip
    return 1.0 / (per_request * (1 + costs.b * math.log2(cfg.max_loras / 2)))


def simulate(cfg: SimConfig, costs: CostModel) -> dict[str, float]:
    rate = cfg.load * capacity_req_s(cfg, costs) * cfg.replicas
    requests = make_workload(cfg, rate)
    replicas = [Replica(i, cfg, costs) for i in range(cfg.replicas)]
    router = Router(cfg, replicas, random.Random(cfg.seed + 1))
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind, replica/request)
    ARRIVE, STEP, LOADED, SCRAPE = 0, 1, 2, 3
    order = 0
    for i, request in enumerate(requests):
        events.append((request.arrival, order, ARRIVE, i))
        order += 1
    heapq.heapify(events)
    heapq.heappush(events, (cfg.scrape_s, order, SCRAPE, 0))
    horizon = cfg.duration_s * 2  # arrivals stop at duration_s; the rest drains
    done: list[Request] = []

    def kick(replica: Replica, now: float) -> None:
        nonlocal order
        if not replica.busy:
            end = replica.start_step(now)
            if end is not None:
                order += 1
                heapq.heappush(events, (end, order, STEP, replica.index))
        adapter = replica.next_load()
        if adapter is not None:
            order += 1
            heapq.heappush(events, (now + costs.load_s, order, LOADED, replica.index))

    while events:
        now, _, kind, who = heapq.heappop(events)
        if now > horizon:
            break
        if kind == ARRIVE:
            replica = replicas[router.route(requests[who])]
            replica.enqueue(requests[who])
            kick(replica, now)
        elif kind == STEP:
            replica = replicas[who]
            replica.end_step(now, done)
            replica.busy = False
            kick(replica, now)
        elif kind == LOADED:
            replica = replicas[who]
            replica.slots[replica.loading] = None
            replica.loading = None
            kick(replica, now)
        else:
            router.scrape()
            if now < horizon:
                order += 1
                heapq.heappush(events, (now + cfg.scrape_s, order, SCRAPE, 0))
    window = [r for r in requests if cfg.warmup_s <= r.arrival < cfg.duration_s]
    ttft = sorted((r.first_token if r.first_token >= 0 else horizon) - r.arrival for r in window)
    finished = [r for r in done if cfg.warmup_s <= r.arrival < cfg.duration_s]
    tokens = sum(r.window_tokens for r in replicas)
    loads = sum(r.loads for r in replicas)
    return {
        "offered_req_s": rate,
        "throughput_out_tok_s": tokens / (cfg.duration_s - cfg.warmup_s),
        "ttft_p50_s": _quantile(ttft, 0.5),
        "ttft_p99_s": _quantile(ttft, 0.99),
        "adapter_loads_per_s": loads / cfg.duration_s,
        "unfinished": len(window) - len(finished),
        "requests": len(window),
    }


def _quantile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="4,16,64")
    parser.add_argument("--adapters", default="1000,10000")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "cluster_sim.json"))
    args = parser.parse_args(argv)
    costs = CostModel.from_records()
    runs = []
    for adapters in (int(a) for a in args.adapters.split(",")):
        for replicas in (int(n) for n in args.replicas.split(",")):
            for policy in args.policies.split(","):
                cfg = SimConfig(replicas, adapters, policy, load=args.load,
                                duration_s=args.duration_s, seed=args.seed)  # fmt: skip
                result = simulate(cfg, costs)
                runs.append({"replicas": replicas, "adapters": adapters, "policy": policy,
                             **{k: round(v, 4) for k, v in result.items()}})  # fmt: skip
                print(json.dumps(runs[-1]), flush=True)
    _write(args, costs, runs)
    return 0


def _write(args: argparse.Namespace, costs: CostModel, runs: list[dict]) -> None:
    import datetime
    import shlex
    import subprocess
    import sys

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True, cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    metrics = {f"{r['policy']}_n{r['replicas']}_m{r['adapters']}_{key}": r[key]
               for r in runs for key in ("throughput_out_tok_s", "ttft_p50_s", "ttft_p99_s",
                                         "adapter_loads_per_s")}  # fmt: skip
    record = {
        "benchmark": "cluster_sim",
        "device": "simulated NVIDIA H200 replicas (costs from benchmarks/results/h200_*.json)",
        "command": " ".join(
            shlex.quote(a) for a in ["python", "-m", "benchmarks.cluster_sim", *sys.argv[1:]]
        ),  # fmt: skip
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "baseline": {"policy": "round_robin", "note": "every policy on the same arrivals"},
        "costs": {k: v for k, v in asdict(costs).items() if k != "sources"},
        "cost_sources": costs.sources,
        "workload": {
            k: v
            for k, v in asdict(SimConfig(1, 1, "gie")).items()
            if k not in ("replicas", "adapters", "policy")
        },  # fmt: skip
        "sampling": "costs come from runs at temperature 1.0 (multi-LoRA t1 base and ratios) "
        "and greedy (sampling record), whose ratio on the H200 is 1.03x: the simulated "
        "replicas stand for sampled and mixed traffic alike",
        "runs": runs,
    }
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    raise SystemExit(main())
