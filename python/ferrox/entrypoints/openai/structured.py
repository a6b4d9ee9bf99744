"""Hook: request fields -> StructuredOutputsParams (the constraint the engine enforces).

Accepted spellings, most specific first: vLLM's `structured_outputs` object, OpenAI's
`response_format` (json_object / json_schema, and vLLM's structural_tag), and vLLM's older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. The structured-output engineer
owns the semantics (compilation, tool-call constraints); this module only maps fields, so a bad
constraint surfaces as an InvalidArgumentError whose `param` is the field (-> HTTP 400).

vLLM's options ride along with whichever constraint the request has:
  - `structured_outputs.disable_any_whitespace`: true is ferrox's default (JSON with json.dumps'
    separators and no free whitespace); false lets the model put any JSON whitespace between tokens.
  - `structured_outputs.whitespace_pattern` (or `guided_whitespace_pattern`): the regex whitespace
    between JSON tokens must match.
  - `structured_outputs.disable_additional_properties`: true is ferrox's default (an object schema
    that lists properties allows no others unless it says so, as vLLM's default backend does); false
    gives JSON Schema's own default (extra properties allowed).
  - `structured_outputs.disable_fallback`: ferrox has one backend and never falls back, so either
    value holds.
The whitespace options go into the schema's "x-guidance" object, llguidance's per-schema options;
they apply to JSON constraints only and are refused with any other kind.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import StructTag

from ferrox._core import InvalidArgumentError
from ferrox.engine.validation import check_structured_outputs
from ferrox.structured.backend import close_objects, load_schema
from ferrox.structured.params import StructuredOutputsParams

_KIND_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTION_KEYS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties", "disable_fallback")
# ferrox's JSON layout (backend.JSON_COMPILE_OPTIONS), for schemas inside Lark grammars.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def build_structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The constraint a chat/completion request asks for, or None for free text."""
    found: list[tuple[str, dict[str, Any]]] = []  # (field, StructuredOutputsParams kwargs)
    options: dict[str, Any] = {}
    so = getattr(request, "structured_outputs", None)
    if so:
        unknown = sorted(set(so) - set(_KIND_KEYS) - set(_OPTION_KEYS))
        if unknown:
            raise InvalidArgumentError(f"structured_outputs: unknown key(s) {', '.join(unknown)}",
                                       param="structured_outputs")
        options = {k: so[k] for k in _OPTION_KEYS if so.get(k) is not None}
        kinds = {k: so[k] for k in _KIND_KEYS if so.get(k) not in (None, False)}
        if len(kinds) > 1:
            raise InvalidArgumentError(f"structured_outputs: only one of {', '.join(_KIND_KEYS)} may be set "
                                       f"(got {', '.join(kinds)})", param="structured_outputs")
        if "structural_tag" in kinds:
            found.append(("structured_outputs", {"structural_tag": kinds["structural_tag"]}))
        elif kinds:
            found.append(("structured_outputs", kinds))
    pattern = getattr(request, "guided_whitespace_pattern", None)
    if pattern is not None:
        if options.get("whitespace_pattern", pattern) != pattern:
            raise InvalidArgumentError("guided_whitespace_pattern: differs from structured_outputs.whitespace_pattern",
                                       param="guided_whitespace_pattern")
        options["whitespace_pattern"] = pattern
    rf = getattr(request, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf.type == "structural_tag":
            found.append(("response_format", {"structural_tag": rf.model_dump(exclude={"type", "json_schema"})}))
        else:
            schema = (rf.json_schema or {}).get("schema")
            if schema is None:
                raise InvalidArgumentError("response_format: json_schema.schema is required for type 'json_schema'",
                                           param="response_format")
            found.append(("response_format", {"json": schema}))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, field, None)
        if value is not None:
            found.append((field, {key: value}))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidArgumentError(f"{found[1][0]}: only one structured-output constraint per request (got {names})",
                                   param=found[1][0])
    if not found:
        if options:
            key = next(iter(options))
            raise InvalidArgumentError(f"structured_outputs.{key}: needs a constraint (json, regex, choice, grammar, "
                                       "json_object, structural_tag, response_format or guided_*)",
                                       param="structured_outputs")
        return None
    field, kwargs = found[0]
    return _make(field, **_apply_options(field, kwargs, options))


