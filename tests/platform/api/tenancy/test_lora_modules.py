"""`--lora-modules` (vLLM's flag): adapters served from start-up to every tenant under their
own names, with PEFT's greedy output; their names cannot be taken by a tenant's upload; a bad
entry stops `loraplex serve` with exit status 2 and the reason."""

from __future__ import annotations

import json

import httpx
import pytest
from process_server import launch
from tenant_helpers import (
    complete,
    create_tenants,
    load_hf_model,
    make_adapter,
    peft_greedy,
    start_server,
    upload,
)

from loraplex.entrypoints.lora_modules import parse_lora_modules
from loraplex.platform.api.settings import LoRAModule

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 314, 4649, 314]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def world(model_dir, tmp_path_factory):
    """A server with an admin key, two tenants, and two `--lora-modules` adapters."""
    folder = tmp_path_factory.mktemp("modules")
    base = load_hf_model(model_dir)
    sql = make_adapter(base, folder / "sql", seed=11)
    chat = make_adapter(base, folder / "chat", seed=12)
    modules = parse_lora_modules(
        [f"sql-lora={sql}", json.dumps({"name": "chat-lora", "path": str(chat)})]
    )
    server = start_server(model_dir, tmp_path_factory.mktemp("data"), lora_modules=modules)
    keys = create_tenants(server, "alpha", "beta")
    yield {"server": server, "base": base, "sql": sql, "chat": chat, "keys": keys}
    server.stop()


def test_every_tenant_lists_and_runs_the_modules_as_peft_does(world):
    server = world["server"]
    expected = {
        name: peft_greedy(world["base"], world[key], PROMPT, MAX_TOKENS)
        for name, key in (("sql-lora", "sql"), ("chat-lora", "chat"))
    }
    base_tokens = peft_greedy(world["base"], None, PROMPT, MAX_TOKENS)
    assert expected["sql-lora"] != base_tokens != expected["chat-lora"]
    for tenant, key in world["keys"].items():
        client = server.client(key)
        ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == [server.model, "sql-lora", "chat-lora"], tenant
        card = client.get("/v1/models/sql-lora").json()
        assert (card["root"], card["parent"]) == (server.model, server.model)
        for name, tokens in expected.items():
            body = complete(client, name, PROMPT, MAX_TOKENS).json()
            assert body["choices"][0]["text"] == server.engine.tokenizer.decode(tokens), name


def test_a_tenant_cannot_upload_over_a_module_name(world):
    client = world["server"].client(world["keys"]["alpha"])
    response = upload(client, "sql-lora", world["chat"])
    assert response.status_code == 400
    assert "--lora-modules" in response.json()["error"]["message"]
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids.count("sql-lora") == 1
    # a tenant's own adapter under another name still works beside them
    assert upload(client, "mine", world["chat"]).status_code in (200, 201)
    assert "mine" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    other = world["server"].client(world["keys"]["beta"])
    assert "mine" not in [m["id"] for m in other.get("/v1/models").json()["data"]]


def test_two_api_processes_serve_the_modules(world, model_dir, tmp_path):
    """With an engine-core process, each API process registers the modules at start-up."""
    expected = peft_greedy(world["base"], world["sql"], PROMPT, MAX_TOKENS)
    served = launch(
        model_dir, tmp_path / "serve.log", 2, "--lora-modules", f"sql-lora={world['sql']}"
    )
    try:
        with httpx.Client(base_url=served.base_url, timeout=120) as client:
            for _ in range(4):  # new connections: both processes answer some of them
                with httpx.Client(base_url=served.base_url, timeout=120) as fresh:
                    ids = [m["id"] for m in fresh.get("/v1/models").json()["data"]]
                    assert ids == [served.model, "sql-lora"]
            text = complete(client, "sql-lora", PROMPT, MAX_TOKENS).json()["choices"][0]["text"]
            assert text == world["server"].engine.tokenizer.decode(expected)
    finally:
        assert served.stop() == 0, served.log()


@pytest.mark.parametrize(
    "entry, message",
    [
        ("no-equals-sign", "neither name=path"),
        ("../up=/tmp", "invalid adapter name"),
        ('{"name": "x", "path": "/nowhere"}', "not a PEFT adapter folder"),
        ('{"name": "x"', "not valid JSON"),
        ('{"name": "x", "path": "/tmp", "rank": 4}', "unknown field"),
    ],
)
def test_bad_entries_are_refused_with_the_reason(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules([entry])


def test_a_name_given_twice_is_refused(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules([f"a={tmp_path}", {"name": "a", "path": str(tmp_path)}])
    assert parse_lora_modules([{"name": "a", "path": str(tmp_path), "base_model_name": "m"}]) == (
        LoRAModule("a", str(tmp_path.resolve()), "m"),
    )


def test_serve_exits_2_with_the_reason(capsys, tmp_path):
    from loraplex.cli import main

    assert main(["serve", "--lora-modules", f"x={tmp_path}", "--port", "1"]) == 2
    assert "not a PEFT adapter folder" in capsys.readouterr().err
