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
They become StructuredOutputsParams' own fields (its check refuses them with a constraint that is not
JSON), which the grammar is built from (structured/json_options.py), so the offline API's params and the
request fields mean the same.
"""

from __future__ import annotations

from typing import Any

from ferrox._core import InvalidArgumentError
from ferrox.engine.validation import check_structured_outputs
from ferrox.structured.params import StructuredOutputsParams

_KIND_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_OPTION_KEYS = ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties", "disable_fallback")


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
    # The options become the params' own fields: StructuredOutputsParams checks them and folds them into
    # the grammar (structured/json_options.py), as it does for the offline API's.
    return _make(field, **kwargs, **options)


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        if str(exc).startswith(tuple(f"structured_outputs.{k}:" for k in _OPTION_KEYS)):
            # one of vLLM's options, which come in structured_outputs
            raise InvalidArgumentError(str(exc), param="structured_outputs") from None
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
