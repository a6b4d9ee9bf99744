"""Hook: request fields -> StructuredOutputsParams (the constraint the engine enforces).

Accepted spellings, most specific first: vLLM's `structured_outputs` object, OpenAI's
`response_format` (json_object / json_schema), and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. The structured-output engineer owns
the semantics (compilation, tool-call constraints); this module only maps fields, so a
bad constraint surfaces as an InvalidArgumentError whose `param` is the field (-> HTTP 400).
"""

from __future__ import annotations

from typing import Any

from ferrox._core import InvalidArgumentError
from ferrox.engine.validation import check_structured_outputs
from ferrox.structured.params import StructuredOutputsParams

_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def build_structured_outputs(request: Any) -> StructuredOutputsParams | None:
    """The constraint a chat/completion request asks for, or None for free text."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    so = getattr(request, "structured_outputs", None)
    if so:
        kwargs = {k: v for k, v in so.items() if k in _STRUCTURED_KEYS and v is not None}
        unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
        if unknown:
            raise InvalidArgumentError(f"structured_outputs: unknown key(s) {', '.join(unknown)}",
                                       param="structured_outputs")
        found.append(("structured_outputs", _make("structured_outputs", **kwargs)))
    rf = getattr(request, "response_format", None)
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(("response_format", _make("response_format", json_object=True)))
        else:
            schema = (rf.json_schema or {}).get("schema")
            if schema is None:
                raise InvalidArgumentError("response_format: json_schema.schema is required for type 'json_schema'",
                                           param="response_format")
            found.append(("response_format", _make("response_format", json=schema)))
    for field, key in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(request, field, None)
        if value is not None:
            found.append((field, _make(field, **{key: value})))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidArgumentError(f"{found[1][0]}: only one structured-output constraint per request (got {names})",
                                   param=found[1][0])
    return found[0][1] if found else None


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise InvalidArgumentError(f"{field}: {exc}", param=field) from None
    # Compile-check now (no tokenizer needed, cached): a bad schema/regex/grammar is a 400 naming
    # the field it came in as, with llguidance's message, instead of a request failing later.
    check_structured_outputs(params, field)
    return params
