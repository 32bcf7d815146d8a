"""Cold starts: a JSON schema seen for the first time gets an llguidance grammar in
milliseconds while outlines-core compiles, one that emits what outlines-core will (listed
properties only), so a request can start under it and hand over mid-output."""

from __future__ import annotations

import json

import pytest
from compile_gate import hold_outlines

from loraplex.grammar.compiler import GrammarCompiler
from loraplex.grammar.config import GrammarConfig
from loraplex.grammar.llguidance_compile import listed_properties_only
from loraplex.platform.core.structured_outputs import StructuredOutputs

pytest.importorskip("llguidance", reason="cold starts use the llguidance backend")

SCHEMA = {
    "type": "object",
    "properties": {"s": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
    "required": ["s"],
}


@pytest.fixture
def fresh(vocabulary, tmp_path):
    compiler = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=tmp_path))
    yield compiler
    compiler.shutdown()


def _accepts(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.new_matcher()
    return matcher.accept_tokens(tokenizer.encode(text).ids) and matcher.is_final()


def test_a_cold_schema_gets_an_llguidance_grammar_before_outlines_finishes(
    fresh, tokenizer, monkeypatch
):
    gate = hold_outlines(fresh, monkeypatch)
    spec = StructuredOutputs(json=SCHEMA)
    grammar = fresh.submit(spec)
    cold = fresh.submit_cold_start(spec)
    assert cold is not None
    cold_grammar = cold.result(timeout=30)
    assert cold_grammar.backend == "llguidance"
    assert not grammar.done()  # outlines-core is still building its automaton
    assert fresh.submit_cold_start(spec) is not None  # still cold: the same grammar again
    assert fresh.submit_cold_start(spec).result(timeout=5) is cold_grammar
    gate.set()
    exact = grammar.result(timeout=120)
    assert exact.backend == "outlines"
    # Both emit the listed properties only (the schema allows others: outlines-core never
    # emits them), so an output of one is an output of the other.
    for text in ('{"s": "hi", "n": 3}', '{"s":""}', '{"s": "a", "x": 1}', '{"n": 1}'):
        assert _accepts(cold_grammar, tokenizer, text) == _accepts(exact, tokenizer, text), text
    assert _accepts(exact, tokenizer, '{"s": "hi", "n": 3}')
    assert fresh.submit_cold_start(spec) is None  # compiled: no cold start any more


def test_no_cold_start_for_stored_grammars_regexes_or_when_turned_off(vocabulary, tmp_path):
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    spec = StructuredOutputs(json=schema)
    first = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=tmp_path))
    try:
        assert first.submit_cold_start(StructuredOutputs(regex="[a-z]+")) is None
        first.compile(spec, timeout=120)
    finally:
        first.shutdown()
    restarted = GrammarCompiler(vocabulary, GrammarConfig(cache_dir=tmp_path))
    try:
        assert restarted.submit_cold_start(spec) is None  # on disk: loads in milliseconds
    finally:
        restarted.shutdown()
    other = {**schema, "required": []}
    for config in (
        GrammarConfig(cache_dir=tmp_path, cold_start=False),
        GrammarConfig(cache_dir=tmp_path, json_backends=("llguidance",)),
        GrammarConfig(cache_dir=tmp_path, json_backends=("outlines",)),
    ):
        compiler = GrammarCompiler(vocabulary, config)
        try:
            assert compiler.submit_cold_start(StructuredOutputs(json=other)) is None, config
        finally:
            compiler.shutdown()


def test_the_cold_start_grammar_of_a_schema_outlines_refuses_is_its_llguidance_grammar(
    fresh, tokenizer
):
    # patternProperties: outlines-core refuses it, so its extra keys stay allowed.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
    }
    cold = fresh.submit_cold_start(StructuredOutputs(json=schema))
    assert cold is not None
    grammar = cold.result(timeout=30)
    assert _accepts(grammar, tokenizer, '{"a": 1, "x_b": 2}')


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}},
            {"type": "object", "properties": {"a": {"type": "integer"}},
             "additionalProperties": False},
        ),
        (  # a property named "properties" is a name, not a subschema
            {"properties": {"properties": {"type": "string"}}, "additionalProperties": True},
            {"properties": {"properties": {"type": "string"}}, "additionalProperties": False},
        ),
        (
            {"anyOf": [{"properties": {"b": {"properties": {}}}}, {"type": "null"}],
             "$defs": {"d": {"items": {"properties": {"c": {}}}}}},
            {"anyOf": [{"properties": {"b": {"properties": {}, "additionalProperties": False}},
                        "additionalProperties": False}, {"type": "null"}],
             "$defs": {"d": {"items": {"properties": {"c": {}}, "additionalProperties": False}}}},
        ),
        ({"type": "object", "additionalProperties": {"type": "integer"}},
         {"type": "object", "additionalProperties": {"type": "integer"}}),
    ],
)  # fmt: skip
def test_listed_properties_only(schema, expected) -> None:
    before = json.dumps(schema)
    assert listed_properties_only(schema) == expected
    assert json.dumps(schema) == before  # a copy: the caller's schema is unchanged