def _json_options(options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's whitespace options as llguidance JSON options (x-guidance); {} for ferrox's default."""
    pattern = options.get("whitespace_pattern")
    if pattern is not None:
        if options.get("disable_any_whitespace"):
            raise InvalidArgumentError("structured_outputs.whitespace_pattern: cannot be combined with "
                                       "disable_any_whitespace true", param="structured_outputs")
        return {"whitespace_pattern": pattern, "item_separator": ",", "key_separator": ":"}
    if options.get("disable_any_whitespace") is False:
        return {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    return {}


def _with_options(schema: Any, field: str, x_guidance: dict[str, Any], additional: bool | None) -> dict[str, Any]:
    """A JSON schema with the request's whitespace options and additionalProperties default (None:
    the backend's, closed) folded in."""
    out = load_schema(schema, field)
    if additional is not None:
        out = close_objects(out, additional)
    if x_guidance:
        out = {**out, "x-guidance": {**(out.get("x-guidance") or {}), **x_guidance}}
    return out


def _apply_options(field: str, kwargs: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    x_guidance = _json_options(options)
    additional = None if options.get("disable_additional_properties", True) else True
    if "structural_tag" in kwargs:
        return {"grammar": _structural_tag(kwargs["structural_tag"], field, x_guidance, additional is None)}
    if not x_guidance and additional is None:
        return kwargs
    if "json" in kwargs:
        return {"json": _with_options(kwargs["json"], field, x_guidance, additional)}
    if kwargs.get("json_object"):
        return {"json": _with_options({"type": "object"}, field, x_guidance, None)}
    key = next(k for k in options if k in ("disable_any_whitespace", "whitespace_pattern",
                                           "disable_additional_properties"))
    raise InvalidArgumentError(f"structured_outputs.{key}: applies to JSON constraints only, not "
                               f"{next(iter(kwargs))}", param="structured_outputs")


def _structural_tag(spec: Any, field: str, x_guidance: dict[str, Any], closed: bool) -> str:
    """vLLM's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or
    its JSON text) as a Lark grammar: free text in which each structure, once the model writes a
    trigger, is forced to its begin text, a JSON value of its schema, and its end text."""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{field}: structural_tag is not valid JSON: {exc}", param=field) from None
    if not isinstance(spec, dict):
        raise InvalidArgumentError(f"{field}: structural_tag must be an object", param=field)
    if spec.get("format") is not None:
        raise InvalidArgumentError(f"{field}: only the structural_tag form with structures and triggers is "
                                   "supported (not format)", param=field)
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not all(
            isinstance(t, str) and t for t in triggers):
        raise InvalidArgumentError(f"{field}: structural_tag needs a non-empty structures list and a list of "
                                   "non-empty trigger strings", param=field)
    tags = []
    for i, s in enumerate(structures):
        if not isinstance(s, dict) or not isinstance(s.get("begin"), str) or not isinstance(s.get("end"), str):
            raise InvalidArgumentError(f"{field}: structures[{i}] needs begin and end strings and a schema",
                                       param=field)
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise InvalidArgumentError(f"{field}: structures[{i}].begin {s['begin']!r} starts with none of the "
                                       "triggers", param=field)
        try:
            # The same JSON as a json_schema constraint (closed objects, ferrox's compact separators
            # unless the request chose its whitespace), given in the schema: %json blocks read it there.
            schema = _with_options(s.get("schema", {}), f"{field}: structures[{i}].schema",
                                   x_guidance or _COMPACT, not closed)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc), param=field) from None
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=schema, end=s["end"]))
    return StructTag.to_grammar(tags)


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise InvalidArgumentError(f"{field}: {exc}", param=field) from None
    # Compile-check now (no tokenizer needed, cached): a bad schema/regex/grammar is a 400 naming
    # the field it came in as, with llguidance's message, instead of a request failing later.
    check_structured_outputs(params, field)
    return params


def format_constraint(response_format: Any) -> StructuredOutputsParams | None:
    """The constraint of a format given in chat's response_format shape by another API (Responses'
    text.format, Anthropic's output_config.format); errors name `response_format`, which the caller
    renames to its own field."""

    class _View:  # what build_structured_outputs reads: this one field
        def __init__(self, fmt: Any) -> None:
            self.response_format = fmt

    return build_structured_outputs(_View(response_format))
