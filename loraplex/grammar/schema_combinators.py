"""`allOf` and `oneOf` made safe for outlines-core, which concatenates the branches of `allOf`
and treats `oneOf` as `anyOf`."""

from __future__ import annotations

import json
from typing import Any

from loraplex.grammar.errors import UnsupportedSchemaError

_JSON_TYPES = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}
_MERGEABLE = {"properties", "required"}


def resolve_ref(root: dict[str, Any], ref: str) -> Any:
    """The subschema a local `$ref` ("#/$defs/x") points to."""
    if not ref.startswith("#"):
        raise UnsupportedSchemaError("$ref", f"only local references are supported, got {ref!r}")
    node: Any = root
    for part in filter(None, ref[1:].split("/")):
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        elif isinstance(node, dict) and key in node:
            node = node[key]
        else:
            raise UnsupportedSchemaError("$ref", f"{ref!r} points nowhere")
    return node


def _deref(root: dict[str, Any], node: Any) -> Any:
    seen = set()
    while isinstance(node, dict) and "$ref" in node:
        if node["$ref"] in seen:
            raise UnsupportedSchemaError("$ref", "a reference cycle inside allOf/oneOf")
        seen.add(node["$ref"])
        node = resolve_ref(root, node["$ref"])
    return node


def merge_all_of(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """One schema equivalent to `node` with its `allOf` folded in.

    Branches merge when they only share `properties` (distinct names) and `required`, or share
    keywords with equal values; otherwise `UnsupportedSchemaError("allOf")`.
    """
    merged = {key: value for key, value in node.items() if key != "allOf"}
    for branch in node["allOf"]:
        branch = _deref(root, branch)
        if not isinstance(branch, dict):
            raise UnsupportedSchemaError("allOf", "boolean branches")
        if "allOf" in branch:
            branch = merge_all_of(root, branch)
        for key, value in branch.items():
            if key == "properties":
                properties = dict(merged.get("properties", {}))
                for name, schema in value.items():
                    if name in properties and properties[name] != schema:
                        raise UnsupportedSchemaError("allOf", f"property {name!r} defined twice")
                    properties[name] = schema
                merged["properties"] = properties
            elif key == "required":
                merged["required"] = list(dict.fromkeys([*merged.get("required", []), *value]))
            elif key in merged and merged[key] != value and key not in _MERGEABLE:
                raise UnsupportedSchemaError("allOf", f"branches disagree on {key!r}")
            else:
                merged[key] = value
    return merged


def _types(root: dict[str, Any], branch: Any) -> set[str] | None:
    branch = _deref(root, branch)
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return {_JSON_TYPES.get(type(branch["const"]), "?")}
    if "enum" in branch:
        return {_JSON_TYPES.get(type(value), "?") for value in branch["enum"]}
    if "type" not in branch:
        return None
    kinds = branch["type"] if isinstance(branch["type"], list) else [branch["type"]]
    out = set(kinds)
    if "number" in out:
        out.add("integer")
    return out


def _values(root: dict[str, Any], branch: Any) -> set[str] | None:
    branch = _deref(root, branch)
    if isinstance(branch, dict) and "const" in branch:
        return {json.dumps(branch["const"], sort_keys=True)}
    if isinstance(branch, dict) and "enum" in branch:
        return {json.dumps(value, sort_keys=True) for value in branch["enum"]}
    return None


def _pairwise_disjoint(sets: list[set[str] | None]) -> bool:
    if any(s is None for s in sets):
        return False
    seen: set[str] = set()
    for values in sets:
        if seen & values:
            return False
        seen |= values
    return True


def _discriminated(root: dict[str, Any], branches: list[Any]) -> bool:
    """True when some property is required in every branch with pairwise distinct constants."""
    branches = [_deref(root, branch) for branch in branches]
    if not all(isinstance(b, dict) and "properties" in b for b in branches):
        return False
    common = set.intersection(*(set(b.get("required", [])) for b in branches))
    for name in common:
        values = [_values(root, b["properties"].get(name, {})) for b in branches]
        if _pairwise_disjoint(values):
            return True
    return False


def one_of_as_any_of(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """`node` with `oneOf` renamed `anyOf`, when no value can match two branches.

    Branches count as exclusive when their JSON types, their constants, or a required
    discriminator property's constants never overlap; otherwise `UnsupportedSchemaError("oneOf")`.
    """
    branches = node["oneOf"]
    exclusive = (
        _pairwise_disjoint([_types(root, b) for b in branches])
        or _pairwise_disjoint([_values(root, b) for b in branches])
        or _discriminated(root, branches)
    )
    if not exclusive:
        raise UnsupportedSchemaError(
            "oneOf", "branches may overlap; use anyOf or add a discriminator property"
        )
    if "anyOf" in node:
        raise UnsupportedSchemaError("oneOf", "together with anyOf")
    rewritten = {key: value for key, value in node.items() if key != "oneOf"}
    rewritten["anyOf"] = branches
    return rewritten
