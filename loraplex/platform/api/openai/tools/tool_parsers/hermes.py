"""Hermes-style calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`): Hermes,
Qwen2.5 / Qwen3, and loraplex's default for templates without tool support."""

from __future__ import annotations

import json
import re

from loraplex.platform.api.openai.tools.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    call_from_object,
    decode_json_values,
)

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    call_prefix = "\n"
    call_suffix = "\n</tool_call>"

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.marker)
        if start < 0:
            return ParsedOutput(text)
        calls: list[ParsedToolCall] = []
        for match in _CALL.finditer(text, start):
            values = decode_json_values(match.group(1))
            if values is None or len(values) != 1:
                return ParsedOutput(text)
            call = call_from_object(values[0], ("arguments", "parameters"))
            if call is None:
                return ParsedOutput(text)
            calls.append(call)
        return ParsedOutput(text[:start].rstrip(), tuple(calls))

    def render_calls(self, calls: list[ParsedToolCall]) -> str:
        return "\n".join(
            f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n'
            "</tool_call>"
            for c in calls
        )
