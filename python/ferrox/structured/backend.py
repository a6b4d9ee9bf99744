"""llguidance as ferrox's grammar backend: constraint -> grammar text -> compiled matcher.

Three steps, kept apart so each can be cached or run off the engine loop:
  1. `grammar_text(params)`: a StructuredOutputsParams becomes llguidance grammar text plus a
     canonical key for the compile cache (pure, cheap, no tokenizer).
  2. `validate_params(params)`: the grammar is checked without a tokenizer, so the server can
     answer a bad schema / regex / Lark grammar with a 400 before anything is queued.
  3. `compile_matcher(tokenizer, text)`: the grammar is compiled against the model's tokenizer
     into an LLMatcher in its start state. That matcher is the reusable "compiled grammar":
     each request gets `deep_copy()` of it, which is far cheaper than compiling again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from ferrox.structured.guidance_vocab import grammar_with_special_ids, guidance_tokenizer_json
from ferrox.structured.params import StructuredOutputsParams

# JSON is generated with the separators json.dumps uses by default and no free whitespace:
# the model then writes the JSON it saw most in training, and cannot spend its token budget
# on an endless run of spaces or newlines (a real failure mode of small models at temperature 1).
# These are defaults: a schema's own "x-guidance" options (how the server passes vLLM's
# disable_any_whitespace / whitespace_pattern) take precedence.
JSON_COMPILE_OPTIONS: llguidance._lib.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


@dataclass(frozen=True, slots=True)
class GrammarText:
    key: str  # canonical text of the constraint: the compile cache key
    grammar: str  # llguidance grammar (JSON envelope), accepted by LLMatcher
    field: str  # the request field it came from, for error messages


def load_json_object(value: Any, field: str, what: str) -> dict[str, Any]:
    """A JSON object given as a dict or as its JSON text, as a dict (ValueError naming `field` and `what` it is)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: {what} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{field}: {what} must be an object, got {type(value).__name__}")
    return value


def load_schema(schema: dict | str, field: str) -> dict[str, Any]:
    """A JSON schema given as a dict or as its JSON text, as a dict (ValueError naming `field`)."""
    return load_json_object(schema, field, "a JSON schema")


def _schema_text(schema: dict | str, field: str) -> str:
    """Canonical JSON text of a schema, its objects closed (close_objects). Key order is kept on
    purpose: it is the order in which the model writes the properties, so two schemas differing only
    by order differ."""
    return json.dumps(close_objects(load_schema(schema, field)), separators=(",", ":"), ensure_ascii=False)


# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def close_objects(schema: Any, additional: bool = False, *, _close_here: bool = True) -> Any:
    """The schema with `additionalProperties: <additional>` on every object schema that lists
    `properties` and says nothing of extra ones. With False (the default) this is what vLLM's default
    structured-output backend (xgrammar's strict mode) does: the model writes the properties the
    schema lists and no others. JSON Schema itself would allow any extra property, which lets a model
    invent fields. Members of allOf are left open at their top (each would forbid the others'
    properties); patternProperties and unevaluatedProperties already say what else is allowed."""
    if isinstance(schema, list):
        return [close_objects(s, additional) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if (_close_here and isinstance(out.get("properties"), dict) and "additionalProperties" not in out
            and "patternProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = additional
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), (dict, list)):
            out[key] = close_objects(out[key], additional)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s, additional) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s, additional) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [close_objects(s, additional, _close_here=False) for s in out["allOf"]]
    return out


def lark_string_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly (JSON string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def json_schema_grammar(schema: dict | str, field: str = "structured_outputs.json") -> GrammarText:
    text = _schema_text(schema, field)
    return GrammarText(
        key="json:" + text,
        grammar=llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_COMPILE_OPTIONS),
        field=field,
    )


def grammar_text(params: StructuredOutputsParams) -> GrammarText:
    """The llguidance grammar for one constraint. Raises ValueError naming the field when the
    input is malformed before llguidance even sees it (e.g. a schema that is not JSON)."""
    params = _fold_options(params)
    if params.json is not None:
        return json_schema_grammar(params.json)
    if params.json_object:
        return GrammarText(
            key="json_object",
            grammar=llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, overrides=JSON_COMPILE_OPTIONS
            ),
            field="structured_outputs.json_object",
        )
    if params.regex is not None:
        return GrammarText(
            key="regex:" + params.regex,
            grammar=llguidance.LLMatcher.grammar_from_regex(params.regex),
            field="structured_outputs.regex",
        )
    if params.choice is not None:
        lark = "start: " + " | ".join(lark_string_literal(c) for c in params.choice)
        return GrammarText(
            key="choice:" + json.dumps(params.choice, ensure_ascii=False),
            grammar=llguidance.LLMatcher.grammar_from_lark(lark),
            field="structured_outputs.choice",
        )
    if params.grammar is not None:
        # llguidance's Lark dialect is the native one; GBNF (llama.cpp, `::=` rules) is converted.
        try:
            lark = any_to_lark(params.grammar)
        except Exception as e:  # the converter raises bare Exceptions with a useful message
            raise ValueError(f"structured_outputs.grammar: cannot convert GBNF to Lark: {e}") from None
        return GrammarText(
            key="grammar:" + params.grammar,
            grammar=llguidance.LLMatcher.grammar_from_lark(lark),
            field="structured_outputs.grammar",
        )
    raise ValueError("structured_outputs: no constraint set")  # unreachable: params validates itself


