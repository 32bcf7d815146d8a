"""Schemas outlines-core would silently mis-compile are refused by name or rewritten."""

from __future__ import annotations

import json

import pytest

from loraplex.grammar.errors import GrammarCompileError, UnsupportedSchemaError
from loraplex.grammar.schema_analysis import analyse_schema


@pytest.mark.parametrize(
    ("schema", "feature"),
    [
        ({"type": "integer", "multipleOf": 5}, "multipleOf"),
        ({"type": "number", "minimum": 0.5}, "minimum"),
        ({"type": "string", "format": "ipv6"}, "format: ipv6"),
        (
            {"type": "string", "pattern": "^a", "maxLength": 5},
            "pattern with format/minLength/maxLength",
        ),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "string"}, "then": {"minLength": 1}}, "if"),
        ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
        ({"type": "object", "properties": {"a": {}}, "minProperties": 1}, "minProperties"),
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
            "required property not in properties",
        ),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        (
            {
                "oneOf": [
                    {"type": "object", "properties": {"a": {"type": "integer"}}},
                    {"type": "object", "properties": {"b": {"type": "integer"}}},
                ]
            },
            "oneOf",
        ),
        ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "allOf"),
        ({"$ref": "https://example.com/schema.json"}, "$ref"),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 1},
            "prefixItems with minItems/maxItems",
        ),
        ({"type": "object", "properties": {"deep": {"type": "array", "contains": {}}}}, "contains"),
    ],
)
def test_unenforceable_keywords_are_refused_by_name(schema, feature) -> None:
    with pytest.raises(UnsupportedSchemaError) as caught:
        analyse_schema(schema)
    assert caught.value.feature == feature
    assert feature in str(caught.value)


def test_invalid_schema_is_a_compile_error() -> None:
    with pytest.raises(GrammarCompileError, match="invalid JSON schema"):
        analyse_schema({"type": "no-such-type"})


def test_bounds_patterns_and_formats_become_substitutions() -> None:
    analysed = analyse_schema(
        {
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 1, "maximum": 3},
                "s": {"type": "string", "pattern": "^ab"},
                "d": {"type": "string", "format": "date"},
            },
            "required": ["n", "s", "d"],
        }
    )
    assert len(analysed.substitutions) == 3
    text = json.dumps(analysed.schema)
    for placeholder in analysed.substitutions:
        assert placeholder in text
    assert "minimum" not in text and "pattern" not in text


def test_annotations_and_plain_keywords_pass_through() -> None:
    schema = {
        "title": "T",
        "description": "d",
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3, "default": "x"}},
        "required": ["a"],
    }
    assert analyse_schema(schema).schema == schema
    assert analyse_schema(schema).substitutions == {}


def test_exclusive_oneof_becomes_anyof() -> None:
    analysed = analyse_schema({"oneOf": [{"type": "string"}, {"type": "null"}]})
    assert "anyOf" in analysed.schema and "oneOf" not in analysed.schema


def test_allof_of_objects_is_merged() -> None:
    analysed = analyse_schema(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "boolean"}}, "required": ["b"]},
            ]
        }
    )
    assert set(analysed.schema["properties"]) == {"a", "b"}
    assert analysed.schema["required"] == ["a", "b"]


def test_defs_are_rewritten_where_refs_resolve() -> None:
    analysed = analyse_schema(
        {
            "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "type": "array",
            "items": {"$ref": "#/$defs/n"},
        }
    )
    assert analysed.schema["items"] == {"$ref": "#/$defs/n"}
    assert "const" in analysed.schema["$defs"]["n"]


def test_type_list_splits_into_branches_and_keeps_defs() -> None:
    analysed = analyse_schema(
        {
            "type": ["integer", "null"],
            "minimum": 3,
            "$defs": {"unused": {"type": "string"}},
        }
    )
    assert "$defs" in analysed.schema
    branches = analysed.schema["anyOf"]
    assert {"type": "null", "minimum": 3} in branches
    assert any("const" in b for b in branches)  # the bounded integer became a substitution


def test_anyof_with_sibling_constraints_is_refused() -> None:
    with pytest.raises(UnsupportedSchemaError) as caught:
        analyse_schema({"anyOf": [{"type": "string"}], "maxLength": 3})
    assert caught.value.feature == "anyOf with sibling keywords"


def test_unknown_keywords_are_annotations_and_pass_through() -> None:
    # Keywords no draft defines (`x-...`, `markdownDescription`, editor hints in SchemaStore
    # files) constrain nothing, as every validator ignores them; refusing them refused
    # real-world schemas for no reason. Keywords that do constrain are still refused by name.
    schema = {
        "type": "string",
        "x-intellij-html-description": "<b>name</b>",
        "markdownDescription": "*name*",
        "maxLength": 3,
    }
    assert analyse_schema(schema).schema == {"type": "string", "maxLength": 3}
    only_annotations = {"type": "object", "properties": {"a": {"markdownDescription": "any"}}}
    assert analyse_schema(only_annotations).schema["properties"]["a"] == {}
    with pytest.raises(UnsupportedSchemaError, match="dependentRequired"):
        analyse_schema({"type": "object", "dependentRequired": {"a": ["b"]}})
