"""StructuredOutputs: exactly one constraint, a stable cache key."""

from __future__ import annotations

import pytest

from loraplex import grammar
from loraplex.platform.core.structured_outputs import StructuredOutputs


def test_exactly_one_field_must_be_set() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(json={"type": "string"}, json_object=True)


def test_bad_values_are_rejected() -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{not json")
    with pytest.raises(ValueError, match="must be an object"):
        StructuredOutputs(json="[1, 2]")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputs(choice=["a", ""])


def test_json_text_and_dict_give_the_same_key() -> None:
    as_dict = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    as_text = StructuredOutputs(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    assert as_dict.key() == as_text.key()
    assert as_dict.kind == "json"


def test_keys_differ_across_kinds_and_specs() -> None:
    keys = {
        StructuredOutputs(regex="a|b").key(),
        StructuredOutputs(choice=["a", "b"]).key(),
        StructuredOutputs(choice=["b", "a"]).key(),
        StructuredOutputs(json_object=True).key(),
        StructuredOutputs(json={"type": "string"}).key(),
    }
    assert len(keys) == 5


def test_importable_from_the_grammar_package() -> None:
    assert grammar.StructuredOutputs is StructuredOutputs
    assert issubclass(grammar.UnsupportedSchemaError, ValueError)
