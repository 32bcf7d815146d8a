"""A tenant's chat template cannot stop the other tenants: an adapter whose own template is three
nested loops of 100,000 is refused at upload (tried on a short conversation under the time
limit); one whose template explodes only on some conversations is accepted, and eight chats that
trigger it all answer 4xx within the time limit, while another tenant's chats, completions and
stored responses are served meanwhile. On a tiny random Llama."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path

import httpx
import pytest
from tenant_helpers import create_tenants, start_server

sys.path.insert(0, str(Path(__file__).parents[3] / "adapters"))
from random_adapters import write_adapter  # noqa: E402

TIMEOUT_S = 5.0  # --chat-template-timeout: long beside a render, short beside a bomb
LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}" + (
    "{% endfor %}{% endfor %}{% endfor %}"
)
PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
# explodes only on a conversation that says "boom": it passes the upload's probe
TRAP = "{% for m in messages %}{% if m.content == 'boom' %}" + LOOPS + "{% endif %}{% endfor %}"
TRAP += PLAIN


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bomb")
    tiny = tiny_llama_dir
    hf_config = json.loads((tiny / "config.json").read_text())
    server = start_server(tiny, root / "data", chat_template_timeout_s=TIMEOUT_S)
    keys = create_tenants(server, "mallory", "bob")

    def adapter(name: str, template: str) -> Path:
        folder = write_adapter(root / name, hf_config, seed=1)
        shutil.copyfile(tiny / "tokenizer.json", folder / "tokenizer.json")
        (folder / "chat_template.jinja").write_text(template)
        return folder

    yield {"server": server, "keys": keys, "adapter": adapter}
    server.stop()


def _upload(client: httpx.Client, name: str, folder: Path) -> httpx.Response:
    files = [("files", (p.name, p.read_bytes())) for p in sorted(folder.iterdir())]
    return client.post("/v1/adapters", data={"name": name}, files=files)


def test_a_template_of_nested_loops_is_refused_at_upload(world):
    mallory = world["server"].client(world["keys"]["mallory"])
    start = time.monotonic()
    response = _upload(mallory, "bomb", world["adapter"]("bomb", LOOPS))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_adapter" and "took longer than" in error["message"]
    assert time.monotonic() - start < TIMEOUT_S + 10
    assert mallory.get("/v1/adapters").json()["data"] == []


def test_a_template_bomb_answers_4xx_in_time_while_another_tenant_is_served(world):
    server, keys = world["server"], world["keys"]
    mallory = server.client(keys["mallory"])
    assert _upload(mallory, "trap", world["adapter"]("trap", TRAP)).status_code == 201
    hello = {"model": "trap", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert mallory.post("/v1/chat/completions", json=hello).status_code == 200
    bob = server.client(keys["bob"])
    stored = bob.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2}).json()["id"]

    async def bomb(client: httpx.AsyncClient) -> tuple[int, str, float]:
        body = {**hello, "messages": [{"role": "user", "content": "boom"}]}
        start = time.monotonic()
        response = await client.post("/v1/chat/completions", json=body)
        return response.status_code, response.json()["error"]["code"], time.monotonic() - start

    async def served(client: httpx.AsyncClient) -> tuple[list[int], float]:
        await asyncio.sleep(0.3)  # the bombs are rendering by now
        start = time.monotonic()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        statuses = [
            (await client.post("/v1/chat/completions", json=chat)).status_code,
            (await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code,
            (await client.get(f"/v1/responses/{stored}")).status_code,
            (await client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})).status_code,
        ]  # fmt: skip
        return statuses, time.monotonic() - start

    async def main():
        headers = {k: {"Authorization": f"Bearer {keys[k]}"} for k in ("mallory", "bob")}
        async with (
            httpx.AsyncClient(base_url=server.base_url, headers=headers["mallory"], timeout=120)
            as attacker,
            httpx.AsyncClient(base_url=server.base_url, headers=headers["bob"], timeout=120)
            as other,
        ):  # fmt: skip
            return await asyncio.gather(*(bomb(attacker) for _ in range(8)), served(other))

    *bombs, (statuses, took) = asyncio.run(main())
    # mallory's renders take turns on one render process: the render is killed at the limit
    # (400), and the chats waiting for mallory's turn that long are turned away (429)
    codes = {code for _, code, _ in bombs}
    assert "chat_template_timeout" in codes and codes <= {
        "chat_template_timeout",
        "chat_template_busy",
    }, bombs
    assert all(400 <= status < 500 for status, _, _ in bombs)
    assert max(elapsed for _, _, elapsed in bombs) < 2 * TIMEOUT_S + 5, bombs
    assert statuses == [200, 200, 200, 200]
    assert took < TIMEOUT_S, took  # bob was served while the bomb rendered
    # the killed render process is replaced: the adapter serves harmless chats again
    assert mallory.post("/v1/chat/completions", json=hello).status_code == 200
    assert server.client(None).get("/health").status_code == 200
