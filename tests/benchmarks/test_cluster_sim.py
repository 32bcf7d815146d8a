"""The cluster simulator: costs fitted to the H200 records reproduce them, runs are
deterministic, and routing shows the effects it exists to measure."""

from __future__ import annotations

import pytest

from benchmarks.cluster.costs import CostModel
from benchmarks.cluster.workload import SimConfig, make_workload
from benchmarks.cluster_sim import simulate


@pytest.fixture(scope="module")
def costs() -> CostModel:
    return CostModel.from_records()


def test_fitted_costs_reproduce_the_records_they_come_from(costs):
    # 256 requests of 128 prompt tokens and 256 output tokens, all at once (h200_sampling)
    steps = sum(costs.step(256, 0, 0) for _ in range(255)) + costs.step(256, 0, 256 * 128)
    assert 256 * 256 / steps == pytest.approx(18278, rel=0.02)
    assert 0 < costs.k < costs.t1 and 0 < costs.p < costs.t1 and 0 < costs.load_s < 1
    # the multi-LoRA record: 64 distinct adapters run at ~0.69x the base model's speed
    assert costs.step(256, 0, 0) / costs.step(256, 64, 0) == pytest.approx(0.688, rel=0.05)
    with pytest.raises(ValueError):
        SimConfig(4, 100, "random")


def test_same_seed_same_results_and_the_workload_is_zipf_and_bursty():
    cfg = SimConfig(4, 1000, "gie", duration_s=6.0, warmup_s=1.0)
    first = make_workload(cfg, rate=200.0)
    again = make_workload(cfg, rate=200.0)
    assert [(r.arrival, r.adapter) for r in first] == [(r.arrival, r.adapter) for r in again]
    counts: dict[int, int] = {}
    for r in first:
        counts[r.adapter] = counts.get(r.adapter, 0) + 1
    assert 150 <= len(first) / cfg.duration_s <= 250
    assert counts.get(-1, 0) > 0  # base-model requests
    top = sorted((c for a, c in counts.items() if a >= 0), reverse=True)
    assert top[0] > 10 * top[len(top) // 2]  # a hot head and a long tail


def test_affinity_routing_loads_fewer_adapters_than_round_robin(costs):
    results = {}
    for policy in ("round_robin", "affinity_hrw"):
        cfg = SimConfig(8, 300, policy, duration_s=4.0, warmup_s=1.0, max_loras=16)
        results[policy] = simulate(cfg, costs)
        assert results[policy] == simulate(cfg, costs)  # deterministic
    rr, ours = results["round_robin"], results["affinity_hrw"]
    assert ours["adapter_loads_per_s"] < 0.5 * rr["adapter_loads_per_s"]
    assert ours["ttft_p50_s"] < rr["ttft_p50_s"]
    assert rr["unfinished"] == ours["unfinished"] == 0
