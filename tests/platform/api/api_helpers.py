"""Helpers of the API tests: reading /metrics and waiting for the engine to go idle."""

from __future__ import annotations

import time

import httpx


def read_metrics(base_url: str) -> dict[str, float]:
    """Unlabelled view of /metrics: series name (labels dropped) -> value."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        if "finished_reason=" in series:
            name += "|" + series.split('finished_reason="', 1)[1].split('"', 1)[0]
        if name.endswith("_bucket"):
            continue
        values[name] = float(value)
    return values


def wait_until_idle(base_url: str, timeout_s: float = 60) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(base_url)
        idle = (
            m["loraplex:num_requests_running"] == 0
            and m["loraplex:num_requests_waiting"] == 0
            and m["loraplex:num_kv_blocks_free"] == m["loraplex:num_kv_blocks_total"]
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
