"""Chat tool calling: what `tools` / `tool_choice` ask for, how the conversation reaches the chat
template, and how a choice's generated text becomes OpenAI's `message.tool_calls`.

Modes, as OpenAI names them:
- `"none"`: plain text; the tools are not shown to the model.
- `"auto"` (the default with tools): the model chooses; text in the template's call format
  (see `tool_parsers`) is parsed into calls, anything else is content.
- `"required"` / a named function: the whole output is generated under a grammar built from the
  tools' parameter schemas (`grammar.tool_grammar`), so every call parses and validates.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from loraplex.grammar.tool_grammar import ToolFunction, function_schema, required_calls_schema
from loraplex.platform.api.errors import bad_request
from loraplex.platform.api.openai.protocol import ChatCompletionRequest, ChatMessage
from loraplex.platform.api.openai.tools.tool_call_stream import complete_name, scan_required
from loraplex.platform.api.openai.tools.tool_parsers import ParsedOutput, ParsedToolCall, ToolParser
from loraplex.platform.core.structured_outputs import StructuredOutputs

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_MODES = ("none", "auto", "required")

# NOTE: for templates without tool support (the embedded model's), loraplex's documented
# default: the tools in Hermes' system-prompt wording, calls as `<tool_call>` JSON.
_TOOLS_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions are "
    "described in JSON inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request's tools ask of the generation."""

    mode: str  # "none", "auto", "required" or "named"
    functions: tuple[ToolFunction, ...]
    tools: tuple[dict[str, Any], ...]  # as the client sent them (for templates with tools)
    named: str | None = None  # the function `tool_choice` names
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.functions)

    @property
    def shown(self) -> bool:
        """Whether the tools are rendered into the prompt."""
        return self.mode != "none"

    def structured_outputs(self) -> StructuredOutputs | None:
        """The grammar of the whole output (`required` / named), else None."""
        if self.mode == "required":
            return StructuredOutputs(
                json=required_calls_schema(list(self.functions), self.parallel)
            )
        if self.mode == "named":
            function = next(f for f in self.functions if f.name == self.named)
            return StructuredOutputs(json=function_schema(function))
        return None


def tool_request_for(body: ChatCompletionRequest) -> ToolRequest | None:
    """The request's tool calling, or None without tools; APIError (400) on a bad spec."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return None
    functions = tuple(_function(tool, i) for i, tool in enumerate(body.tools))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise bad_request("tool function names must be unique", param="tools")
    mode, named = _choice(body.tool_choice, names)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ToolRequest(mode, functions, tuple(body.tools), named, parallel)


def _function(tool: Any, index: int) -> ToolFunction:
    param = f"tools.{index}"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request("only tools of type 'function' are supported", param=f"{param}.type")
    spec = tool.get("function")
    if not isinstance(spec, dict):
        raise bad_request("a function tool needs a 'function' object", param=f"{param}.function")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(
            "a function name must be 1-64 letters, digits, '_' or '-'",
            param=f"{param}.function.name",
        )
    parameters = spec.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(
            "function parameters must be a JSON-schema object",
            param=f"{param}.function.parameters",
        )
    return ToolFunction(name, parameters or {})


def _choice(choice: str | dict[str, Any] | None, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if isinstance(choice, str):
        if choice not in _MODES:
            raise bad_request(
                f"tool_choice must be one of {list(_MODES)} or a named function, got {choice!r}",
                param="tool_choice",
            )
        return choice, None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
    return "named", name


# -- the conversation into the template --------------------------------------------------------


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether the template renders `tools` itself (it refers to them)."""
    return bool(chat_template) and "tools" in chat_template


def template_messages(
    messages: list[ChatMessage], tools: ToolRequest | None, parser: ToolParser, native: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. `native`: the template renders tools, calls and
    tool results itself; otherwise they are written in `parser`'s format (see module doc)."""
    shown = tools is not None and tools.shown
    if native:
        dicts = [_native_message(m) for m in messages]
        return dicts, list(tools.tools) if shown and tools is not None else None
    dicts = [_plain_message(m, parser) for m in messages]
    if shown and tools is not None:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools.tools)
        prompt = _TOOLS_PROMPT.format(tools=listing)
        if dicts and dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{prompt}"}
        else:
            dicts.insert(0, {"role": "system", "content": prompt})
    return dicts, None


def _calls_of(message: ChatMessage) -> list[ParsedToolCall]:
    return [ParsedToolCall(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _native_message(message: ChatMessage) -> dict[str, Any]:
    out = message.as_template_dict()
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments),
                },
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _arguments(text: str) -> Any:
    """Templates index arguments as a mapping; text that is not JSON passes as it is."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or an integer of too many digits
        return text


def _plain_message(message: ChatMessage, parser: ToolParser) -> dict[str, Any]:
    out = message.as_template_dict()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{out['content']}\n</tool_response>"}
    if message.tool_calls:
        calls = parser.render_calls(_calls_of(message))
        out["content"] = f"{out['content']}\n{calls}" if out["content"] else calls
    return out


# -- generated text into tool calls ------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(
    text: str, tools: ToolRequest, parser: ToolParser, truncated: bool = False
) -> ParsedOutput:
    """The content and calls of one choice's whole text under `tools`' mode. `truncated`: the
    token limit cut it (finish reason "length"): a forced call (`required`, named) is still a
    call, with the arguments written so far, as OpenAI reports a call cut short."""
    if truncated and tools.mode in ("named", "required"):
        return ParsedOutput("", truncated_calls(text, tools))
    if tools.mode == "named":
        assert tools.named is not None
        try:
            json.loads(text)
        except (ValueError, RecursionError):  # cut short (max_tokens): not a call
            return ParsedOutput(text)
        return ParsedOutput("", (ParsedToolCall(tools.named, text),))
    if tools.mode == "required":
        calls = required_calls(text)
        return ParsedOutput(text) if calls is None else ParsedOutput("", tuple(calls))
    if tools.mode == "auto":
        return parser.parse(text)
    return ParsedOutput(text)


def required_calls(text: str) -> list[ParsedToolCall] | None:
    """The calls of a `required` output (a JSON array of {"name", "arguments"}), with each
    call's arguments as the model wrote them; None if the text is not such an array."""
    calls, complete = scan_required(text)
    if not complete or any(c.arguments_end is None for c in calls):
        return None
    return [ParsedToolCall(c.name or "", text[c.arguments_start : c.arguments_end]) for c in calls]


def truncated_calls(text: str, tools: ToolRequest) -> tuple[ParsedToolCall, ...]:
    """The calls of a forced-call output cut short, each with its arguments as far as they
    were written ("" before they start); a call whose name the tools' names cannot complete
    yet is left out."""
    if tools.mode == "named":
        assert tools.named is not None
        return (ParsedToolCall(tools.named, text),)
    calls = []
    for scan in scan_required(text)[0]:
        name = scan.name
        if name is None and scan.partial_name is not None:
            name = complete_name(scan.partial_name, tools.names)
        if name is None:
            break
        start, end = scan.arguments_start, scan.arguments_end
        calls.append(ParsedToolCall(name, "" if start is None else text[start:end]))
    return tuple(calls)


def tool_calls_json(calls: tuple[ParsedToolCall, ...], ids: list[str]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls`."""
    return [
        {"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in zip(ids, calls, strict=True)
    ]
