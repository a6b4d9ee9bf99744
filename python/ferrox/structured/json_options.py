"""vLLM's structured-output options for JSON constraints, as llguidance grammars: the whitespace between
JSON tokens, extra object properties, and structural tags (free text with JSON values after triggers).

Shared by the server's request hook (entrypoints/openai/structured.py, which names the request field in
its errors) and StructuredOutputsParams' own option fields (the offline API: backend.grammar_text), so a
constraint means the same whichever way it came in. Errors are ValueErrors; callers name the field.

- disable_any_whitespace: True (or unset) is ferrox's layout (json.dumps' separators, no free whitespace);
  False lets the model put any JSON whitespace between tokens.
- whitespace_pattern: the regex the whitespace between JSON tokens must match (not with True above).
- disable_additional_properties: True (or unset) closes every object schema that lists properties and says
  nothing of others (as vLLM's default backend does); False gives JSON Schema's own default (open).
"""

from __future__ import annotations

from typing import Any

from llguidance import StructTag

from ferrox.structured.backend import close_objects, load_json_object, load_schema

# ferrox's JSON layout (backend.JSON_COMPILE_OPTIONS), for schemas inside Lark grammars.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def whitespace_options(disable_any_whitespace: bool | None, whitespace_pattern: str | None,
                       what: str = "structured_outputs") -> dict[str, Any]:
    """llguidance's JSON options ("x-guidance") for the whitespace settings; {} for ferrox's layout."""
    if whitespace_pattern is not None:
        if disable_any_whitespace:
            raise ValueError(f"{what}.whitespace_pattern: cannot be combined with disable_any_whitespace true")
        return {"whitespace_pattern": whitespace_pattern, "item_separator": ",", "key_separator": ":"}
    if disable_any_whitespace is False:
        return {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    return {}


def with_options(schema: Any, field: str, x_guidance: dict[str, Any], additional: bool | None) -> dict[str, Any]:
    """A JSON schema with the whitespace options folded into its "x-guidance" object and
    `additionalProperties: <additional>` where an object schema says nothing of extra properties (None:
    left to the backend, which closes them for a json constraint)."""
    out = load_schema(schema, field)
    if additional is not None:
        out = close_objects(out, additional)
    if x_guidance:
        out = {**out, "x-guidance": {**(out.get("x-guidance") or {}), **x_guidance}}
    return out


def structural_tag_grammar(spec: Any, field: str, x_guidance: dict[str, Any], open_objects: bool) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or its JSON
    text) as a Lark grammar: free text in which each structure, once the model writes a trigger, is forced
    to its begin text, a JSON value of its schema, and its end text."""
    spec = load_json_object(spec, field, "structural_tag")
    if spec.get("format") is not None:
        raise ValueError(f"{field}: only the structural_tag form with structures and triggers is supported "
                         "(not format)")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not all(
            isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{field}: structural_tag needs a non-empty structures list and a list of non-empty "
                         "trigger strings")
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise ValueError(f"{field}: structures[{i}] needs begin and end strings and a schema")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"{field}: structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        # The same JSON as a json_schema constraint (closed objects, ferrox's compact separators unless the
        # request chose its whitespace), given in the schema: %json blocks read it there.
        schema = with_options(s.get("schema", {}), f"{field}: structures[{i}].schema", x_guidance or COMPACT,
                              open_objects)  # (no backend closes a schema inside a grammar: closed here)
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags)
