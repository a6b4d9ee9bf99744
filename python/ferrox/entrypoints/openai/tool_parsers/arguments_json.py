"""A call's arguments JSON text built a parameter at a time, for the XML-style formats whose values are bare
text typed by the request's tool schema (qwen3_coder.py, seed_oss.py through it, minimax_m2.py)."""

from __future__ import annotations

import json
from typing import Any


class ArgumentsJson:
    """'{' + the fragments add() returns + '}' is what json.dumps(dict, ensure_ascii=False) gives for the same
    keys and values, so a stream can send each parameter as it completes. A format says how its raw text
    becomes a key and a value text (prepare) and how that text is typed by the parameter's schema (convert)."""

    def __init__(self, properties: dict[str, Any]) -> None:
        self._properties = properties
        self._keys: set[str] = set()

    def prepare(self, key: str, raw: str) -> tuple[str, str]:
        return key, raw

    def convert(self, text: str, schema: Any) -> Any:
        raise NotImplementedError

    def add(self, key: str, raw: str) -> str:
        """The fragment for one parameter ("" for a repeated key: the first value stands)."""
        key, text = self.prepare(key, raw)
        if key in self._keys:
            return ""
        value = self.convert(text, self._properties.get(key))
        try:
            value_json = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # a set, bytes, NaN, a number JSON cannot hold: the text
            value_json = json.dumps(text, ensure_ascii=False)
        fragment = ("" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value_json
        self._keys.add(key)
        return fragment
