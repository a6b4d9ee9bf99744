"""The user-facing description of a constrained-decoding request (one kind at a time)."""

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

    def __post_init__(self) -> None:
        kinds = [
            name
            for name, value in (
                ("json", self.json),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
                ("json_object", self.json_object or None),
            )
            if value is not None
        ]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object must be set"
                f" (got {kinds or 'none'})"
            )
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
