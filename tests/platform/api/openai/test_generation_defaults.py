"""Requests that leave sampling fields out get the server's defaults (vLLM's generation config:
`--override-generation-config` here), so a plain SDK call without max_tokens ends after the
default max_tokens, and a tenant's token budget reserves that, not the whole context."""

from __future__ import annotations

import openai
import pytest
from tenant_helpers import ADMIN_KEY, start_server

pytestmark = pytest.mark.slow

DEFAULT_MAX_TOKENS = 5
CHAT = [{"role": "user", "content": "Tell me a long story about the sea."}]


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("data"),
        override_generation_config={"max_new_tokens": DEFAULT_MAX_TOKENS, "temperature": 0.0},
    )
    clients = {}
    for name, limits in (("roomy", {}), ("small", {"tokens_per_minute": 300})):
        created = server.client(ADMIN_KEY).post("/admin/tenants", json={"name": name, **limits})
        assert created.status_code == 201, created.text
        key = created.json()["api_key"]
        clients[name] = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)
    yield server, clients
    server.stop()


def test_a_plain_sdk_call_stops_at_the_default_max_tokens(served):
    server, clients = served
    client = clients["roomy"]
    first = client.chat.completions.create(model=server.model, messages=CHAT)
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == DEFAULT_MAX_TOKENS
    # temperature left out: the default (0) applies, so the text repeats
    again = client.chat.completions.create(model=server.model, messages=CHAT)
    assert again.choices[0].message.content == first.choices[0].message.content


def test_the_requests_own_values_win(served):
    server, clients = served
    client = clients["roomy"]
    short = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=2)
    assert short.usage.completion_tokens == 2
    response = client.responses.create(model=server.model, input="Hi", temperature=0.5)
    assert response.temperature == 0.5
    default = client.responses.create(model=server.model, input="Hi")
    assert default.temperature == 0.0 and default.usage.output_tokens <= DEFAULT_MAX_TOKENS


def test_a_tenant_budget_reserves_the_default_not_the_whole_context(served):
    """The tenant's 300 tokens per minute are less than the 512-token context: a request
    without max_tokens used to reserve the whole context and be refused every time."""
    server, clients = served
    client = clients["small"]
    reply = client.chat.completions.create(model=server.model, messages=CHAT)
    assert reply.usage.completion_tokens == DEFAULT_MAX_TOKENS
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=400)
    error = refused.value.body
    assert error["code"] == "tenant_limit_exceeded" and error["param"] == "max_tokens"
    assert "the budget of tenant 'small' (300 tokens per minute)" in error["message"]


def test_the_offline_llm_samples_with_the_defaults_when_given_no_params(model_dir):
    from loraplex import LLM, SamplingParams

    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
              override_generation_config={"max_new_tokens": 3, "temperature": 0.0})  # fmt: skip
    try:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3, temperature=0.0)
        (out,) = llm.generate("Once upon a time")
        assert len(out.outputs[0].token_ids) == 3
        (explicit,) = llm.generate("Once upon a time", SamplingParams(max_tokens=5, temperature=0))
        assert len(explicit.outputs[0].token_ids) == 5
    finally:
        llm.shutdown()
