"""Schemas from the hostile-tenant audit, shared by the grammar, engine and API tests."""

from __future__ import annotations


def wide(num_properties: int) -> dict:
    """An object schema with this many string properties (the audit's was 100,000: 2.9 MB)."""
    properties = {f"field_{i}": {"type": "string"} for i in range(num_properties)}
    return {"type": "object", "properties": properties}


def nested(levels: int) -> dict:
    """An object schema nesting `levels` objects, each with one property."""
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema
