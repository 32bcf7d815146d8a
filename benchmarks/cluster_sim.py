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
import heapq
import json
import math
import random
from dataclasses import asdict

from benchmarks.cluster.costs import CostModel
from benchmarks.cluster.replica import Replica
from benchmarks.cluster.routing import Router
from benchmarks.cluster.workload import POLICIES, Request, SimConfig, make_workload
from benchmarks.common.stats import quantile
from benchmarks.record import write_result


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
    ttft = [(r.first_token if r.first_token >= 0 else horizon) - r.arrival for r in window]
    finished = [r for r in done if cfg.warmup_s <= r.arrival < cfg.duration_s]
    tokens = sum(r.window_tokens for r in replicas)
    loads = sum(r.loads for r in replicas)
    return {
        "offered_req_s": rate,
        "throughput_out_tok_s": tokens / (cfg.duration_s - cfg.warmup_s),
        "ttft_p50_s": quantile(ttft, 0.5),
        "ttft_p99_s": quantile(ttft, 0.99),
        "adapter_loads_per_s": loads / cfg.duration_s,
        "unfinished": len(window) - len(finished),
        "requests": len(window),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", default="4,16,64")
    parser.add_argument("--adapters", default="1000,10000")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--duration-s", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="cluster_sim.json", help="in benchmarks/results/")
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
    metrics = {f"{r['policy']}_n{r['replicas']}_m{r['adapters']}_{key}": r[key]
               for r in runs for key in ("throughput_out_tok_s", "ttft_p50_s", "ttft_p99_s",
                                         "adapter_loads_per_s")}  # fmt: skip
    write_result(
        args.out,
        "cluster_sim",
        metrics,
        {"policy": "round_robin", "note": "every policy on the same arrivals"},
        device="simulated NVIDIA H200 replicas (costs from benchmarks/results/h200_*.json)",
        costs={k: v for k, v in asdict(costs).items() if k != "sources"},
        cost_sources=costs.sources,
        workload={
            k: v
            for k, v in asdict(SimConfig(1, 1, "gie")).items()
            if k not in ("replicas", "adapters", "policy")
        },
        sampling="costs come from runs at temperature 1.0 (multi-LoRA t1 base and ratios) "
        "and greedy (sampling record), whose ratio on the H200 is 1.03x: the simulated "
        "replicas stand for sampled and mixed traffic alike",
        runs=runs,
    )


if __name__ == "__main__":
    raise SystemExit(main())
