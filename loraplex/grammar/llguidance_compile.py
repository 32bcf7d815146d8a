"""The llguidance backend's compile side, free of torch so the compile child can import it:
a JSON schema to llguidance grammar text, checked without a tokenizer, and its cache bytes.

llguidance (PyPI `llguidance`, used by vLLM and SGLang) enforces through a lazy Earley parser
what outlines-core's single automaton cannot express exactly (`multipleOf`, schema-valued
`additionalProperties`, `patternProperties`, more formats...). The compile child asks it for
the schemas our outlines-core analysis refuses; when it refuses too, it names the feature
(`Unimplemented keys: ["uniqueItems"]`). Its grammar text (llguidance's JSON) is stored in the
grammar cache behind `_MAGIC`, so it is told apart from an outlines-core index.
"""

from __future__ import annotations

import json
import re
from typing import Any

_MAGIC = b"\x00loraplex-llguidance-1\x00"


def llguidance_available() -> bool:
    """True when the `llguidance` package can be imported."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def llguidance_version() -> str | None:
    """The installed llguidance version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llguidance")
    except PackageNotFoundError:
        return None


def json_schema_grammar(schema: dict[str, Any], whitespace_pattern: str) -> tuple[str | None, str]:
    """(llguidance grammar text, "") for `schema`, or (None, why llguidance refuses it).

    Checks the grammar without a tokenizer (the compile child has none): unimplemented
    keywords, invalid regexes and inconsistent bounds are caught here."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_pattern": whitespace_pattern}
        )
    except ValueError as error:
        return None, str(error)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return None, messages[0] if messages else "llguidance refused the schema"
    return grammar, ""


# Keywords whose value is one subschema, a list of them, or a map of name -> subschema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def listed_properties_only(schema: Any) -> Any:
    """A copy of `schema` in which every object schema with `properties` allows only those
    (`additionalProperties: false`): what outlines-core emits for such an object, whatever
    its `additionalProperties` says. Only subschema positions are visited (a property named
    "properties" is a name, not a keyword)."""
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    for key in _SUBSCHEMA:
        if key in node:
            node[key] = listed_properties_only(node[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [listed_properties_only(item) for item in node[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {name: listed_properties_only(s) for name, s in node[key].items()}
    if isinstance(node.get("properties"), dict):
        node["additionalProperties"] = False
    return node


def pack(grammar: str) -> bytes:
    """Grammar text as grammar-cache bytes."""
    return _MAGIC + grammar.encode()


def is_packed(data: bytes) -> bool:
    """True for cache bytes made by `pack` (otherwise they hold an outlines-core index)."""
    return data.startswith(_MAGIC)


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[.*?\])")


def refused_feature(reason: str) -> str:
    """The feature an llguidance refusal names: the first unimplemented keyword, else the
    reason's first line (`Unknown format: foo`)."""
    match = _UNIMPLEMENTED.search(reason)
    if match:
        try:
            keys = json.loads(match.group(1))
        except json.JSONDecodeError:
            keys = []
        if keys:
            return str(keys[0])
    return reason.strip().splitlines()[0] if reason.strip() else "llguidance"
