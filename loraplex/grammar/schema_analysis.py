"""Check a JSON schema before compiling: refuse what outlines-core would silently ignore, and
enforce what it ignores but a regex can express.

Numeric bounds, string `pattern`s and `format`s are enforced by swapping the subschema for a
unique string constant (a placeholder) and, once outlines-core has written the schema's regex,
replacing that constant with a regex of our own (see `AnalysedSchema.substitutions`).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from loraplex.grammar.errors import GrammarCompileError, UnsupportedSchemaError
from loraplex.grammar.formats import FORMAT_REGEXES
from loraplex.grammar.numeric_range import integer_regex, number_regex
from loraplex.grammar.pattern import normalize_pattern
from loraplex.grammar.schema_combinators import merge_all_of, one_of_as_any_of, resolve_ref

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)
# Keywords of every JSON Schema draft that constrain instances (validation and applicators).
# One not handled here is refused by name; any other unknown keyword is an annotation (JSON
# Schema validators ignore it: `markdownDescription`, `x-...`, editor hints), passed through.
_CONSTRAINING = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "items",
        "prefixItems", "additionalItems", "unevaluatedItems", "contains", "minContains",
        "maxContains", "maxItems", "minItems", "uniqueItems", "properties", "patternProperties",
        "additionalProperties", "unevaluatedProperties", "propertyNames", "maxProperties",
        "minProperties", "required", "dependentRequired", "dependentSchemas", "dependencies",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
        "$recursiveRef", "contentSchema", "contentMediaType", "contentEncoding",
    }
)  # fmt: skip
_KEYWORDS = {
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"},
    "string": {"minLength", "maxLength", "pattern", "format"},
    "array": {"items", "prefixItems", "minItems", "maxItems", "uniqueItems"},
    "object": {"properties", "required", "additionalProperties"},
}
_GENERAL = {"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"}
_SUPPORTED = _ANNOTATIONS | _GENERAL | set().union(*_KEYWORDS.values())
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


@dataclass(frozen=True)
class AnalysedSchema:
    """A schema outlines-core can compile faithfully.

    schema: the rewritten schema. substitutions: placeholder regex text -> our regex, to be
    replaced in the regex outlines-core builds from `schema`.
    """

    schema: dict[str, Any]
    substitutions: dict[str, str]


class _Analyser:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.substitutions: dict[str, str] = {}
        self._root_text = json.dumps(root)

    def placeholder(self, regex: str) -> dict[str, Any]:
        """A string constant standing in for `regex` until the schema's regex is built."""
        index = len(self.substitutions)
        name = f"LPXSUB{index}Z"
        while name in self._root_text:
            name = f"LPXSUB{index}Z{len(name)}"
        self.substitutions[f'"{name}"'] = f"(?:{regex})"
        return {"const": name}

    def walk(self, node: Any, where: str) -> Any:
        if node is True:
            return {}
        if not isinstance(node, dict):
            raise UnsupportedSchemaError(
                "boolean schema false" if node is False else "schema", f"at {where}"
            )
        for key in node:
            if key not in _SUPPORTED and key in _CONSTRAINING:
                raise UnsupportedSchemaError(key, f"at {where}")
        # NOTE: unknown annotations are dropped: outlines-core refuses a node made only of them.
        node = {key: value for key, value in node.items() if key in _SUPPORTED}
        for defs in ("$defs", "definitions"):
            if defs in node:
                node[defs] = {k: self.walk(v, f"{where}/{defs}/{k}") for k, v in node[defs].items()}
        if "$ref" in node:
            return self._ref(node, where)
        if "allOf" in node:
            return self.walk(merge_all_of(self.root, node), where)
        if "oneOf" in node:
            return self.walk(one_of_as_any_of(self.root, node), where)
        if "enum" in node or "const" in node:
            return node
        if "anyOf" in node:
            extra = set(node) - _ANNOTATIONS - {"anyOf", "$defs", "definitions"}
            if extra:
                raise UnsupportedSchemaError(
                    "anyOf with sibling keywords", f"{sorted(extra)} at {where}"
                )
            node["anyOf"] = [
                self.walk(b, f"{where}/anyOf/{i}") for i, b in enumerate(node["anyOf"])
            ]
            return node
        kind = self._type(node, where)
        if isinstance(kind, list):
            if len(kind) == 1:
                kind = kind[0]
            else:
                defs = {k: node.pop(k) for k in ("$defs", "definitions") if k in node}
                branches = [{**node, "type": k} for k in kind]
                return self.walk({"anyOf": branches, **defs}, where)
        return self._typed(node, kind, where) if kind is not None else node

    def _ref(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        extra = set(node) - _ANNOTATIONS - {"$ref", "$defs", "definitions"}
        if extra:
            raise UnsupportedSchemaError(
                "$ref with sibling keywords", f"{sorted(extra)} at {where}"
            )
        resolve_ref(self.root, node["$ref"])
        return node

    def _type(self, node: dict[str, Any], where: str) -> str | list[str] | None:
        if "type" in node:
            kind = node["type"]
            kinds = kind if isinstance(kind, list) else [kind]
            if not kinds or any(k not in (*_KEYWORDS, "boolean", "null") for k in kinds):
                raise UnsupportedSchemaError(f"type: {kind}", f"at {where}")
            return kind
        implied = [k for k, words in _KEYWORDS.items() if words & set(node) and k != "integer"]
        if len(implied) > 1:
            raise UnsupportedSchemaError("keywords of several types without 'type'", f"at {where}")
        return implied[0] if implied else None

    def _typed(self, node: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
        node = {**node, "type": kind}
        if kind in ("integer", "number"):
            return self._numeric(node, kind, where)
        if kind == "string":
            return self._string(node, where)
        if kind == "array":
            return self._array(node, where)
        if kind == "object":
            return self._object(node, where)
        return node

    def _numeric(self, node: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
        multiple = node.get("multipleOf")
        if multiple is not None and not (kind == "integer" and multiple == 1):
            raise UnsupportedSchemaError("multipleOf", f"at {where}")
        bounds = {key: node[key] for key in _BOUNDS if key in node}
        if not bounds:
            return node
        for key, value in bounds.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UnsupportedSchemaError(key, f"must be a number at {where}")
        low, high = self._bound(bounds, "minimum"), self._bound(bounds, "maximum")
        try:
            if kind == "integer":
                regex = integer_regex(
                    _ceil(low, self._exclusive(bounds, "minimum")),
                    _floor(high, self._exclusive(bounds, "maximum")),
                )
            else:
                for key, value in bounds.items():
                    if not float(value).is_integer():
                        raise UnsupportedSchemaError(
                            key, f"non-integral bound on a number at {where}"
                        )
                regex = number_regex(
                    None if low is None else int(low),
                    None if high is None else int(high),
                    self._exclusive(bounds, "minimum"),
                    self._exclusive(bounds, "maximum"),
                )
        except ValueError as error:
            if isinstance(error, UnsupportedSchemaError):
                raise
            raise UnsupportedSchemaError("minimum/maximum", f"{error} at {where}") from None
        return self.placeholder(regex)

    @staticmethod
    def _bound(bounds: dict[str, float], name: str) -> float | None:
        """The tighter of `name` and its exclusive form (JSON Schema 2019+ numeric form)."""
        exclusive = "exclusive" + name[0].upper() + name[1:]
        values = [bounds[k] for k in (name, exclusive) if k in bounds]
        if not values:
            return None
        return max(values) if name == "minimum" else min(values)

    def _exclusive(self, bounds: dict[str, float], name: str) -> bool:
        exclusive = "exclusive" + name[0].upper() + name[1:]
        return exclusive in bounds and bounds[exclusive] == self._bound(bounds, name)

    def _string(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        pattern, fmt = node.get("pattern"), node.get("format")
        lengths = "minLength" in node or "maxLength" in node
        if pattern is not None and (fmt is not None or lengths):
            raise UnsupportedSchemaError("pattern with format/minLength/maxLength", f"at {where}")
        if fmt is not None:
            if fmt not in FORMAT_REGEXES:
                raise UnsupportedSchemaError(f"format: {fmt}", f"at {where}")
            if lengths:
                raise UnsupportedSchemaError("format with minLength/maxLength", f"at {where}")
            return self.placeholder(f'"{FORMAT_REGEXES[fmt]}"')
        if pattern is not None:
            return self.placeholder(f'"{normalize_pattern(pattern)}"')
        return node

    def _array(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        if node.get("uniqueItems"):
            raise UnsupportedSchemaError("uniqueItems", f"at {where}")
        if "prefixItems" in node:
            if "minItems" in node or "maxItems" in node:
                raise UnsupportedSchemaError("prefixItems with minItems/maxItems", f"at {where}")
            node["prefixItems"] = [
                self.walk(s, f"{where}/prefixItems/{i}") for i, s in enumerate(node["prefixItems"])
            ]
            node.pop("items", None)
        elif "items" in node:
            if node["items"] is False:
                raise UnsupportedSchemaError("items: false without prefixItems", f"at {where}")
            node["items"] = self.walk(node["items"], f"{where}/items")
        return node

    def _object(self, node: dict[str, Any], where: str) -> dict[str, Any]:
        properties = node.get("properties")
        required = node.get("required", [])
        if properties is None:
            if required:
                raise UnsupportedSchemaError("required without properties", f"at {where}")
            additional = node.get("additionalProperties")
            if isinstance(additional, dict):
                node["additionalProperties"] = self.walk(
                    additional, f"{where}/additionalProperties"
                )
            return node
        missing = [name for name in required if name not in properties]
        if missing:
            raise UnsupportedSchemaError(
                "required property not in properties", f"{missing} at {where}"
            )
        node["properties"] = {
            name: self.walk(schema, f"{where}/properties/{name}")
            for name, schema in properties.items()
        }
        # NOTE: outlines-core emits only the listed properties, a valid subset of any
        # additionalProperties; the keyword is dropped so it cannot change that.
        node.pop("additionalProperties", None)
        return node


def _ceil(value: float | None, exclusive: bool) -> int | None:
    if value is None:
        return None
    return math.floor(value) + 1 if exclusive and float(value).is_integer() else math.ceil(value)


def _floor(value: float | None, exclusive: bool) -> int | None:
    if value is None:
        return None
    return math.ceil(value) - 1 if exclusive and float(value).is_integer() else math.floor(value)


def analyse_schema(schema: dict[str, Any]) -> AnalysedSchema:
    """Validate `schema` as a JSON schema and rewrite it for a faithful compile.

    Raises `UnsupportedSchemaError(feature)` for keywords that cannot be enforced and
    `GrammarCompileError` for an invalid schema.
    """
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as error:
        raise GrammarCompileError(f"invalid JSON schema: {error.message}") from None
    root = copy.deepcopy(schema)
    analyser = _Analyser(root)
    rewritten = analyser.walk(root, "#")
    return AnalysedSchema(schema=rewritten, substitutions=analyser.substitutions)


def schema_regex(schema: dict[str, Any], whitespace_pattern: str, max_recursion_depth: int) -> str:
    """The regex that enforces `schema`: outlines-core's regex of the analysed schema, with our
    regexes in place of the placeholders. Raises what `analyse_schema` raises.

    Runs in the compile child (under its time and memory limits), never on the engine thread.
    """
    from outlines_core.json_schema import build_regex_from_schema

    analysed = analyse_schema(schema)
    # NOTE: not sorted: outlines-core emits properties in the order the text lists them.
    regex = build_regex_from_schema(
        json.dumps(analysed.schema),
        whitespace_pattern,
        max_recursion_depth=max_recursion_depth,
    )
    for placeholder, replacement in sorted(analysed.substitutions.items()):
        regex = regex.replace(placeholder, replacement)
    return regex
