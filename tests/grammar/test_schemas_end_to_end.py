"""Over forty schemas: every output a grammar lets through parses and validates."""

from __future__ import annotations

import json
from datetime import date, datetime, time

import pytest
from grammar_schemas import SCHEMAS
from jsonschema import Draft202012Validator

from loraplex.platform.core.structured_outputs import StructuredOutputs

_WALKS_PER_SCHEMA = 4
_STRICT_FORMATS = {
    "date": date.fromisoformat,
    "time": time.fromisoformat,
    "date-time": datetime.fromisoformat,
}


def _check_formats(schema: dict, value: object) -> None:
    """Formats jsonschema only checks with optional packages, checked with the stdlib."""
    fmt = schema.get("format")
    if fmt in _STRICT_FORMATS and isinstance(value, str):
        _STRICT_FORMATS[fmt](value)


def test_there_are_at_least_forty_schemas() -> None:
    assert len(SCHEMAS) >= 40


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_completed_output_validates(name, compiler, tokenizer, random_walk) -> None:
    schema = SCHEMAS[name]
    grammar = compiler.compile(StructuredOutputs(json=schema))
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    for seed in range(_WALKS_PER_SCHEMA):
        tokens = random_walk(grammar, seed)
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        value = json.loads(text)
        errors = [e.message for e in validator.iter_errors(value)]
        assert not errors, f"{name}: {text!r} -> {errors}"
        _check_formats(schema, value)


def test_second_request_with_a_schema_does_no_compile_work(compiler) -> None:
    outputs = StructuredOutputs(
        json={
            "type": "object",
            "properties": {"q": {"type": "integer"}},
            "required": ["q"],
            "title": "second-request",
        }
    )
    first = compiler.compile(outputs)
    compiles = compiler.num_compiles
    future = compiler.submit(StructuredOutputs(json=dict(outputs.json)))
    assert future.done()
    assert future.result() is first
    assert compiler.num_compiles == compiles
