"""Tool-call parsers on the strings real models write, the parser a chat template implies, and
streamed deltas that join to the whole parse."""

from __future__ import annotations

import json

import pytest

from loraplex.platform.api.openai.tools.tool_call_stream import ToolCallStream, scan_required
from loraplex.platform.api.openai.tools.tool_calls import required_calls
from loraplex.platform.api.openai.tools.tool_parsers import (
    ParsedToolCall,
    get_tool_parser,
    parser_for_template,
)

WEATHER = ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedToolCall("get_time", "{}")

# (parser, model output, expected content, expected calls)
CASES = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
     '"Paris", "unit": "celsius"}}\n</tool_call>', "Let me check.", [WEATHER]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
     "</tool_call>", "", [WEATHER, TIME]),
    ("qwen", '<tool_call>\n{"name": "get_time", "arguments": "{}"}\n</tool_call>', "", [TIME]),
    ("hermes", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\"", None, []),
    ("hermes", "Use <b>bold</b> text.", "Use <b>bold</b> text.", []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "celsius"}}; {"name": "get_time", "parameters": {}}', "", [WEATHER, TIME]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}', "", [WEATHER]),
    ("llama3_json", '{"not": "a call"}', None, []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"celsius"}}, {"name": "get_time", "arguments": {}}]', "", [WEATHER, TIME]),
    ("mistral", "[TOOL_CALLS] not json", None, []),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parsers_read_real_formats_and_leave_the_rest_as_content(name, text, content, calls):
    parsed = get_tool_parser(name).parse(text)
    assert parsed.content == (text if content is None else content)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]


def test_render_calls_parses_back():
    for name in ("hermes", "llama3_json", "mistral"):
        parser = get_tool_parser(name)
        assert list(parser.parse(parser.render_calls([WEATHER, TIME])).tool_calls) == [
            WEATHER,
            TIME,
        ]


def test_the_template_picks_the_parser():
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template(None).name == "hermes"  # the documented default
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_tool_parser("pythonic")


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def _run(stream: ToolCallStream, text: str) -> tuple[str, list[tuple[str, str]]]:
    deltas = [d for piece in _pieces(text) for d in stream.feed(piece)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            if "id" in call:
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _ids():
    counter = iter(range(100))
    return lambda: f"call_{next(counter)}"


def test_auto_stream_holds_back_the_marker_and_joins_to_the_parse():
    parser = get_tool_parser("hermes")
    text = CASES[0][1]
    content, calls = _run(ToolCallStream("auto", parser, None, _ids()), text)
    parsed = parser.parse(text)
    assert content == parsed.content == "Let me check."
    assert calls == [(c.name, c.arguments) for c in parsed.tool_calls]
    plain = "Use <b>bold</b> text.\n"
    assert _run(ToolCallStream("auto", parser, None, _ids()), plain) == (plain, [])


def test_required_stream_sends_arguments_as_written_in_any_key_order():
    text = ('[{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}, '
            '{"arguments": {"name": "not the name"}, "name": "g"}]')  # fmt: skip
    content, calls = _run(ToolCallStream("required", get_tool_parser("hermes"), None, _ids()), text)
    whole = required_calls(text)
    assert content == "" and whole is not None
    assert calls == [(c.name, c.arguments) for c in whole]
    assert calls == [("f", '{"a": [1, {"b": "}"}]}'), ("g", '{"name": "not the name"}')]
    assert required_calls(text[:-1]) is None  # cut short: not calls
    assert scan_required(text[:20])[1] is False


def test_named_stream_sends_the_name_first_then_the_arguments():
    stream = ToolCallStream("named", get_tool_parser("hermes"), "get_time", _ids())
    first = stream.feed("")
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": ""}
    again = ToolCallStream("named", get_tool_parser("hermes"), "get_time", _ids())
    assert _run(again, '{"x": 1}') == ("", [("get_time", '{"x": 1}')])


def test_tool_call_parser_option_is_checked_when_the_server_is_configured():
    from loraplex.cli import build_parser
    from loraplex.entrypoints.serve_cli import resolve_options
    from loraplex.platform.api.settings import ServerSettings

    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json"])
    assert resolve_options(args)["tool_call_parser"] == "llama3_json"
    assert ServerSettings(tool_call_parser="llama3_json").tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerSettings(tool_call_parser="pythonic")
