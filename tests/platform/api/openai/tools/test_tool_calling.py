"""Chat tool calling through the `openai` SDK against the live server on the embedded model:
forced calls (`required`, a named function) always parse and validate against their schemas,
stream as OpenAI streams them, and feed a second turn; `auto` puts text and calls in the
right fields."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.platform.api.tool_schemas import TOOLS

SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {} for t in TOOLS}
ASK = [{"role": "user", "content": "Use a tool to help me plan my day."}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


def _valid(name: str, arguments: str) -> dict:
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def _named(client, server, tool: dict, **kwargs):
    name = tool["function"]["name"]
    return client.chat.completions.create(
        model=server.model, messages=ASK, tools=[tool], max_completion_tokens=48, seed=7,
        tool_choice={"type": "function", "function": {"name": name}}, **kwargs,
    )  # fmt: skip


def test_named_function_calls_validate_for_each_of_twenty_schemas(client, server):
    with ThreadPoolExecutor(len(TOOLS)) as pool:
        replies = list(pool.map(lambda t: _named(client, server, t), TOOLS))
    for tool, reply in zip(TOOLS, replies, strict=True):
        choice = reply.choices[0]
        name = tool["function"]["name"]
        assert choice.finish_reason == "tool_calls", (name, choice.message)
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == name
        _valid(name, call.function.arguments)
        assert choice.message.content is None


def _required(client, server, tools, **kwargs):
    return client.chat.completions.create(
        model=server.model, messages=ASK, tools=tools, tool_choice="required",
        parallel_tool_calls=False, max_completion_tokens=64, seed=3, **kwargs,
    )  # fmt: skip


def test_required_calls_validate_over_all_twenty_schemas(client, server):
    groups = [TOOLS[i : i + 3] for i in range(0, len(TOOLS), 3)]
    with ThreadPoolExecutor(7) as pool:
        replies = list(pool.map(lambda g: _required(client, server, g), groups))
    for group, reply in zip(groups, replies, strict=True):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls  # parallel_tool_calls=False: exactly one
        assert call.function.name in {t["function"]["name"] for t in group}
        _valid(call.function.name, call.function.arguments)


def _streamed_calls(stream) -> tuple[list[tuple[str, str, str]], str | None, str]:
    """(id, name, arguments) per call index, the finish reason and any content."""
    calls: dict[int, list[str]] = {}
    finish, content = None, []
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:  # a call's first delta: id and name
                    assert delta.index not in calls and delta.function.name
                    calls[delta.index] = [delta.id, delta.function.name, ""]
                calls[delta.index][2] += delta.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish, "".join(content)


@pytest.mark.parametrize("kind", ["named", "required"])
def test_streamed_call_deltas_reassemble_to_the_whole_call(client, server, kind):
    if kind == "named":
        whole = _named(client, server, TOOLS[8])
        streamed = _streamed_calls(_named(client, server, TOOLS[8], stream=True))
    else:
        whole = _required(client, server, TOOLS[:3])
        streamed = _streamed_calls(_required(client, server, TOOLS[:3], stream=True))
    calls, finish, content = streamed
    message = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    assert all(i.startswith("call_") for i, _, _ in calls) and content == ""
    for _, name, arguments in calls:
        _valid(name, arguments)


def test_a_tool_result_turn_reaches_the_model(client, server):
    first = _named(client, server, TOOLS[0])
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message,  # the SDK's own message object, sent back as it is
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'},
    ]
    kwargs = dict(model=server.model, tools=[TOOLS[0]], tool_choice="none", seed=1)
    second = client.chat.completions.create(messages=history, max_completion_tokens=8, **kwargs)
    choice = second.choices[0]
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)
    # The call and its result are in the prompt: it outgrows the first turn's prompt by more
    # than the call's own tokens.
    alone = client.chat.completions.create(messages=ASK, max_completion_tokens=1, **kwargs)
    grown = second.usage.prompt_tokens - alone.usage.prompt_tokens
    assert grown > first.usage.completion_tokens + 5


def test_auto_without_a_call_answers_text(client, server):
    reply = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Say hello."}],
        tools=[TOOLS[1]], max_completion_tokens=8, temperature=0,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and "<tool_call>" not in choice.message.content


def test_auto_call_in_the_template_format_reaches_tool_calls(client, server):
    # NOTE: the embedded model is tiny; a few-shot history in the default (Hermes) format
    # makes it answer with a call deterministically at temperature 0.
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "Weather in Paris?"},
    ]  # fmt: skip
    kwargs = dict(model=server.model, messages=history, tools=[TOOLS[0]], temperature=0,
                  max_completion_tokens=40)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (made,) = choice.message.tool_calls
    assert made.function.name == "get_weather"
    _valid("get_weather", made.function.arguments)
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and content == (choice.message.content or "")
    assert [(n, a) for _, n, a in calls] == [("get_weather", made.function.arguments)]


def test_auto_call_is_enforced_once_the_model_opens_one(client, server):
    # The history shows get_weather calls; the request offers only transfer_funds, whose
    # account must match ^[A-Z]{2}[0-9]{4}$. Once the model writes <tool_call>, the grammar
    # holds it to a valid transfer_funds call.
    weather = {"id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": None, "tool_calls": [weather]},
        {"role": "user", "content": "Do it."},
        {"role": "assistant", "content": None, "tool_calls": [weather]},
        {"role": "user", "content": "Do it."},
    ]
    (transfer,) = [t for t in TOOLS if t["function"]["name"] == "transfer_funds"]
    reply = client.chat.completions.create(
        model=server.model, messages=history, tools=[transfer], temperature=0,
        parallel_tool_calls=False, max_completion_tokens=64,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "transfer_funds"
    _valid("transfer_funds", call.function.arguments)
