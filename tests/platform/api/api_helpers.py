"""Helpers of the API tests: reading /metrics and waiting for the engine to go idle."""

from __future__ import annotations

import httpx

from tests.waiting import wait_until


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
    """The /metrics values once nothing runs or waits and every KV block is free again."""

    def idle_metrics() -> dict[str, float] | None:
        m = read_metrics(base_url)
        idle = (
            m["loraplex:num_requests_running"] == 0
            and m["loraplex:num_requests_waiting"] == 0
            and m["loraplex:num_kv_blocks_free"] == m["loraplex:num_kv_blocks_total"]
        )
        return m if idle else None

    return wait_until(idle_metrics, timeout_s, "the server to go idle")
