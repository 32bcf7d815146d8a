"""vLLM's metric names beside ours: every series vLLM's example Grafana dashboard
(examples/online_serving/prometheus_grafana/grafana.json) and its scheduler / KV gauges query is
in /metrics, with vLLM's `model_name` label, holding the same values as our `loraplex:` series;
the whole page parses as Prometheus parses it."""

from __future__ import annotations

import httpx
from api_helpers import wait_until_idle
from prometheus_client.parser import text_string_to_metric_families

# What vLLM's dashboard and its users' alerts query (histograms by their family name).
VLLM_HISTOGRAMS = (
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
)  # fmt: skip
VLLM_SERIES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)  # fmt: skip


def _samples(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, labels) -> value."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_vllms_series_count_a_request_as_ours_do(server):
    model = {"model_name": server.model}
    wait_until_idle(server.base_url)
    before = _samples(server.base_url)
    body = {"model": server.model, "prompt": "vLLM metrics test", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    assert httpx.post(f"{server.v1}/completions", json=body, timeout=120).status_code == 200
    wait_until_idle(server.base_url)
    after = _samples(server.base_url)

    for name in VLLM_SERIES:
        assert (name, tuple(model.items())) in after, name
    for name in VLLM_HISTOGRAMS:
        count = _value(after, f"{name}_count", **model) - _value(before, f"{name}_count", **model)
        gaps = name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
        assert count == (3 if gaps else 1), name  # 4 tokens: 3 gaps between them
        assert _value(after, f"{name}_bucket", **model, le="+Inf") == _value(
            after, f"{name}_count", **model
        )
    generated = "vllm:request_generation_tokens_sum"
    assert _value(after, generated, **model) - _value(before, generated, **model) == 4
    length = ("vllm:request_success_total", {**model, "finished_reason": "length"})
    assert _value(after, length[0], **length[1]) - _value(before, length[0], **length[1]) == 1
    for ours in ("prompt_tokens_total", "generation_tokens_total", "kv_cache_usage_perc"):
        assert _value(after, f"vllm:{ours}", **model) == _value(after, f"loraplex:{ours}", **model)
    ttft = "time_to_first_token_seconds_sum"
    assert _value(after, f"vllm:{ttft}", **model) == _value(after, f"loraplex:{ttft}", **model)


def test_every_vllm_series_carries_the_model_name(server):
    """vLLM's dashboard picks its model from label_values({__name__=~"vllm:.*"}, model_name)."""
    samples = _samples(server.base_url)
    names = {name for name, _ in samples if name.startswith("vllm:")}
    assert names and all(
        dict(labels).get("model_name") == server.model
        for name, labels in samples
        if name.startswith("vllm:")
    )
