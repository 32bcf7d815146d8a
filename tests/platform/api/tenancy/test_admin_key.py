"""The admin API needs an admin key: without one it answers 403 (so nobody can take an open
server over), and tenants left in the data folder are announced loudly at start-up."""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi.testclient import TestClient
from tenant_helpers import IdleEngine

from loraplex.platform.api.app import build_app
from loraplex.platform.api.settings import ServerSettings
from loraplex.platform.api.tenancy.tenancy import Tenancy
from loraplex.platform.api.tenancy.tenant_store import Tenant, TenantStore


@pytest.fixture(autouse=True)
def _no_admin_key_from_env(monkeypatch):
    monkeypatch.delenv("LORAPLEX_ADMIN_KEY", raising=False)


def test_an_open_server_refuses_the_admin_api_with_403_and_stays_open(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for headers in ({}, {"Authorization": "Bearer anything"}):
            created = http.post("/admin/tenants", json={"name": "takeover"}, headers=headers)
            assert created.status_code == 403, created.text
            error = created.json()["error"]
            assert error["code"] == "admin_disabled"
            assert "--admin-key" in error["message"] and "LORAPLEX_ADMIN_KEY" in error["message"]
            assert http.get("/admin/tenants", headers=headers).status_code == 403
        # Registering a server-local folder is an admin route too; vLLM's runtime route needs
        # vLLM's switch on an open server (test_runtime_lora.py).
        for path, body, code in (
            ("/v1/adapters/register", {"name": "a", "path": "/etc", "tenant": "default"},
             "admin_disabled"),
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"},
             "runtime_lora_updating_disabled"),
        ):  # fmt: skip
            refused = http.post(path, json=body)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == code
        # Nobody took the server over: it still serves without a key.
        assert http.get("/v1/models").status_code == 200


def _stored_tenant(data_dir) -> str:
    store = TenantStore(data_dir)
    try:
        return store.create(Tenant("left-behind"))
    finally:
        store.close()


def test_tenants_in_the_data_folder_without_an_admin_key_need_keys_and_say_so(tmp_path, caplog):
    key = _stored_tenant(tmp_path)
    with caplog.at_level(logging.WARNING, logger="loraplex.platform.api.app"):
        app = build_app(IdleEngine(), ServerSettings(data_dir=str(tmp_path)))
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "1 tenant(s)" in warning and "--admin-key" in warning
    assert str(tmp_path / "tenants.sqlite") in warning and "--data-dir" in warning
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    refused = client.post("/admin/tenants", json={"name": "x"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_disabled"
    app.state.loraplex.tenancy.close()


def test_no_warning_with_an_admin_key_or_an_empty_folder(tmp_path):
    _stored_tenant(tmp_path / "a")
    with_admin = Tenancy(tmp_path / "a", admin_key="sk-admin")
    empty = Tenancy(tmp_path / "b")
    try:
        assert with_admin.startup_warnings("127.0.0.1") == []
        assert empty.startup_warnings("127.0.0.1") == []
        (open_warning,) = empty.startup_warnings("0.0.0.0")
        assert "open" in open_warning and "--admin-key" in open_warning
    finally:
        with_admin.close()
        empty.close()


def test_the_openapi_document_shows_the_request_bodies(server):
    doc = httpx.get(f"{server.base_url}/openapi.json", timeout=30).json()
    schemas = doc["components"]["schemas"]
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/admin/tenants", "TenantCreateRequest"),
        ("/v1/adapters/register", "RegisterAdapterRequest"),
        ("/v1/load_lora_adapter", "LoadLoRAAdapterRequest"),
        ("/v1/unload_lora_adapter", "UnloadLoRAAdapterRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].endswith(model)
        assert model in schemas
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]
    assert "maximum" in str(temperature)
    assert "ChatMessage" in schemas  # models the bodies use are there too
    upload = doc["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]
    assert set(upload["multipart/form-data"]["schema"]["required"]) == {"name", "files"}