def _fold_options(params: StructuredOutputsParams) -> StructuredOutputsParams:
    """A constraint with vLLM's JSON options (or a structural tag) as the plain json / grammar constraint they
    amount to (structured/json_options.py); one without them as it is."""
    from ferrox.structured import json_options

    if (params.structural_tag is None and params.disable_any_whitespace is None and params.whitespace_pattern is None
            and params.disable_additional_properties is None):
        return params
    x_guidance = json_options.whitespace_options(params.disable_any_whitespace, params.whitespace_pattern)
    additional = None if params.disable_additional_properties in (None, True) else True
    if params.structural_tag is not None:
        return StructuredOutputsParams(grammar=json_options.structural_tag_grammar(
            params.structural_tag, "structured_outputs.structural_tag", x_guidance, additional is True))
    if not x_guidance and additional is None:  # the options ask for ferrox's defaults
        return dataclasses.replace(params, disable_any_whitespace=None, disable_additional_properties=None)
    schema = params.json if params.json is not None else {"type": "object"}
    return StructuredOutputsParams(json=json_options.with_options(schema, "structured_outputs.json", x_guidance,
                                                                  additional))


def validate_params(params: StructuredOutputsParams, field: str | None = None) -> GrammarText:
    """Check a constraint without a tokenizer (no lexer is built, so it is cheap, and cached by
    constraint text). Raises ValueError with llguidance's message, prefixed by the offending
    field (or `field` when given: the request field it came in as, e.g. response_format), so the
    server can answer 400 and LLM.generate can refuse before queueing anything."""
    try:
        text = grammar_text(params)
    except ValueError as exc:
        if field is None:
            raise
        raise ValueError(f"{field}: {str(exc).split(': ', 1)[-1]}") from None
    error = _grammar_error(text.grammar)
    if error:
        raise ValueError(f"{field or text.field}: invalid constraint: {error}")
    return text


@functools.lru_cache(maxsize=512)
def _grammar_error(grammar: str) -> str:
    return llguidance.LLMatcher.validate_grammar(grammar).strip()


class GrammarCompileError(ValueError):
    """The constraint did not compile for this tokenizer (llguidance's message inside)."""


def compile_matcher(tokenizer: llguidance.LLTokenizer, text: GrammarText) -> llguidance.LLMatcher:
    """Compile a grammar into a matcher in its start state (drops the GIL while compiling)."""
    grammar = grammar_with_special_ids(text.grammar, _SPECIAL_NAMES.get(id(tokenizer), {}))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarCompileError(f"{text.field}: invalid constraint: {matcher.get_error().strip()}")
    return matcher


# One LLTokenizer per (tokenizer, logits width, eos set): building it costs ~0.2 s and its token
# trie is read-only afterwards, so every manager and thread can share it.
_TOKENIZERS: dict[tuple[str, int, tuple[int, ...]], llguidance.LLTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()
# Each shared LLTokenizer's special tokens, name -> id (by the tokenizer's id(): both live as long as
# the process), for grammars that name one (guidance_vocab.grammar_with_special_ids).
_SPECIAL_NAMES: dict[int, dict[str, int]] = {}


def get_tokenizer(
    tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The shared LLTokenizer for a tokenizer.json text.

    vocab_size is the logits width: it may exceed the tokenizer's vocabulary (padded embedding
    rows), and the extra ids are never allowed. eos_token_ids are the ids the engine stops on;
    the matcher allows them exactly when the grammar is in an accepting state.
    """
    if not eos_token_ids:
        raise ValueError("eos_token_ids: at least one end-of-sequence token id is needed for grammars")
    digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()
    key = (digest, int(vocab_size), tuple(int(t) for t in eos_token_ids))
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            try:
                text, special = guidance_tokenizer_json(tokenizer_json)
                tok = llguidance.LLTokenizer(text, n_vocab=int(vocab_size), eos_token=list(key[2]))
            except Exception as e:
                raise ValueError(f"tokenizer_json: llguidance cannot load this tokenizer: {e}") from None
            _TOKENIZERS[key] = tok
            _SPECIAL_NAMES[id(tok)] = special
        return tok
