"""A forced tool call (`tool_choice: "required"` or a named function) cut by the token limit is
reported as OpenAI reports a call cut short: a tool call holding the arguments written so far,
with finish_reason "length" (chat, streamed and not), and a function_call item with status
"incomplete" in the Responses API; never JSON-array text as content."""

from __future__ import annotations

import itertools

import openai
import pytest

from loraplex.grammar.tool_grammar import ToolFunction
from loraplex.platform.api.openai.tools.tool_call_stream import ToolCallStream
from loraplex.platform.api.openai.tools.tool_calls import ToolRequest, parse_output
from loraplex.platform.api.openai.tools.tool_parsers import ParsedToolCall, get_tool_parser
from tests.platform.api.tool_schemas import TOOLS

WEATHER = next(t for t in TOOLS if t["function"]["name"] == "get_weather")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = get_tool_parser("hermes")


def _request(*names: str, mode: str = "required") -> ToolRequest:
    functions = tuple(ToolFunction(name, {}) for name in names)
    return ToolRequest(mode, functions, (), names[0] if mode == "named" else None)


def _streamed(text: str, tools: ToolRequest, finish: str) -> list[ParsedToolCall]:
    ids = (f"call_{i}" for i in itertools.count())
    stream = ToolCallStream(tools.mode, HERMES, tools.named, lambda: next(ids), tools.names)
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish(finish)
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"]["arguments"]
    return [ParsedToolCall(name, arguments) for name, arguments in calls.values()]


@pytest.mark.parametrize(
    ("text", "names", "expected"),
    [
        ('[{ "name": "get', ("get_weather", "add_numbers"), [("get_weather", "")]),
        ('[{"name": "get_weather", "arguments": {"city": "Par', ("get_weather",),
         [("get_weather", '{"city": "Par')]),
        ('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x', ("a", "b"),
         [("a", "{}"), ("b", '{"x')]),
        ('[{ "name": "get', ("get_weather", "get_time"), []),  # which one is not decided yet
        ("[{", ("get_weather",), []),
    ],
)  # fmt: skip
def test_a_required_call_cut_short_is_a_call_with_its_arguments_so_far(text, names, expected):
    tools = _request(*names)
    parsed = parse_output(text, tools, HERMES, truncated=True)
    assert parsed.content == "" and list(parsed.tool_calls) == [
        ParsedToolCall(*c) for c in expected
    ]
    assert _streamed(text, tools, "length") == list(parsed.tool_calls)


def test_a_named_call_cut_short_keeps_its_partial_arguments():
    tools = _request("get_weather", mode="named")
    parsed = parse_output('{"city": "Pa', tools, HERMES, truncated=True)
    assert parsed.tool_calls == (ParsedToolCall("get_weather", '{"city": "Pa'),)
    assert _streamed('{"city": "Pa', tools, "length") == list(parsed.tool_calls)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_chat_reports_a_cut_call_as_a_call_streamed_or_not(client, server, tool_choice):
    kwargs = dict(model=server.model, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                  max_tokens=9, temperature=0)  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert not call.function.arguments.rstrip().endswith("}")  # cut short
    streamed: dict[str, str] = {"name": "", "arguments": ""}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for part in chunk.choices:
            finish = part.finish_reason or finish
            assert not part.delta.content
            for delta in part.delta.tool_calls or []:
                streamed["name"] += delta.function.name or ""
                streamed["arguments"] += delta.function.arguments or ""
    assert finish == "length"
    assert streamed == {"name": "get_weather", "arguments": call.function.arguments}


def test_responses_report_an_incomplete_function_call(client, server):
    tool = {"type": "function", **WEATHER["function"]}
    kwargs = dict(model=server.model, input="What is the weather in Paris?", tools=[tool],
                  tool_choice="required", max_output_tokens=9, temperature=0)  # fmt: skip
    response = client.responses.create(**kwargs)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.name == "get_weather"
    # NOTE: OpenAI ends an incomplete stream with `response.incomplete` (the SDK's
    # get_final_response waits for `response.completed` only)
    events = list(client.responses.create(**kwargs, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    (item,) = final.output
    assert (item.type, item.status, final.status) == ("function_call", "incomplete", "incomplete")
