"""Tenants against a live server: keys and the admin API, per-tenant adapters served exactly as
PEFT runs them, the cross-tenant 404 matrix, replacement mid-request, limits, and a restart."""

from __future__ import annotations

import hashlib
import threading

import pytest
from tenant_helpers import (
    ADMIN_KEY,
    complete,
    create_tenants,
    load_hf_model,
    make_adapter,
    peft_greedy,
    start_server,
    upload,
)

from loraplex.config import LoRAConfig
from tests.waiting import wait_until

PROMPT = [1, 504, 3458, 314, 260, 1345, 28, 4038, 314]
MAX_TOKENS = 6
MAX_ADAPTER_BYTES = 8_000_000


@pytest.fixture(scope="module")
def world(model_dir, tmp_path_factory):
    """A server with an admin key, two tenants (alpha, beta) and PEFT adapters made for them."""
    data_dir = tmp_path_factory.mktemp("data")
    adapters = tmp_path_factory.mktemp("adapters")
    base = load_hf_model(model_dir)
    folders = {
        "alpha": make_adapter(base, adapters / "alpha", seed=1),
        "beta": make_adapter(base, adapters / "beta", seed=2),
        "alpha2": make_adapter(base, adapters / "alpha2", seed=3),
    }
    # NOTE: one slot for embed_tokens / lm_head copies, for test_bad_uploads' trained-tokens form
    lora = LoRAConfig(max_saved_module_loras=1)
    server = start_server(model_dir, data_dir, lora=lora, max_adapter_bytes=MAX_ADAPTER_BYTES)
    keys = create_tenants(server, "alpha", "beta")
    state = {"server": server, "data_dir": data_dir, "base": base, "folders": folders,
             "keys": keys}  # fmt: skip
    yield state
    state["server"].stop()


def _client(world, tenant):
    return world["server"].client(world["keys"][tenant])


def test_missing_or_unknown_key_gets_401_and_admin_routes_take_only_the_admin_key(world):
    server = world["server"]
    for key in (None, "sk-nope"):
        response = server.client(key).get("/v1/models")
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
        assert server.client(key).post("/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert _client(world, "alpha").get("/admin/tenants").status_code == 401
    assert server.client("sk-nope").post("/admin/tenants", json={"name": "x"}).status_code == 401
    listed = server.client(ADMIN_KEY).get("/admin/tenants").json()["data"]
    assert {t["name"] for t in listed} >= {"alpha", "beta"}
    assert all("key" not in str(t) for t in listed)


def test_rotate_and_delete_tenant_keys(world):
    admin = world["server"].client(ADMIN_KEY)
    key = admin.post("/admin/tenants", json={"name": "gamma"}).json()["api_key"]
    assert world["server"].client(key).get("/v1/models").status_code == 200
    assert admin.post("/admin/tenants", json={"name": "gamma"}).status_code == 409
    new = admin.post("/admin/tenants/gamma/rotate-key").json()["api_key"]
    assert world["server"].client(key).get("/v1/models").status_code == 401
    assert world["server"].client(new).get("/v1/models").status_code == 200
    assert admin.delete("/admin/tenants/gamma").status_code == 200
    assert world["server"].client(new).get("/v1/models").status_code == 401
    assert admin.delete("/admin/tenants/gamma").status_code == 404


def test_two_tenants_same_adapter_name_each_served_as_peft_runs_it(world):
    base, folders, server = world["base"], world["folders"], world["server"]
    texts = {}
    for tenant in ("alpha", "beta"):
        client = _client(world, tenant)
        response = upload(client, "support", folders[tenant])
        assert response.status_code == 201, response.text
        models = client.get("/v1/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            (server.model, None),
            ("support", server.model),
        ]
        response = complete(client, "support", PROMPT, MAX_TOKENS)
        assert response.status_code == 200, response.text
        texts[tenant] = response.json()["choices"][0]["text"]
        expected = peft_greedy(base, folders[tenant], PROMPT, MAX_TOKENS)
        assert texts[tenant] == server.engine.tokenizer.decode(expected)
    base_text = complete(_client(world, "alpha"), None, PROMPT, MAX_TOKENS).json()
    assert len({texts["alpha"], texts["beta"], base_text["choices"][0]["text"]}) == 3


def test_cross_tenant_matrix_is_404_and_changes_nothing(world):
    alpha, beta = _client(world, "alpha"), _client(world, "beta")
    assert upload(alpha, "secret", world["folders"]["alpha"]).status_code == 201
    before = alpha.get("/v1/adapters/secret").json()
    blobs_before = sorted(p.name for p in (world["data_dir"] / "adapters").iterdir())
    attempts = [
        beta.get("/v1/adapters/secret"),
        beta.delete("/v1/adapters/secret"),
        beta.get("/v1/models/secret"),
        beta.post("/v1/unload_lora_adapter", json={"lora_name": "secret"}),
        complete(beta, "secret", PROMPT, 2),
        beta.post("/v1/chat/completions",
                  json={"model": "secret", "messages": [{"role": "user", "content": "hi"}]}),
    ]  # fmt: skip
    assert [r.status_code for r in attempts] == [404] * len(attempts)
    assert "secret" not in str(beta.get("/v1/adapters").json())
    assert "secret" not in [m["id"] for m in beta.get("/v1/models").json()["data"]]
    assert alpha.get("/v1/adapters/secret").json() == before
    assert sorted(p.name for p in (world["data_dir"] / "adapters").iterdir()) == blobs_before
    # beta uploading under the same name makes beta's own adapter, leaving alpha's alone
    assert upload(beta, "secret", world["folders"]["beta"]).json()["replaced"] is False
    assert alpha.get("/v1/adapters/secret").json() == before
    assert beta.delete("/v1/adapters/secret").status_code == 200
    assert alpha.get("/v1/adapters/secret").json() == before


def test_replacing_an_adapter_mid_request(world):
    client = _client(world, "alpha")
    folders = world["folders"]
    assert upload(client, "swap", folders["alpha"]).status_code == 201
    old_text = complete(client, "swap", PROMPT, 40).json()["choices"][0]["text"]
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(r=complete(client, "swap", PROMPT, 40)), daemon=True
    )
    thread.start()
    engine = world["server"].engine
    wait_until(lambda: engine.snapshot().stats.num_running > 0, 60, "the request to be decoding")
    replaced = upload(client, "swap", folders["alpha2"])
    assert replaced.status_code == 201 and replaced.json()["replaced"] is True
    thread.join(120)
    assert result["r"].json()["choices"][0]["text"] == old_text
    new = complete(client, "swap", PROMPT, MAX_TOKENS).json()["choices"][0]["text"]
    expected = peft_greedy(world["base"], folders["alpha2"], PROMPT, MAX_TOKENS)
    assert new == world["server"].engine.tokenizer.decode(expected)


