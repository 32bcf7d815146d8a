"""The official `openai` SDK, sync and async, streaming and not, works against the server."""

from __future__ import annotations

import asyncio

import openai
import pytest

CHAT = [{"role": "user", "content": "Name a color of the sky."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text.append((delta.content or "") if delta is not None else choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_models_lists_the_served_model(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert server.model == "SmolLM2-135M-Instruct"


def test_chat_streamed_text_equals_whole_text_for_one_seed(client, server):
    kwargs = dict(model=server.model, messages=CHAT, max_completion_tokens=8, temperature=0.9,
                  seed=1234, top_p=0.95)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    streamed, finish, usage = _stream_text(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed
    # NOTE: whether the seed's text reaches EOS within 8 tokens depends on the sampler's
    # seed-to-noise mapping; both runs must agree either way.
    assert whole.choices[0].finish_reason == finish in ("length", "stop")
    assert whole.usage.completion_tokens == usage.completion_tokens <= 8
    assert finish == "stop" or usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == usage.prompt_tokens > 0


def test_completion_streamed_text_equals_whole_text_for_one_seed(client, server):
    kwargs = dict(model=server.model, prompt="The ocean is", max_tokens=8, temperature=1.0,
                  seed=99, presence_penalty=0.5, frequency_penalty=0.3)  # fmt: skip
    whole = client.completions.create(**kwargs)
    streamed, finish, _ = _stream_text(client.completions.create(**kwargs, stream=True))
    assert whole.choices[0].text == streamed
    assert whole.choices[0].finish_reason == finish


def test_async_client_streams_and_not(server):
    async def run() -> tuple[str, str, str, str]:
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="unused", max_retries=0)
        chat = dict(model=server.model, messages=CHAT, max_tokens=6, seed=5)
        whole = await client.chat.completions.create(**chat)
        parts = []
        async for chunk in await client.chat.completions.create(**chat, stream=True):
            parts.extend(c.delta.content or "" for c in chunk.choices)
        comp = dict(model=server.model, prompt="Once upon a time", max_tokens=6, seed=5)
        whole_c = await client.completions.create(**comp)
        parts_c = []
        async for chunk in await client.completions.create(**comp, stream=True):
            parts_c.extend(c.text for c in chunk.choices)
        await client.close()
        return (whole.choices[0].message.content, "".join(parts),
                whole_c.choices[0].text, "".join(parts_c))  # fmt: skip

    chat_whole, chat_streamed, comp_whole, comp_streamed = asyncio.run(run())
    assert chat_whole == chat_streamed and chat_whole
    assert comp_whole == comp_streamed and comp_whole


def test_n_samples_logprobs_and_stop(client, server):
    out = client.chat.completions.create(
        model=server.model, messages=CHAT, n=3, max_tokens=5, seed=7, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    for choice in out.choices:
        content = choice.logprobs.content
        assert len(content) == 5
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        assert "".join(t.token for t in content) == choice.message.content
    assert out.usage.completion_tokens == 15

    text = (
        client.completions.create(
            model=server.model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0
        )
        .choices[0]
        .text
    )
    stop = text.strip()[:2]
    stopped = client.completions.create(
        model=server.model, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop]
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stop not in stopped.text


def test_usage_reports_cached_prompt_tokens(client, server):
    prompt = "A long shared preamble about gardening, soil, seeds and water. " * 6
    first = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=server.model, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens >= 48
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


def test_sdk_raises_typed_errors(client, server):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=server.model, prompt="hi", temperature=3.5)
    assert bad.value.body["param"] == "temperature"
