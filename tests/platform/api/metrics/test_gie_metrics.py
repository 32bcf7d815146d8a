"""The Gateway API Inference Extension's model-server protocol on /metrics: the load gauges and
`loraplex:lora_requests_info` (label layout, value = time of the last change), as requests run
on adapters and wait for them; and GET /adapters/resident for a router's resync."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tenant_helpers import start_server, upload

from loraplex.adapters.adapter_names import key_from_digest
from loraplex.config import LoRAConfig
from loraplex.platform.api.metrics.gie_metrics import LORA_INFO, LoRAInfoGauge
from loraplex.platform.core.commands import LOAD_LATENCY_BUCKETS_S, AdapterStat, AdapterStatsReport
from tests.waiting import wait_until

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

_SERIES = re.compile(r"^(?P<name>[^{\s]+)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _series(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of `name` in Prometheus text: (labels, value)."""
    found = []
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match and match["name"] == name:
            found.append((dict(_LABEL.findall(match["labels"] or "")), float(match["value"])))
    return found


def _stat(label: str, residency: str, running: int = 0, waiting: int = 0) -> AdapterStat:
    return AdapterStat(
        name=f"acme/{label}@abc", key=key_from_digest("0" * 64), tenant="acme", label=label,
        residency=residency, loading=False, pinned=False, registered=True, failed="",
        last_used=0.0, gpu_loads=0, disk_loads=0, evictions=0,
        load_latency_buckets=(0,) * len(LOAD_LATENCY_BUCKETS_S), load_latency_sum_s=0.0,
        load_latency_count=0, running_requests=running, waiting_requests=waiting,
    )  # fmt: skip


def _report(*stats: AdapterStat, slots: int = 4) -> AdapterStatsReport:
    return AdapterStatsReport(stats, sum(s.residency == "gpu" for s in stats), slots, 0, 0, 8, 0)


def test_label_layout_and_the_value_moves_only_when_the_labels_change():
    clock = iter([100.0, 100.0, 250.0]).__next__
    gauge = LoRAInfoGauge(clock=clock)
    first = _report(_stat("sql", "gpu", running=3), _stat("chat", "disk", waiting=2),
                    _stat("idle", "gpu"), _stat("cold", "cpu"))  # fmt: skip
    [(labels, since)] = _series(gauge.render(first), LORA_INFO)
    assert labels == {"max_lora": "4", "running_lora_adapters": "sql",
                      "waiting_lora_adapters": "chat"}  # fmt: skip
    assert since == 100.0
    # the same set again: the same timestamp (the EPP keeps the newest series)
    assert _series(gauge.render(first), LORA_INFO)[0][1] == 100.0
    # a change at a clock that stood still still gets a later value
    second = _report(_stat("sql", "gpu", running=1), _stat("chat", "gpu", running=1, waiting=1))
    [(labels, since)] = _series(gauge.render(second), LORA_INFO)
    assert labels["running_lora_adapters"] == "chat,sql"
    assert labels["waiting_lora_adapters"] == ""  # chat runs: not also listed as waiting
    assert since > 100.0
    assert gauge.render(None) == ""


@pytest.fixture(scope="module")
def replica(model_dir, tmp_path_factory):
    """An open server with one running sequence and one GPU adapter slot, so a request on a
    second adapter must wait, and two adapters of the embedded model uploaded to it."""
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    folders = tmp_path_factory.mktemp("gie_adapters")
    server = start_server(
        model_dir, tmp_path_factory.mktemp("gie_data"), max_num_seqs=1, admin_key=None,
        lora=LoRAConfig(max_loras=1, max_cpu_loras=4),
    )  # fmt: skip
    client = server.client(None)
    for seed, name in enumerate(("sql", "chat")):
        response = upload(client, name, write_adapter(folders / name, hf_config, seed=seed))
        assert response.status_code == 201, response.text
    yield server
    server.stop()


def _lora_info(base_url: str) -> tuple[dict[str, str], float]:
    [sample] = _series(httpx.get(f"{base_url}/metrics", timeout=10).text, LORA_INFO)
    return sample


def test_gauges_follow_residency_and_waiting_requests(replica):
    text = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
    for gauge in ("loraplex:num_requests_waiting", "loraplex:num_requests_running",
                  "loraplex:kv_cache_usage_perc"):  # fmt: skip
        assert f"# TYPE {gauge} gauge" in text
    labels, before = _lora_info(replica.base_url)
    assert labels == {"max_lora": "1", "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}  # fmt: skip

    def complete(model: str) -> None:
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = httpx.post(f"{replica.base_url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text

    first = threading.Thread(target=complete, args=("sql",))
    first.start()
    wait_until(
        lambda: _lora_info(replica.base_url)[0]["running_lora_adapters"] == "sql",
        60,
        "sql to become resident",
    )
    second = threading.Thread(target=complete, args=("chat",))
    second.start()
    seen_waiting, most_waiting = None, 0.0
    while first.is_alive():
        text = httpx.get(f"{replica.base_url}/metrics", timeout=10).text
        [(labels, value)] = _series(text, LORA_INFO)
        if labels["waiting_lora_adapters"] == "chat" and seen_waiting is None:
            seen_waiting = (labels, value)
        [(_, waiting)] = _series(text, "loraplex:num_requests_waiting")
        most_waiting = max(most_waiting, waiting)
        time.sleep(0.02)  # NOTE: the sampling rate of the gauges while sql runs (not a wait)
    first.join()
    second.join()
    assert seen_waiting is not None, "chat was never reported waiting for the one GPU slot"
    labels, value = seen_waiting
    assert labels["running_lora_adapters"] == "sql"
    assert value > before
    assert most_waiting >= 1  # the load gauge the EPP's queue scorer reads saw it too
    labels, _ = _lora_info(replica.base_url)
    assert labels == {"max_lora": "1", "running_lora_adapters": "",
                      "waiting_lora_adapters": ""}  # fmt: skip


def test_resident_adapters_endpoint_lists_the_gpu_slots(replica):
    body = {"model": "sql", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    assert httpx.post(f"{replica.base_url}/v1/completions", json=body, timeout=120).is_success
    response = httpx.get(f"{replica.base_url}/adapters/resident", timeout=10)
    assert response.status_code == 200  # public, like /metrics
    listed = response.json()
    assert listed["max_lora"] == 1
    [entry] = listed["data"]
    assert entry["id"] == "sql"  # idle in its slot: resident, though nothing runs on it
    assert entry["engine_name"].startswith(f"{entry['tenant']}/sql@")
    assert entry["running_requests"] == 0 and entry["last_used"] > 0
