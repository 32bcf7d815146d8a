"""logit_bias through the `openai` SDK, as OpenAI defines it: +100 makes a token the only
choice, -100 bans it."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=120)


def _ids(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60).json()["tokens"]


def test_logit_bias_forces_and_bans_tokens(client, server):
    kwargs = dict(model=server.model, prompt="The sky is", max_tokens=3, temperature=0,
                  logprobs=0)  # fmt: skip
    plain = client.completions.create(**kwargs)
    first = _ids(server, plain.choices[0].text)[0]
    banned = client.completions.create(**kwargs, logit_bias={str(first): -100})
    assert _ids(server, banned.choices[0].text)[0] != first
    (blue,) = _ids(server, " blue")
    forced = client.completions.create(**kwargs, logit_bias={str(blue): 100})
    assert forced.choices[0].text == " blue" * 3
    # logprobs stay those of the model's own distribution (before the bias), as in vLLM
    assert forced.choices[0].logprobs.token_logprobs[0] < 0
    chat = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        temperature=1.0, seed=5, logit_bias={str(blue): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == " blue blue"
