"""Per-adapter Prometheus series rendered from an `AdapterStatsReport`, and the 404 of a request
on an adapter removed while it was on its way to the engine."""

from __future__ import annotations

from loraplex.adapters.adapter_names import key_from_digest
from loraplex.platform.api.metrics.adapter_metrics import render_adapter_metrics
from loraplex.platform.core.commands import (
    LOAD_LATENCY_BUCKETS_S,
    AdapterStat,
    AdapterStatsReport,
)


def _stat(name: str, residency: str, latencies: dict[int, int]) -> AdapterStat:
    buckets = tuple(latencies.get(i, 0) for i in range(len(LOAD_LATENCY_BUCKETS_S)))
    return AdapterStat(
        name=name, key=key_from_digest("0" * 64), tenant=name.split("/")[0], label="x",
        residency=residency, loading=False, pinned=residency == "gpu", registered=True,
        failed="", last_used=1700000000.5, gpu_loads=3, disk_loads=1, evictions=2,
        load_latency_buckets=buckets, load_latency_sum_s=0.75,
        load_latency_count=sum(buckets), running_requests=4, waiting_requests=1,
    )  # fmt: skip


def test_every_adapter_gets_its_series_and_a_cumulative_histogram():
    report = AdapterStatsReport(
        adapters=(_stat("acme/sql@abc", "gpu", {3: 2, 13: 1}), _stat("zeta/chat@def", "disk", {})),
        gpu_slots_used=1, gpu_slots_total=64, gpu_slots_in_use=1, cpu_cache_used=2,
        cpu_cache_total=128, loads_in_flight=0,
    )  # fmt: skip
    text = render_adapter_metrics(report)
    lines = set(text.splitlines())
    assert "loraplex:lora_gpu_slots_total 64" in lines
    assert "loraplex:lora_gpu_slots_used 1" in lines
    acme = 'tenant="acme",adapter="sql@abc"'
    assert f'loraplex:adapter_residency{{{acme},tier="gpu"}} 1' in lines
    assert f'loraplex:adapter_residency{{{acme},tier="disk"}} 0' in lines
    assert 'loraplex:adapter_residency{tenant="zeta",adapter="chat@def",tier="disk"} 1' in lines
    assert f'loraplex:adapter_loads_total{{{acme},tier="disk"}} 1' in lines
    assert f"loraplex:adapter_evictions_total{{{acme}}} 2" in lines
    assert f"loraplex:adapter_running_requests{{{acme}}} 4" in lines
    # cumulative buckets: 2 loads under 10 ms, the third under 10 s, all under +Inf
    assert f'loraplex:adapter_load_latency_seconds_bucket{{{acme},le="0.005"}} 0' in lines
    assert f'loraplex:adapter_load_latency_seconds_bucket{{{acme},le="0.01"}} 2' in lines
    assert f'loraplex:adapter_load_latency_seconds_bucket{{{acme},le="5"}} 2' in lines
    assert f'loraplex:adapter_load_latency_seconds_bucket{{{acme},le="+Inf"}} 3' in lines
    assert f"loraplex:adapter_load_latency_seconds_count{{{acme}}} 3" in lines
    assert text.count("# TYPE loraplex:adapter_load_latency_seconds histogram") == 1


def test_no_series_without_lora():
    assert render_adapter_metrics(None) == ""


def test_a_request_on_a_removed_adapter_is_a_404_naming_the_model():
    from loraplex.adapters.errors import AdapterNotFoundError
    from loraplex.platform.api.errors import from_engine_error

    error = from_engine_error(AdapterNotFoundError("The adapter `acme/sql@abc` was removed."))
    body = error.body()["error"]
    assert error.status == 404 and body["code"] == "model_not_found" and body["param"] == "model"
    assert "was removed" in body["message"]
