"""What the public routes say, and that no name can break them: on a server with tenants,
/metrics and /adapters/resident name no tenant and no tenant's adapter without the metrics key
(or the admin key); names with control characters are refused wherever names are accepted; and
a name stored by an older version (an adapter called "x\\n") and a served model name full of
quotes and backslashes leave /metrics parseable by Prometheus' own parser, the bad name still
deletable. On a tiny random Llama, so the engine steps in milliseconds."""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time
from pathlib import Path

import pytest
from tenant_helpers import ADMIN_KEY, create_tenants, start_server, upload

from loraplex.adapters.registry import AdapterRegistry
from loraplex.config import ModelConfig
from loraplex.entrypoints.lora_modules import parse_lora_modules

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

parser = pytest.importorskip("prometheus_client.parser", reason="prometheus-client: dev extra")

METRICS_KEY = "sk-metrics-test"
SERVED = 'tiny "base" \\ model'  # quotes and a backslash: escaped in every model_name label
BAD = "x\n"  # what older versions accepted (`$` matches before a trailing newline)


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    """A server with tenant alpha, its adapter `support`, and `x\\n`, a copy of it stored under
    the name an older version accepted (planted in the catalogue between two starts)."""
    root = tmp_path_factory.mktemp("public")
    tiny = tiny_llama_dir
    adapter = write_adapter(root / "adapter", json.loads((tiny / "config.json").read_text()), 5)
    data = root / "data"
    options = dict(served_model_name=SERVED, metrics_key=METRICS_KEY)

    server = start_server(tiny, data, **options)
    keys = create_tenants(server, "alpha")
    assert upload(server.client(keys["alpha"]), "support", adapter).status_code == 201
    refused = upload(server.client(keys["alpha"]), BAD, adapter)
    server.stop()
    registry = AdapterRegistry(data)
    stored = registry.catalog.get("alpha", "support")
    registry.catalog.put(dataclasses.replace(stored, name=BAD))
    registry.close()

    server = start_server(tiny, data, **options)
    alpha = server.client(keys["alpha"])
    body = {"model": "support", "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    assert alpha.post("/v1/completions", json=body).status_code == 200
    yield {"server": server, "alpha": alpha, "refused": refused, "tiny": tiny, "adapter": adapter}
    server.stop()


def _metrics(server, key: str | None) -> str:
    response = server.client(key).get("/metrics")
    assert response.status_code == 200, response.text
    return response.text


def test_names_with_control_characters_are_refused_where_names_are_accepted(world, tmp_path):
    refused = world["refused"]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "name"
    admin = world["server"].client(ADMIN_KEY)
    for name in ("t\n", "t\r", "t\x00", "t\u2028"):
        assert admin.post("/admin/tenants", json={"name": name}).status_code == 400, name
    body = {"name": "y\n", "path": str(tmp_path), "tenant": "alpha"}
    response = admin.post("/v1/adapters/register", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "name"
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="invalid adapter name"):
        parse_lora_modules([f"x\n={tmp_path}"])
    for name in ("a\nb", "tab\tname", " padded", ""):
        with pytest.raises(ValueError, match="served_model_name"):
            ModelConfig(served_model_name=name)


def test_metrics_parse_with_prometheus_after_hostile_names(world):
    for key in (None, METRICS_KEY):
        text = _metrics(world["server"], key)
        families = {f.name: f for f in parser.text_string_to_metric_families(text)}
        [sample] = families["loraplex:num_requests_running"].samples
        assert sample.labels["model_name"] == SERVED  # read back exactly
    adapters = {
        s.labels["adapter"]
        for s in families["loraplex:adapter_pinned"].samples
        if s.labels["tenant"] == "alpha"
    }
    assert {a.split("@")[0] for a in adapters} == {"support", BAD}


def test_public_routes_name_no_tenant_or_adapter_without_the_key(world):
    server, alpha = world["server"], world["alpha"]
    for key in (None, "sk-wrong", alpha.headers["authorization"].split()[-1]):
        text = _metrics(server, key)
        assert "alpha" not in text and "support" not in text, key
        assert "loraplex:num_requests_waiting" in text and "loraplex:lora_requests_info" in text
        assert "loraplex:lora_adapters_resident" in text  # counts by tier name nobody
        resident = server.client(key).get("/adapters/resident")
        assert resident.status_code == 401
        assert resident.json()["error"]["type"] == "authentication_error"
    for key in (METRICS_KEY, ADMIN_KEY):
        text = _metrics(server, key)
        assert 'loraplex:tenant_requests_total{tenant="alpha"}' in text
        resident = server.client(key).get("/adapters/resident")
        assert resident.status_code == 200
        assert "support" in [a["id"] for a in resident.json()["data"]]


def _lora_info_while_running(
    server, alpha, public_shows: str = ""
) -> tuple[dict[str, str], dict[str, str]]:
    """`lora_requests_info`'s labels for the metrics key and for no key, read together while
    requests run on alpha's adapter `support` (until the public view lists `public_shows`)."""

    def lora_info(key: str | None) -> dict[str, str]:
        families = parser.text_string_to_metric_families(_metrics(server, key))
        [family] = [f for f in families if f.name == "loraplex:lora_requests_info"]
        return family.samples[0].labels

    body = {"model": "support", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}
    done = threading.Event()

    def keep_running() -> None:
        while not done.is_set():
            assert alpha.post("/v1/completions", json=body).status_code == 200

    running = threading.Thread(target=keep_running)
    running.start()
    try:
        deadline = time.monotonic() + 60
        # NOTE: a copy of support (one digest, one slot) shows as running too
        while True:
            keyed, public = lora_info(METRICS_KEY), lora_info(None)
            if "support" in keyed["running_lora_adapters"] and (
                public_shows in public["running_lora_adapters"]
            ):
                return keyed, public
            assert running.is_alive() and time.monotonic() < deadline, (keyed, public)
            time.sleep(0.01)
    finally:
        done.set()
        running.join()


def test_the_lora_gauge_names_running_adapters_only_to_the_key(world):
    """The GIE gauge keeps its layout without the key, but lists no tenant's adapter."""
    keyed, public = _lora_info_while_running(world["server"], world["alpha"])
    assert "support" in keyed["running_lora_adapters"].split(",")
    assert public["running_lora_adapters"] == "" and public["max_lora"] == keyed["max_lora"]


def test_public_adapter_names_list_adapters_for_the_picker_but_no_tenant(world, tmp_path):
    server = start_server(
        world["tiny"], tmp_path, metrics_key=METRICS_KEY, metrics_public_adapter_names=True
    )
    try:
        key = create_tenants(server, "alpha")["alpha"]
        assert upload(server.client(key), "support", world["adapter"]).status_code == 201
        _, public = _lora_info_while_running(server, server.client(key), public_shows="support")
        assert public["running_lora_adapters"] == "support"
        text = _metrics(server, None)
        assert "alpha" not in text and "loraplex:tenant_requests_total" not in text
    finally:
        server.stop()


def test_an_adapter_stored_under_a_bad_name_stays_deletable(world):
    alpha = world["alpha"]
    assert alpha.get("/v1/adapters/x%0A").json()["id"] == BAD
    response = alpha.delete("/v1/adapters/x%0A")
    assert response.status_code == 200 and response.json()["id"] == BAD
    assert [a["id"] for a in alpha.get("/v1/adapters").json()["data"]] == ["support"]
    assert alpha.get("/v1/adapters/x").status_code == 404  # nothing else was touched
