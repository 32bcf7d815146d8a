"""What a server reports about itself, in Prometheus' text format under vLLM's names:
`server_metrics` (`ServerMetrics`: the engine's gauges and counters, latency histograms),
`vllm_metrics` (the same values under vLLM's `vllm:` names, for vLLM's dashboards),
`tenant_metrics` (per-tenant requests, tokens and adapter residency), `adapter_metrics`
(per-adapter series from the engine's report), `gie_metrics` (the Gateway API Inference
Extension's LoRA gauge), and the routes `serving_health` (/health, /metrics,
/adapters/resident)."""
