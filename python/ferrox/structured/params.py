"""The user-facing description of a constrained-decoding request (one kind at a time), with vLLM's
options for JSON constraints (structured/json_options.py says what each means; None: ferrox's default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance dialect) or GBNF
    json_object: bool = False  # any JSON object
    # vLLM's structural tag (its dict, or the JSON text vLLM takes): free text with JSON values after triggers
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # ferrox has one backend and never falls back: either value holds

    def __post_init__(self) -> None:
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
                ("structural_tag", self.structural_tag),
            )
            if value is not None
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object, structural_tag must "
                f"be set (got {kinds or 'none'})"
            )
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name}: must be true or false, got {value!r}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern: must be a string (a regex)")
        if self.whitespace_pattern is not None and self.disable_any_whitespace:
            raise ValueError("structured_outputs.whitespace_pattern: cannot be combined with disable_any_whitespace "
                             "true")
        options = [n for n in ("disable_any_whitespace", "whitespace_pattern", "disable_additional_properties")
                   if getattr(self, n) is not None]
        if options and kinds[0] not in ("json", "json_object", "structural_tag"):
            raise ValueError(f"structured_outputs.{options[0]}: applies to JSON constraints only, not {kinds[0]}")
        # The values come from request JSON: a wrong type is the client's error here (a 400 naming
        # the field), not a TypeError deep inside llguidance. (A json value of the wrong type is
        # refused by backend.load_schema.)
        for name, value in (("regex", self.regex), ("grammar", self.grammar)):
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name}: must be a string, got {type(value).__name__}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple)) or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice: must be a non-empty list of non-empty strings")