def test_concurrency_and_token_limits_answer_429_with_retry_after(world):
    server = world["server"]
    admin = server.client(ADMIN_KEY)
    tenant = {"name": "capped", "max_concurrent_requests": 1, "tokens_per_minute": 60}
    key = admin.post("/admin/tenants", json=tenant).json()["api_key"]
    client = server.client(key)
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(complete(client, None, PROMPT, 24)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    statuses = sorted(r.status_code for r in results)
    assert statuses[0] == 200 and 429 in statuses
    refused = next(r for r in results if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    # 9 + 24 tokens used in this minute, and this one may use 9 + 40 more: over 60.
    over_budget = complete(client, None, PROMPT, 40)
    assert over_budget.status_code == 429
    assert 1 <= int(over_budget.headers["Retry-After"]) <= 60


def test_metrics_per_tenant_and_adapter(world):
    text = world["server"].client(ADMIN_KEY).get("/metrics").text
    assert 'loraplex:tenant_requests_total{tenant="alpha"}' in text
    assert 'loraplex:tenant_request_errors_total{tenant="beta"}' in text
    assert 'loraplex:tenant_generation_tokens_total{tenant="beta",adapter="support@' in text
    assert 'loraplex:lora_adapters_resident{tier="disk"}' in text
    assert 'loraplex:lora_loads_total{tier="gpu"}' in text


def test_restart_serves_the_same_adapters_byte_identical(world, model_dir):
    alpha = _client(world, "alpha")
    before = alpha.get("/v1/adapters/support").json()
    text = complete(alpha, "support", PROMPT, MAX_TOKENS).json()["choices"][0]["text"]
    world["server"].stop()
    world["server"] = start_server(
        model_dir, world["data_dir"], max_adapter_bytes=MAX_ADAPTER_BYTES
    )
    alpha = _client(world, "alpha")
    assert alpha.get("/v1/adapters/support").json() == before
    digest = before["digest"].removeprefix("sha256:")
    # the stored adapters are registered with the engine at startup, before any request
    metrics = world["server"].client(ADMIN_KEY).get("/metrics").text
    assert f'tenant="alpha",adapter="support@{digest[:12]}",tier="disk"' in metrics
    assert complete(alpha, "support", PROMPT, MAX_TOKENS).json()["choices"][0]["text"] == text
    folder, blob = world["folders"]["alpha"], world["data_dir"] / "adapters" / digest
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        original = hashlib.sha256((folder / name).read_bytes()).hexdigest()
        assert hashlib.sha256((blob / name).read_bytes()).hexdigest() == original
