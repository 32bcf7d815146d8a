"""GET /health and GET /metrics (Prometheus text)."""

from __future__ import annotations

import httpx
from api_helpers import read_metrics

SERIES = [
    "loraplex:num_requests_running",
    "loraplex:num_requests_waiting",
    "loraplex:kv_cache_usage_perc",
    "loraplex:prefix_cache_queries_total",
    "loraplex:prefix_cache_hits_total",
    "loraplex:prefix_cache_hit_rate",
    "loraplex:prompt_tokens_total",
    "loraplex:generation_tokens_total",
    "loraplex:time_to_first_token_seconds_count",
    "loraplex:inter_token_latency_seconds_count",
    "loraplex:e2e_request_latency_seconds_count",
]


def test_health_is_ok(server):
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_metrics_count_a_request(server):
    before = read_metrics(server.base_url)
    body = {"model": server.model, "prompt": "Metrics test prompt", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{server.v1}/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        response.read()
    after = read_metrics(server.base_url)
    assert all(name in after for name in SERIES)
    assert (
        after["loraplex:generation_tokens_total"] - before["loraplex:generation_tokens_total"] == 4
    )
    assert after["loraplex:prompt_tokens_total"] > before["loraplex:prompt_tokens_total"]
    ttft = "loraplex:time_to_first_token_seconds_count"
    itl = "loraplex:inter_token_latency_seconds_count"
    assert after[ttft] == before.get(ttft, 0) + 1
    assert after[itl] == before.get(itl, 0) + 3


def test_metrics_text_is_prometheus_format(server):
    response = httpx.get(f"{server.base_url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert "# TYPE loraplex:time_to_first_token_seconds histogram" in lines
    assert any(line.startswith("loraplex:time_to_first_token_seconds_bucket{") and 'le="+Inf"'
               in line for line in lines)  # fmt: skip
    for line in lines:
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])
