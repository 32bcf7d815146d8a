"""Tool-call grammars: built from the functions' parameter schemas on the JSON-schema path, so
every output a `required` or named grammar lets through is calls that parse and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from loraplex.grammar.tool_grammar import ToolFunction, function_schema, required_calls_schema
from loraplex.platform.core.structured_outputs import StructuredOutputs
from tests.platform.api.tool_schemas import TOOLS

FUNCTIONS = [
    ToolFunction(t["function"]["name"], t["function"].get("parameters") or {}) for t in TOOLS
]
BY_NAME = {f.name: function_schema(f) for f in FUNCTIONS}


def test_definitions_move_to_the_root_under_the_function_name():
    a = ToolFunction(
        "a", {"$defs": {"x": {"type": "integer"}}, "properties": {"v": {"$ref": "#/$defs/x"}}}
    )
    b = ToolFunction(
        "b", {"$defs": {"x": {"type": "string"}}, "properties": {"v": {"$ref": "#/$defs/x"}}}
    )
    schema = required_calls_schema([a, b], parallel=False)
    assert set(schema["$defs"]) == {"a.x", "b.x"} and schema["maxItems"] == 1
    jsonschema.validate([{"name": "a", "arguments": {"v": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "b", "arguments": {"v": 1}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], schema)  # at least one call
    assert function_schema(ToolFunction("none", {})) == {"type": "object", "properties": {}}
    with pytest.raises(ValueError):
        required_calls_schema([], parallel=True)


def test_every_required_output_over_twenty_tools_is_valid_calls(compiler, tokenizer, random_walk):
    schema = required_calls_schema(FUNCTIONS, parallel=True)
    grammar = compiler.compile(StructuredOutputs(json=schema))
    names = set()
    for seed in range(12):
        text = tokenizer.decode(random_walk(grammar, seed), skip_special_tokens=False)
        calls = json.loads(text.split("<|im_end|>")[0].split("<|endoftext|>")[0])
        assert calls, text
        for call in calls:
            jsonschema.validate(call["arguments"], BY_NAME[call["name"]])
            names.add(call["name"])
    assert len(names) > 1  # the walk reaches different functions


@pytest.mark.parametrize("function", FUNCTIONS[::4], ids=lambda f: f.name)
def test_named_function_outputs_validate(function, compiler, tokenizer, random_walk):
    grammar = compiler.compile(StructuredOutputs(json=function_schema(function)))
    for seed in range(3):
        text = tokenizer.decode(random_walk(grammar, seed), skip_special_tokens=False)
        value = json.loads(text.split("<|im_end|>")[0].split("<|endoftext|>")[0])
        jsonschema.validate(value, BY_NAME[function.name])
