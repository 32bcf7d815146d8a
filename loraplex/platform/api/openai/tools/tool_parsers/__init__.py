"""Tool-call parsers by vLLM's `--tool-call-parser` names, and the one a chat template implies.

`hermes` (also `qwen`, whose templates write Hermes-style calls), `llama3_json` and `mistral`.
A template that shows no tool format gets `hermes`, the documented default.
"""

from __future__ import annotations

from loraplex.platform.api.openai.tools.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
)
from loraplex.platform.api.openai.tools.tool_parsers.hermes import HermesToolParser
from loraplex.platform.api.openai.tools.tool_parsers.llama3_json import Llama3JsonToolParser
from loraplex.platform.api.openai.tools.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
DEFAULT_TOOL_PARSER = "hermes"

# What in a chat template's source shows its call format, checked in this order.
_TEMPLATE_SIGNS = (("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ("<tool_call>", "hermes"))  # fmt: skip


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the choices otherwise."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The parser whose call format `chat_template` writes (`hermes` if it shows none)."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return get_tool_parser(name)
    return get_tool_parser(DEFAULT_TOOL_PARSER)


__all__ = [
    "DEFAULT_TOOL_PARSER",
    "TOOL_PARSERS",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolParser",
    "get_tool_parser",
    "parser_for_template",
]
