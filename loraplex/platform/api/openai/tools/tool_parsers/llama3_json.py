"""Llama 3.1 / 3.2 JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`."""

from __future__ import annotations

import json

from loraplex.platform.api.openai.tools.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    call_from_object,
    decode_json_values,
)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    arguments_key = "parameters"

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.marker)
        content, body = (text[:at], text[at + len(self.marker) :]) if at >= 0 else ("", text)
        if at < 0 and not text.lstrip().startswith("{"):
            return ParsedOutput(text)
        values = decode_json_values(body.strip())
        if not values:
            return ParsedOutput(text)
        calls = [call_from_object(v, ("parameters", "arguments")) for v in values]
        if any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(content.rstrip(), tuple(c for c in calls if c is not None))

    def content_before_marker(self, text: str) -> tuple[str, bool]:
        # NOTE: Llama writes a call as bare JSON too: text that opens with `{` may be one.
        if text.lstrip().startswith("{"):
            return "", True
        return super().content_before_marker(text)

    def render_calls(self, calls: list[ParsedToolCall]) -> str:
        return "; ".join(
            f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls
        )
