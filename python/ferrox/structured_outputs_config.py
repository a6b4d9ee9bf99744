"""vLLM's engine-level structured_outputs_config (`--structured-outputs-config`, a JSON object) as ferrox
reads it. ferrox's one structured-output backend is llguidance, which is vLLM's "guidance" backend:

- backend: "auto" and "guidance" name it; "xgrammar", "outlines" and "lm-format-enforcer" are refused by
  name (not accepted and run on another library).
- disable_fallback: ferrox never falls back to another backend, so either value holds.
- disable_any_whitespace, disable_additional_properties: the value a request's JSON constraint takes when
  the request does not set the option itself (structured/json_options.py says what each means; unset,
  ferrox's defaults: compact JSON, closed objects).
- reasoning_parser: the same setting as --reasoning-parser (both given, they must agree).
- enable_in_reasoning: true constrains a reasoning model's thinking too (from its first token), instead of
  only its answer after the end of thinking.
- reasoning_parser_plugin: the same setting as --reasoning-parser-plugin (both given, they must agree).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ferrox.structured.params import StructuredOutputsParams

BACKENDS = ("auto", "guidance")
OTHER_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")
KEYS = ("backend", "disable_fallback", "disable_any_whitespace", "disable_additional_properties",
        "reasoning_parser", "reasoning_parser_plugin", "enable_in_reasoning")


@dataclass(frozen=True, slots=True)
class StructuredOutputsDefaults:
    disable_any_whitespace: bool | None = None  # None: ferrox's default (compact JSON)
    disable_additional_properties: bool | None = None  # None: ferrox's default (closed objects)
    enable_in_reasoning: bool = False
    reasoning_parser: str | None = None
    reasoning_parser_plugin: str | None = None


def parse_structured_outputs_config(value: dict[str, Any] | None) -> StructuredOutputsDefaults:
    """The settings a structured_outputs_config asks for; ValueError naming the key ferrox cannot honour."""
    if value is None:
        return StructuredOutputsDefaults()
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs_config: must be a JSON object, got {value!r}")
    for key in value:
        if key not in KEYS:
            raise ValueError(f"structured_outputs_config.{key}: unknown key (vLLM's are {', '.join(KEYS)})")
    backend = value.get("backend", "auto")
    if backend in OTHER_BACKENDS:
        raise ValueError(f"structured_outputs_config.backend: {backend!r} is not available: ferrox's structured "
                         "outputs run on llguidance, vLLM's 'guidance' backend (use 'guidance' or 'auto')")
    if backend not in BACKENDS:
        raise ValueError(f"structured_outputs_config.backend: {backend!r} is not one of "
                         f"{', '.join((*BACKENDS, *OTHER_BACKENDS))}")
    for key in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning"):
        if key in value and not isinstance(value[key], bool):
            raise ValueError(f"structured_outputs_config.{key}: must be true or false, got {value[key]!r}")
    plugin = value.get("reasoning_parser_plugin") or None
    if plugin is not None and not isinstance(plugin, str):
        raise ValueError(f"structured_outputs_config.reasoning_parser_plugin: must be a file's path, got {plugin!r}")
    parser = value.get("reasoning_parser") or None
    if parser is not None and not isinstance(parser, str):
        raise ValueError(f"structured_outputs_config.reasoning_parser: must be a parser's name, got {parser!r}")
    return StructuredOutputsDefaults(disable_any_whitespace=value.get("disable_any_whitespace"),
                                     disable_additional_properties=value.get("disable_additional_properties"),
                                     enable_in_reasoning=bool(value.get("enable_in_reasoning", False)),
                                     reasoning_parser=parser, reasoning_parser_plugin=plugin)


def with_defaults(params: StructuredOutputsParams, defaults: StructuredOutputsDefaults) -> StructuredOutputsParams:
    """A request's JSON constraint with the server-wide option values where the request left them unset
    (the options apply to JSON constraints only: others are returned as they are)."""
    if not (params.json is not None or params.json_object or params.structural_tag is not None):
        return params
    changes = {name: getattr(defaults, name) for name in ("disable_any_whitespace", "disable_additional_properties")
               if getattr(params, name) is None and getattr(defaults, name) is not None}
    if "disable_any_whitespace" in changes and params.whitespace_pattern is not None:
        del changes["disable_any_whitespace"]  # the request chose its whitespace
    return dataclasses.replace(params, **changes) if changes else params
