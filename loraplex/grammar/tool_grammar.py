"""JSON schemas that enforce tool calls, built from the functions' parameter schemas.

Tool calls are constrained through the ordinary JSON-schema path (`StructuredOutputs(json=...)`),
so they get the same compile cache, limits and refusals (a 400 naming the feature) as
`response_format`. Shapes, as vLLM generates them:

- a named function: the output is the arguments object itself (`function_schema`);
- `tool_choice: "required"`: a JSON array of `{"name": <one of the tools>, "arguments": {...}}`,
  at least one item, at most one without parallel calls (`required_calls_schema`).

A function's `$defs` / `definitions` move to the root under `<function>.<name>`, and its local
`$ref`s follow them, so functions with equal definition names do not collide.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFunction:
    """One function a request offers the model: its name and JSON-schema parameters."""

    name: str
    parameters: dict[str, Any]

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tool function needs a name")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"the parameters of {self.name!r} must be a JSON-schema object")


def function_schema(function: ToolFunction) -> dict[str, Any]:
    """The schema of `function`'s arguments (an empty object schema when it takes none)."""
    return copy.deepcopy(function.parameters or _EMPTY_PARAMETERS)


def required_calls_schema(functions: list[ToolFunction], parallel: bool) -> dict[str, Any]:
    """An array of one or more calls `{"name", "arguments"}` to any of `functions` (exactly one
    when not `parallel`)."""
    if not functions:
        raise ValueError("required tool calls need at least one function")
    defs: dict[str, Any] = {}
    branches = [_call_schema(f, defs) for f in functions]
    items = branches[0] if len(branches) == 1 else {"anyOf": branches}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _call_schema(function: ToolFunction, defs: dict[str, Any]) -> dict[str, Any]:
    parameters = function_schema(function)
    local: dict[str, Any] = {}
    for key in ("$defs", "definitions"):
        for name, definition in (parameters.pop(key, None) or {}).items():
            local[f"#/{key}/{name}"] = (f"{function.name}.{name}", definition)
    if local:
        renames = {old: f"#/$defs/{new}" for old, (new, _) in local.items()}
        parameters = _rename_refs(parameters, renames)
        for new, definition in local.values():
            defs[new] = _rename_refs(definition, renames)
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
    }


def _rename_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        return {
            key: renames.get(value, value)
            if key == "$ref" and isinstance(value, str)
            else _rename_refs(value, renames)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_rename_refs(item, renames) for item in node]
    return node
