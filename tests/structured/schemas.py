"""JSON schemas the structured-output tests decode under (nested objects, arrays with item
bounds, enums, bounded numbers, required vs optional, string patterns). Strings carry
maxLength so sampled outputs finish within a small max_tokens."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 10},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "bounded_array": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 2,
                "maxItems": 4,
            }
        },
        "required": ["scores"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "number_bounds": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100},
        },
        "required": ["temperature", "humidity"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 15},
            "subtitle": {"type": "string", "maxLength": 10},
            "pages": {"type": "integer", "minimum": 1, "maximum": 999},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "string_pattern": {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
        },
        "required": ["date", "code"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "booleans_and_null": {
        "type": "object",
        "properties": {
            "active": {"type": "boolean"},
            "deleted_at": {"type": "null"},
            "score": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"type": "null"}]},
        },
        "required": ["active", "deleted_at", "score"],
        "additionalProperties": False,
    },
    "string_list": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 8},
                "minItems": 1,
                "maxItems": 3,
            },
            "count": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["tags", "count"],
        "additionalProperties": False,
    },
    "const_and_defs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "y": {"type": "integer", "minimum": -9, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {
            "kind": {"const": "segment"},
            "start": {"$ref": "#/$defs/point"},
            "end": {"$ref": "#/$defs/point"},
        },
        "required": ["kind", "start", "end"],
        "additionalProperties": False,
    },
}
