"""Forty-odd JSON schemas covering what real requests ask for (imported by the tests)."""

from __future__ import annotations

_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}

SCHEMAS: dict[str, dict] = {
    "flat_object": _PERSON,
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string"},
            "active": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "all_optional": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "null"}},
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": _PERSON,
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["user", "address"],
    },
    "array_of_ints": {"type": "array", "items": {"type": "integer"}},
    "bounded_array": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
    "nested_arrays": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": -9, "maximum": 9},
            "maxItems": 3,
        },
        "maxItems": 3,
    },
    "array_of_objects": {"type": "array", "items": _PERSON, "minItems": 1, "maxItems": 3},
    "tuple": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": [1, "two", None, True, 3.5]},
    "const": {"const": "fixed"},
    "enum_in_object": {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed"]}, "priority": {"enum": [1, 2, 3]}},
        "required": ["status", "priority"],
    },
    "int_range_small": {"type": "integer", "minimum": 1, "maximum": 5},
    "int_range_wide": {"type": "integer", "minimum": -1000, "maximum": 123456},
    "int_exclusive": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
    "int_min_only": {"type": "integer", "minimum": 18},
    "int_max_only": {"type": "integer", "maximum": -5},
    "number_range": {"type": "number", "minimum": 0, "maximum": 1},
    "number_exclusive": {"type": "number", "exclusiveMinimum": 0},
    "number_negative": {"type": "number", "minimum": -10, "exclusiveMaximum": -2},
    "number_plain": {"type": "number"},
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 8},
    "pattern_full": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "pattern_start_only": {"type": "string", "pattern": "^ab"},
    "pattern_unanchored": {"type": "string", "pattern": "[0-9]"},
    "pattern_dot": {"type": "string", "pattern": "^x.{1,4}$"},
    "pattern_negated_class": {"type": "string", "pattern": "^[^aeiou]{3}$"},
    "pattern_alternation": {"type": "string", "pattern": "^(cat|dog)s?$"},
    "format_date": {"type": "string", "format": "date"},
    "format_time": {"type": "string", "format": "time"},
    "format_date_time": {"type": "string", "format": "date-time"},
    "format_uuid": {"type": "string", "format": "uuid"},
    "format_email": {"type": "string", "format": "email"},
    "format_ipv4": {"type": "string", "format": "ipv4"},
    "format_uri": {"type": "string", "format": "uri"},
    "format_hostname": {"type": "string", "format": "hostname"},
    "ref_defs": {
        "type": "object",
        "properties": {"home": {"$ref": "#/$defs/point"}, "work": {"$ref": "#/$defs/point"}},
        "required": ["home", "work"],
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 99},
                    "y": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["x", "y"],
            }
        },
    },
    "ref_definitions": {
        "type": "array",
        "items": {"$ref": "#/definitions/tag"},
        "maxItems": 3,
        "definitions": {"tag": {"type": "string", "enum": ["a", "b"]}},
    },
    "any_of": {"anyOf": [{"type": "integer", "minimum": 10}, {"type": "string", "maxLength": 4}]},
    "nullable": {
        "type": "object",
        "properties": {"note": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
        "required": ["note"],
    },
    "type_list": {"type": ["integer", "null"], "minimum": 3},
    "one_of_types": {"oneOf": [{"type": "boolean"}, {"type": "string", "format": "date"}]},
    "one_of_discriminated": {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                "required": ["kind", "lives"],
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind", "good"],
            },
        ]
    },
    "all_of_merge": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {
                "type": "object",
                "properties": {"b": {"type": "string", "format": "date"}},
                "required": ["b"],
            },
        ]
    },
    "pydantic_style": {
        "$defs": {
            "Item": {
                "properties": {
                    "sku": {"title": "Sku", "type": "string", "pattern": "^SKU"},
                    "qty": {"title": "Qty", "type": "integer", "exclusiveMinimum": 0},
                },
                "required": ["sku", "qty"],
                "title": "Item",
                "type": "object",
            }
        },
        "properties": {
            "items": {
                "items": {"$ref": "#/$defs/Item"},
                "title": "Items",
                "type": "array",
                "maxItems": 2,
            },
            "paid": {"default": False, "title": "Paid", "type": "boolean"},
        },
        "required": ["items"],
        "title": "Order",
        "type": "object",
    },
    "additional_false": {
        "type": "object",
        "properties": {"k": {"type": "string", "format": "email"}},
        "required": ["k"],
        "additionalProperties": False,
    },
}
