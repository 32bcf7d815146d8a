"""Mistral calls: `[TOOL_CALLS]` followed by a JSON array of `{"name", "arguments"}`."""

from __future__ import annotations

import json
from typing import Any

from loraplex.grammar.tool_grammar import ToolFunction, required_calls_schema
from loraplex.platform.api.openai.tools.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    call_from_object,
    decode_json_values,
)


class MistralToolParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def call_schema(self, functions: list[ToolFunction], parallel: bool) -> dict[str, Any]:
        """Mistral writes its calls as one JSON array."""
        return required_calls_schema(functions, parallel)

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.marker)
        if at < 0:
            return ParsedOutput(text)
        values = decode_json_values(text[at + len(self.marker) :].strip())
        if not values:
            return ParsedOutput(text)
        items = [item for v in values for item in (v if isinstance(v, list) else [v])]
        calls = [call_from_object(item, ("arguments", "parameters")) for item in items]
        if not calls or any(c is None for c in calls):
            return ParsedOutput(text)
        return ParsedOutput(text[:at].rstrip(), tuple(c for c in calls if c is not None))

    def render_calls(self, calls: list[ParsedToolCall]) -> str:
        items = ", ".join(
            f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls
        )
        return f"{self.marker}[{items}]"
