"""Objects come out with their keys in the order the schema lists its properties, as OpenAI's
structured outputs (and vLLM) generate them; the cache key ignores the order of other keys."""

from __future__ import annotations

import json

from loraplex.platform.core.structured_outputs import StructuredOutputs, canonical_schema


def _schema(*names: str, required_first: bool = True) -> dict:
    properties = {name: {"type": "integer" if name == "age" else "string"} for name in names}
    if required_first:
        return {"required": list(names), "type": "object", "properties": properties}
    return {"type": "object", "properties": properties, "required": list(names)}


def test_generated_keys_follow_the_schema_order(compiler, random_walk, tokenizer) -> None:
    for names in (("name", "age"), ("age", "name"), ("zeta", "alpha", "mid")):
        grammar = compiler.compile(StructuredOutputs(json=_schema(*names)))
        for seed in range(3):
            text = tokenizer.decode(random_walk(grammar, seed))
            assert list(json.loads(text)) == list(names), text


def test_property_order_changes_the_key_other_key_order_does_not() -> None:
    name_first = StructuredOutputs(json=_schema("name", "age"))
    age_first = StructuredOutputs(json=_schema("age", "name"))
    reordered = StructuredOutputs(json=_schema("name", "age", required_first=False))
    assert name_first.key() != age_first.key()
    assert name_first.key() == reordered.key()


def test_canonical_schema_keeps_nested_property_order() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"b": {}, "a": {}}},
            "z": {"type": "string", "maxLength": 3},
        },
    }
    canonical = canonical_schema(schema)
    assert list(canonical["properties"]) == ["properties", "z"]
    assert list(canonical["properties"]["properties"]["properties"]) == ["b", "a"]
    assert list(canonical["properties"]["z"]) == ["maxLength", "type"]
