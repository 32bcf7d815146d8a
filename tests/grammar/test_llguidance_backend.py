"""The second backend: schemas outlines-core cannot enforce exactly go to llguidance, are
served, and validate; schemas neither enforces are refused naming the feature."""

from __future__ import annotations

import json

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from loraplex.grammar.errors import UnsupportedSchemaError
from loraplex.platform.core.structured_outputs import StructuredOutputs

pytest.importorskip("llguidance", reason="the llguidance backend needs the llguidance package")

# Each refused by our outlines-core analysis (the feature named), each enforced by llguidance.
LLGUIDANCE_ONLY = {
    "multipleOf": {"type": "integer", "minimum": 0, "maximum": 90, "multipleOf": 7},
    "patternProperties": {
        "type": "object",
        "patternProperties": {"^x_[a-z]+$": {"type": "integer"}},
        "additionalProperties": False,
    },
    "format ipv6": {"type": "string", "format": "ipv6"},
    "minProperties": {"type": "object", "additionalProperties": {"type": "integer"},
                      "minProperties": 2, "maxProperties": 3},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LLGUIDANCE_ONLY))
def test_schemas_outlines_refuses_are_served_by_llguidance_and_validate(
    name, compiler, random_walk, tokenizer
) -> None:
    schema = LLGUIDANCE_ONLY[name]
    grammar = compiler.compile(StructuredOutputs(json=schema), timeout=120)
    assert grammar.backend == "llguidance"
    validator = Draft202012Validator(schema)
    for seed in range(3):
        text = tokenizer.decode(random_walk(grammar, seed))
        errors = [e.message for e in validator.iter_errors(json.loads(text))]
        assert not errors, (text, errors)


def test_schemas_outlines_enforces_stay_on_outlines(compiler) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert compiler.compile(StructuredOutputs(json=schema), timeout=120).backend == "outlines"


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "integer", "not": {"const": 3}}, "not"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ],
)
def test_schemas_neither_enforces_are_refused_naming_the_feature(compiler, schema, feature):
    with pytest.raises(UnsupportedSchemaError) as caught:
        compiler.compile(StructuredOutputs(json=schema), timeout=120)
    assert caught.value.feature == feature
    assert "llguidance" in str(caught.value)  # why the second backend refused too


def test_llguidance_matcher_forbids_what_its_mask_forbids(compiler, tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputs(json=LLGUIDANCE_ONLY["multipleOf"]), timeout=120)
    matcher = grammar.new_matcher()
    row = np.zeros((2, grammar.num_words + 2), dtype=np.int32)
    matcher.fill_bitmask(row, 1)
    assert not row[0].any() and not row[1, grammar.num_words :].any()
    allowed = set(np.flatnonzero(np.unpackbits(row[1].view(np.uint8), bitorder="little")))
    seven = tokenizer.token_to_id("7")
    assert seven in allowed and tokenizer.token_to_id("a") not in allowed
    assert not matcher.accept_token(tokenizer.token_to_id("a"))
    assert matcher.accept_token(seven) and matcher.is_final()
    stop = grammar.stop_token_ids[0]
    assert matcher.accept_token(stop) and matcher.is_terminated() and matcher.must_stop()
    assert matcher.mask_row() is None  # llguidance masks are computed each step, never reused


def test_json_backends_choose_the_order_and_the_set(vocabulary, tmp_path) -> None:
    from loraplex.grammar.compiler import GrammarCompiler
    from loraplex.grammar.config import GrammarConfig

    plain = StructuredOutputs(json={"type": "object", "properties": {"n": {"type": "integer"}}})
    llguidance_first = GrammarCompiler(
        vocabulary, GrammarConfig(json_backends=("llguidance",), cache_dir=tmp_path / "a")
    )
    outlines_only = GrammarCompiler(
        vocabulary, GrammarConfig(json_backends=("outlines",), cache_dir=tmp_path / "b")
    )
    try:
        assert llguidance_first.compile(plain, timeout=120).backend == "llguidance"
        with pytest.raises(UnsupportedSchemaError) as caught:
            outlines_only.compile(
                StructuredOutputs(json=LLGUIDANCE_ONLY["multipleOf"]), timeout=120
            )
        assert caught.value.feature == "multipleOf"
    finally:
        llguidance_first.shutdown()
        outlines_only.shutdown()
    with pytest.raises(ValueError, match="json_backends"):
        GrammarConfig(json_backends=("xgrammar",))
