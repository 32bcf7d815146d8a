"""`ToolParser`: how one family of chat templates writes tool calls into the model's text.

A parser knows the marker that opens a call, how to split generated text into content and
calls, and how to write an earlier assistant turn's calls back into a prompt for templates that
cannot render `tool_calls` themselves.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from loraplex.grammar.tool_grammar import ToolFunction, call_object_schema


@dataclass(frozen=True)
class ParsedToolCall:
    """One call found in generated text: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """Generated text split into what the user reads and the calls it makes."""

    content: str
    tool_calls: tuple[ParsedToolCall, ...] = ()


def call_from_object(value: Any, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from a decoded `{"name": ..., "<arguments key>": {...}}`, or None if not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in arguments_keys:
        if key in value:
            arguments = value[key]
            if isinstance(arguments, str):  # some models write the arguments as JSON text
                try:
                    arguments = json.loads(arguments)
                except (ValueError, RecursionError):
                    return None
            if not isinstance(arguments, dict):
                return None
            return ParsedToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    return ParsedToolCall(value["name"], "{}")


def decode_json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace, `;` or `,`; None if any is not JSON."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):  # not JSON, or an integer of too many digits
            return None
        values.append(value)


class ToolParser(ABC):
    """Splits a model's output into content and tool calls, in one template family's format.

    Contract: `parse` never raises; text that does not hold well-formed calls is content.
    `marker` opens a call in the text (streaming holds content back while it may be starting).
    Under `auto`, once the model writes `marker`, `call_prefix` follows, then a JSON value of
    `call_schema` generated under its grammar, then `call_suffix`; `parse` reads that back.
    """

    name: str
    marker: str
    call_prefix: str = ""
    call_suffix: str = ""
    arguments_key: str = "arguments"

    def call_schema(self, functions: list[ToolFunction], parallel: bool) -> dict[str, Any]:
        """The JSON schema of what follows `marker` + `call_prefix`: one call by default."""
        return call_object_schema(functions, self.arguments_key)

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and the calls of a whole generated text."""

    @abstractmethod
    def render_calls(self, calls: list[ParsedToolCall]) -> str:
        """Earlier calls as the model would have written them (for templates without tools)."""

    def content_before_marker(self, text: str) -> tuple[str, bool]:
        """(content safe to stream, whether a call has started) of a partial text: a suffix
        that may be the beginning of the marker is held back."""
        at = text.find(self.marker)
        if at >= 0:
            return text[:at], True
        for keep in range(min(len(self.marker) - 1, len(text)), 0, -1):
            if self.marker.startswith(text[-keep:]):
                return text[:-keep], False
        return text, False
