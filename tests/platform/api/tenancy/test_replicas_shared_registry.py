"""Two replicas (two servers, two engines) over one shared adapter registry: an adapter uploaded
through one is served by the other with the same output, and a deletion reaches both. On a
tiny random Llama, so the engines step in milliseconds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from tenant_helpers import start_server, upload

from tests.waiting import wait_until

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    tiny = tiny_llama_dir
    url = f"file://{root / 'shared'}"
    servers = [
        start_server(
            tiny, root / f"data{i}", admin_key=None, adapter_registry=url, registry_sync_s=0.2
        )  # fmt: skip
        for i in range(2)
    ]
    hf_config = json.loads((tiny / "config.json").read_text())
    yield servers, write_adapter(root / "adapter", hf_config, seed=3, scale=4.0)
    for server in servers:
        server.stop()


def _complete(server, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)


def _engine_names(server) -> set[str]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {line.split('adapter="', 1)[1].split('"', 1)[0] for line in text.splitlines()
            if line.startswith("loraplex:adapter_pinned{")}  # fmt: skip


def test_upload_on_one_replica_serve_on_the_other_then_delete(replicas):
    (a, b), folder = replicas
    assert upload(a.client(None), "support", folder).status_code == 201
    on_b = _complete(b, "support")  # at once: before B's sync has run
    assert on_b.status_code == 200, on_b.text
    on_a = _complete(a, "support")
    base = _complete(a, a.model)
    tokens = [r.json()["choices"][0]["text"] for r in (on_a, on_b, base)]
    assert tokens[0] == tokens[1] != tokens[2]  # the adapter's output, on either replica
    assert [m["id"] for m in b.client(None).get("/v1/adapters").json()["data"]] == ["support"]
    wait_until(
        lambda: any(n.startswith("support@") for n in _engine_names(b)),
        30,
        "B's sync to register the adapter",
    )
    assert b.client(None).delete("/v1/adapters/support").status_code == 200
    assert _complete(a, "support").status_code == 404
    wait_until(
        lambda: not any(n.startswith("support@") for n in _engine_names(a)),
        30,
        "A's sync to unregister the adapter",
    )
