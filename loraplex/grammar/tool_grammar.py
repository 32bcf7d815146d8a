"""JSON schemas that enforce tool calls, built from the functions' parameter schemas.

Tool calls are constrained through the ordinary JSON-schema path (`StructuredOutputs(json=...)`),
so they get the same compile cache, limits and refusals (a 400 naming the feature) as
`response_format`. Shapes, as vLLM generates them:

- a named function: the output is the arguments object itself (`function_schema`);
- `tool_choice: "required"`: a JSON array of `{"name": <one of the tools>, "arguments": {...}}`,
  at least one item, at most one without parallel calls (`required_calls_schema`);
- one call object in a template's own format, once `auto` generation has opened a call
  (`call_object_schema`, e.g. `{"name", "parameters"}` for Llama 3).

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
    items, defs = _calls(functions, "arguments")
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def call_object_schema(
    functions: list[ToolFunction], arguments_key: str = "arguments"
) -> dict[str, Any]:
    """One call `{"name", <arguments_key>}` to any of `functions`."""
    schema, defs = _calls(functions, arguments_key)
    return {**schema, "$defs": defs} if defs else schema


def _calls(functions: list[ToolFunction], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the schema of one call to any of `functions`, the definitions it refers to)."""
    if not functions:
        raise ValueError("tool calls need at least one function")
    defs: dict[str, Any] = {}
    branches = [_call_schema(f, defs, key) for f in functions]
    return (branches[0] if len(branches) == 1 else {"anyOf": branches}), defs


def _call_schema(function: ToolFunction, defs: dict[str, Any], key: str) -> dict[str, Any]:
    parameters = function_schema(function)
    local: dict[str, Any] = {}
    for section in ("$defs", "definitions"):
        for name, definition in (parameters.pop(section, None) or {}).items():
            local[f"#/{section}/{name}"] = (f"{function.name}.{name}", definition)
    if local:
        renames = {old: f"#/$defs/{new}" for old, (new, _) in local.items()}
        parameters = _rename_refs(parameters, renames)
        for new, definition in local.values():
            defs[new] = _rename_refs(definition, renames)
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, key: parameters},
        "required": ["name", key],
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
