"""An adapter uploaded with its own tokenizer (a token added in a free row of a padded base
vocabulary, that row trained): served by the tenant's name, its requests are tokenized and
detokenized with its tokenizer (streamed text, stop strings, logprob tokens, /tokenize and
/detokenize) in the in-process server and with an EngineCore process; greedy text equals PEFT's;
grammar requests on it are refused with a 400; a tokenizer that changes base ids is refused
with a 400 and leaves the registry as it was."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import httpx
import pytest
from process_server import launch
from tenant_helpers import ADMIN_KEY, load_hf_model, peft_greedy, start_server

from loraplex.config import LoRAConfig
from loraplex.platform.tokenizer.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from tokenizer_adapters import NEW_TOKEN, padded_tiny_model, trained_token_adapter  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = f"Please call {NEW_TOKEN} now"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def made(model_dir, tmp_path_factory) -> tuple[Path, int, Path]:
    """(the padded tiny model, the new token's id, the adapter folder)."""
    folder = tmp_path_factory.mktemp("tokenizer-adapter")
    tiny, new_id = padded_tiny_model(folder, model_dir)
    return tiny, new_id, trained_token_adapter(tiny, folder / "adapter", new_id)


def _upload(client: httpx.Client, name: str, folder: Path) -> httpx.Response:
    """Every file of the folder: the PEFT files, the tokenizer's, and transformers' others."""
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir()) if p.is_file()]
    return client.post("/v1/adapters", data={"name": name}, files=files)


def _stream_text(client: httpx.Client, body: dict) -> str:
    text = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:]).get("choices", []))
    return text


def _check_serving(client: httpx.Client, base_name: str, name: str, made) -> None:
    """The adapter `name`'s requests use its tokenizer; the base model's do not."""
    tiny, new_id, folder = made
    tokens = client.post("/tokenize", json={"model": name, "prompt": PROMPT}).json()["tokens"]
    assert new_id in tokens
    base = client.post("/tokenize", json={"model": base_name, "prompt": PROMPT}).json()["tokens"]
    assert new_id not in base
    detokenized = client.post("/detokenize", json={"model": name, "tokens": [new_id]}).json()
    assert detokenized["prompt"] == NEW_TOKEN
    forced = {"model": name, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "logprobs": 1,
              "logit_bias": {str(new_id): 100}}  # fmt: skip
    choice = client.post("/v1/completions", json=forced).json()["choices"][0]
    assert choice["text"] == NEW_TOKEN * 2
    assert choice["logprobs"]["tokens"] == [NEW_TOKEN, NEW_TOKEN]
    assert _stream_text(client, forced) == NEW_TOKEN * 2
    stop = {**forced, "max_tokens": 4, "stop": [NEW_TOKEN]}
    stopped = client.post("/v1/completions", json=stop).json()["choices"][0]
    assert (stopped["text"], stopped["finish_reason"]) == ("", "stop")
    # the base tokenizer has no such id
    assert client.post("/v1/completions", json={**forced, "model": base_name}).status_code == 400
    body = {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    tokenizer = Tokenizer(folder, Tokenizer(tiny))
    assert text == tokenizer.decode(peft_greedy(load_hf_model(tiny), folder, tokens, MAX_TOKENS))
    chat = {"model": name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "response_format": {"type": "json_object"}}  # fmt: skip
    response = client.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400
    assert "own tokenizer" in response.json()["error"]["message"]


def _eos_remapped(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config["eos_token"] = NEW_TOKEN
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest


def test_an_uploaded_adapter_is_served_with_its_own_tokenizer(made, tmp_path):
    tiny, _, folder = made
    server = start_server(tiny, tmp_path / "data", lora=LoRAConfig(max_saved_module_loras=1))
    try:
        created = server.client(ADMIN_KEY).post("/admin/tenants", json={"name": "acme"})
        client = server.client(created.json()["api_key"])
        before = client.get("/v1/adapters").json()
        bad = _upload(client, "tool", _eos_remapped(folder, tmp_path / "bad"))
        assert bad.status_code == 400 and "eos_token" in bad.json()["error"]["message"], bad.text
        assert client.get("/v1/adapters").json() == before
        assert _upload(client, "tool", folder).status_code == 201
        digest = client.get("/v1/adapters/tool").json()["digest"].removeprefix("sha256:")
        stored = tmp_path / "data" / "adapters" / digest
        assert (stored / "tokenizer.json").is_file()  # kept with its content-addressed files
        _check_serving(client, server.model, "tool", made)
        load = {"lora_name": "loaded", "lora_path": str(folder), "tenant": "acme"}
        response = server.client(ADMIN_KEY).post("/v1/load_lora_adapter", json=load)
        assert response.status_code == 201, response.text  # vLLM's route copies it as well
        tokenize = {"model": "loaded", "prompt": PROMPT}
        assert made[1] in client.post("/tokenize", json=tokenize).json()["tokens"]
    finally:
        server.stop()


def test_the_engine_process_mode_serves_it_with_its_own_tokenizer(made, tmp_path):
    tiny, _, folder = made
    served = launch(tiny, tmp_path / "serve.log", 1, "--max-saved-module-loras", "1")
    try:
        with httpx.Client(base_url=served.base_url, timeout=120) as client:
            assert _upload(client, "tool", folder).status_code == 201
            _check_serving(client, served.model, "tool", made)
    finally:
        assert served.stop() == 0, served.log()
