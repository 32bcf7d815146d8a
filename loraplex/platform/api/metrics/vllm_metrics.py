"""vLLM's metric names for the series vLLM users chart, beside our own `loraplex:` series, so
vLLM's Grafana dashboards (and alerts written for vLLM) work when pointed at a loraplex server.

Every value here is one `ServerMetrics` already holds (the same timings and engine snapshot),
rendered again under vLLM's name with vLLM's `model_name` label: nothing is observed twice.
`vllm:time_per_output_token_seconds` (vLLM's older name of the inter-token latency, which its
example dashboard still charts) and `vllm:gpu_cache_usage_perc` (older name of the KV-cache
usage) are rendered too. Per-tenant and per-adapter series stay ours only (`loraplex:tenant_*`,
`loraplex:adapter_*`); `deploy/grafana/loraplex.json` charts those.
"""

from __future__ import annotations

from loraplex.platform.api.metrics.server_metrics import (
    _ENGINE_SERIES,
    Histogram,
    ServerMetrics,
    _labels,
    _number,
)
from loraplex.platform.core.stats import EngineSnapshot

# vLLM's gauge / counter -> ours, whose value it is.
_SAME_AS_OURS = {
    "vllm:num_requests_running": "loraplex:num_requests_running",
    "vllm:num_requests_waiting": "loraplex:num_requests_waiting",
    "vllm:kv_cache_usage_perc": "loraplex:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc": "loraplex:kv_cache_usage_perc",
    "vllm:prompt_tokens_total": "loraplex:prompt_tokens_total",
    "vllm:generation_tokens_total": "loraplex:generation_tokens_total",
    "vllm:num_preemptions_total": "loraplex:num_preemptions_total",
    "vllm:prefix_cache_queries_total": "loraplex:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "loraplex:prefix_cache_hits_total",
}
_SERIES = {name: (kind, help, value) for kind, name, help, value in _ENGINE_SERIES}


def _histograms(metrics: ServerMetrics) -> tuple[tuple[str, Histogram], ...]:
    """(vLLM's name, our histogram holding its observations)."""
    return (
        ("vllm:time_to_first_token_seconds", metrics.ttft),
        ("vllm:inter_token_latency_seconds", metrics.itl),
        ("vllm:time_per_output_token_seconds", metrics.itl),
        ("vllm:e2e_request_latency_seconds", metrics.e2e),
        ("vllm:request_queue_time_seconds", metrics.queue),
        ("vllm:request_prefill_time_seconds", metrics.prefill),
        ("vllm:request_decode_time_seconds", metrics.decode),
        ("vllm:request_inference_time_seconds", metrics.inference),
        ("vllm:request_prompt_tokens", metrics.prompt_tokens),
        ("vllm:request_generation_tokens", metrics.generation_tokens),
    )


def render_vllm_metrics(metrics: ServerMetrics, snapshot: EngineSnapshot) -> str:
    """vLLM's series, in Prometheus' text format, from `metrics` and the engine's snapshot."""
    labels = metrics.labels  # {"model_name": the served model}, vLLM's label
    lines: list[str] = []
    for name, ours in _SAME_AS_OURS.items():
        kind, help, value = _SERIES[ours]
        lines += [f"# HELP {name} {help} (vLLM's name of {ours})", f"# TYPE {name} {kind}"]
        lines.append(f"{name}{_labels(labels)} {_number(value(snapshot))}")
    lines += metrics.render_finished("vllm:request_success_total")
    for name, histogram in _histograms(metrics):
        lines += histogram.render(labels, name, f"{histogram.help} (vLLM's name)")
    return "\n".join(lines) + "\n"
