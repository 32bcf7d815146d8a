"""vLLM's runtime adapter routes as a vLLM operator uses them: `load_lora_adapter` with vLLM's
body serves a server-wide adapter on a server that allows runtime updates (vLLM's switch), and
`unload_lora_adapter` takes it away; who may call them, and what each refusal says to do."""

from __future__ import annotations

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from process_server import launch
from tenant_helpers import (
    ADMIN_KEY,
    IdleEngine,
    create_tenants,
    load_hf_model,
    make_adapter,
    start_server,
)

from loraplex.platform.api.app import build_app
from loraplex.platform.api.settings import ServerSettings

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Write one word about the sea."}]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapters")
    base = load_hf_model(model_dir)
    return {name: make_adapter(base, folder / name, seed=seed) for name, seed in
            (("sql", 21), ("other", 22))}  # fmt: skip


@pytest.fixture(autouse=True)
def _no_switch_from_the_environment(monkeypatch):
    for name in ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING",
                 "LORAPLEX_ADMIN_KEY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def _chat(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    return reply.choices[0].message.content


def test_a_vllm_script_runs_unchanged_on_the_quick_start_server(
    model_dir, adapters, tmp_path, monkeypatch
):
    """The quick-start server (no admin key, no tenants) started with vLLM's switch; then
    exactly what a script written for vLLM does, with no key."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    served = launch(model_dir, tmp_path / "serve.log", 1)
    try:
        base_url = served.base_url
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0)
        base_text = _chat(client, served.model)

        response = httpx.post(
            f"{base_url}/v1/load_lora_adapter",
            json={"lora_name": "sql-lora", "lora_path": str(adapters["sql"])},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert "sql-lora" in response.text
        assert "sql-lora" in [m.id for m in client.models.list().data]
        assert _chat(client, "sql-lora") != base_text  # the adapter changes the output

        again = httpx.post(
            f"{base_url}/v1/load_lora_adapter",
            json={"lora_name": "sql-lora", "lora_path": str(adapters["other"])},
            timeout=60,
        )
        assert again.status_code == 400 and "already been loaded" in again.text

        response = httpx.post(
            f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}, timeout=60
        )
        assert response.status_code == 200, response.text
        assert "sql-lora" not in [m.id for m in client.models.list().data]
        with pytest.raises(openai.NotFoundError):
            _chat(client, "sql-lora")
        gone = httpx.post(
            f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "sql-lora"}, timeout=60
        )
        assert gone.status_code == 404
        assert gone.json()["error"]["param"] == "lora_name"
    finally:
        assert served.stop() == 0, served.log()


@pytest.fixture(scope="module")
def admin_server(model_dir, tmp_path_factory):
    """A server with an admin key and one tenant, that allows runtime updates (the flag)."""
    server = start_server(
        model_dir, tmp_path_factory.mktemp("data"), allow_runtime_lora_updating=True
    )
    keys = create_tenants(server, "acme")
    yield server, keys["acme"]
    server.stop()


def test_with_an_admin_key_server_wide_adapters_take_it(admin_server, adapters):
    server, tenant_key = admin_server
    body = {"lora_name": "shared", "lora_path": str(adapters["sql"])}
    assert server.client(None).post("/v1/load_lora_adapter", json=body).status_code == 401
    refused = server.client(tenant_key).post("/v1/load_lora_adapter", json=body)
    assert refused.status_code == 403, refused.text
    assert "admin key" in refused.json()["error"]["message"]
    assert "POST /v1/adapters" in refused.json()["error"]["message"]

    loaded = server.client(ADMIN_KEY).post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    tenant = server.client(tenant_key)
    assert "shared" in [m["id"] for m in tenant.get("/v1/models").json()["data"]]
    chat = {"model": "shared", "messages": CHAT, "max_tokens": 4, "temperature": 0}
    assert tenant.post("/v1/chat/completions", json=chat).status_code == 200

    unload = {"lora_name": "shared"}
    refused = tenant.post("/v1/unload_lora_adapter", json=unload)
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
    assert server.client(ADMIN_KEY).post("/v1/unload_lora_adapter", json=unload).status_code == 200
    assert tenant.post("/v1/chat/completions", json=chat).status_code == 404


def test_the_tenant_scoped_form_stays_beside_it(admin_server, adapters):
    server, tenant_key = admin_server
    admin, tenant = server.client(ADMIN_KEY), server.client(tenant_key)
    body = {"lora_name": "mine", "lora_path": str(adapters["other"]), "tenant": "acme"}
    loaded = admin.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 201, loaded.text
    assert "mine" in [m["id"] for m in tenant.get("/v1/models").json()["data"]]
    # a server-wide adapter may not take a tenant's name (it would take over its requests)
    clash = admin.post("/v1/load_lora_adapter", json={"lora_name": "mine",
                                                       "lora_path": str(adapters["sql"])})  # fmt: skip
    assert clash.status_code == 400 and clash.json()["error"]["param"] == "lora_name"
    # the tenant unloads its own adapter by name; then it is a 404 naming lora_name
    assert tenant.post("/v1/unload_lora_adapter", json={"lora_name": "mine"}).status_code == 200
    gone = tenant.post("/v1/unload_lora_adapter", json={"lora_name": "mine"})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "lora_name"


def test_a_missing_name_says_which_field(admin_server, adapters):
    server, _ = admin_server
    admin = server.client(ADMIN_KEY)
    response = admin.post("/v1/load_lora_adapter", json={"lora_path": str(adapters["sql"])})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "lora_name" and "`lora_name` is required" in error["message"]
    assert "None" not in error["message"]
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for body in (b"[1]", b'"x"', b"{"):  # JSON that is no object, or no JSON: a 400
            assert admin.post(path, content=body).status_code == 400


@pytest.mark.parametrize("admin_key", [None, ADMIN_KEY])
def test_without_the_switch_the_refusal_names_it(tmp_path, admin_key):
    app = build_app(IdleEngine(), ServerSettings(data_dir=str(tmp_path), admin_key=admin_key))
    client = TestClient(app)
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    try:
        for path, body in (
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/nowhere"}),
            ("/v1/unload_lora_adapter", {"lora_name": "a"}),
        ):
            if admin_key is None and path.endswith("unload_lora_adapter"):
                continue  # on an open server this is the one tenant's adapter (404 here)
            refused = client.post(path, json=body, headers=headers)
            assert refused.status_code == 403, refused.text
            error = refused.json()["error"]
            assert error["code"] == "runtime_lora_updating_disabled"
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in error["message"]
            assert "--allow-runtime-lora-updating" in error["message"]
            assert ("`tenant`" in error["message"]) == (admin_key is not None)
    finally:
        app.state.loraplex.tenancy.close()
        app.state.responses.close()


def test_the_switch_reads_vllms_variable_and_ours(monkeypatch):
    from loraplex import envs

    assert not envs.allow_runtime_lora_updating()
    for name, value in (("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
                        ("LORAPLEX_ALLOW_RUNTIME_LORA_UPDATING", "1")):  # fmt: skip
        monkeypatch.setenv(name, value)
        assert envs.allow_runtime_lora_updating()
        assert not ServerSettings(allow_runtime_lora_updating=False).runtime_lora_updating
        monkeypatch.delenv(name)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not ServerSettings().runtime_lora_updating
