"""Gemma 4's tool calls (`gemma4`, vLLM's name; google/gemma-4-*), FunctionGemma's format with Gemma 4's tokens:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{unit:<|"|>C<|"|>}}<tool_call|>

`<|tool_call>`, `<tool_call|>` and the string delimiter `<|"|>` are special tokens of Gemma 4's tokenizer, so the
reply keeps them (vLLM's parser turns skip_special_tokens off too). The arguments are written as Gemma 4's chat
template writes them back (its `format_argument`): keys bare (or `<|"|>`d), a string between two `<|"|>` (its
text verbatim), `true` / `false`, a number, an object `{key:value,...}`, an array `[value,...]`. Calls follow one
another without separators. What counts as a call, whole or streamed, and how streaming goes, is
FunctionGemma's (functiongemma.py): the same reader with these markers.

The values are typed by how they are written, as vLLM's gemma4 parser types them (at any depth; the request's
tool schemas play no part): a `<|"|>`d string is a string, even when its text reads as JSON (unlike
FunctionGemma's); bare `true` / `false` are booleans, `null` / `none` / `nil` (any case: the template writes
Python's None as `None`) are null, a bare number is an integer, or a float when it has a `.`; any other bare
text is a string. Where ferrox differs: a number in exponent form (`1e-05`, how the template writes small
floats) is a float (vLLM: its text); a float JSON cannot write (`inf`, `1e999`) stays text; text between and
after calls stays content (vLLM keeps only the text before the first call); a reply cut short inside a call
keeps the members that stood (vLLM's whole-text reading drops such a call and returns the reply as content).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.functiongemma import FunctionGemmaToolParser, Syntax

CALL_BEGIN = "<|tool_call>"
CALL_END = "<tool_call|>"
STRING = '<|"|>'
_NULLS = ("null", "none", "nil")


def bare_value(text: str) -> Any:
    """A bare value's text -> its value, by vLLM's gemma4 rule (see the module docstring)."""
    if text in ("true", "false"):
        return text == "true"
    if text.lower() in _NULLS:
        return None
    try:
        if "." not in text and "e" not in text.lower():
            return int(text)
        number = float(text)
    except ValueError:
        return text
    return number if math.isfinite(number) else text


GEMMA4 = Syntax(CALL_BEGIN, CALL_END, STRING, bare=bare_value, escaped_json=False)


class Gemma4ToolParser(FunctionGemmaToolParser):
    name = "gemma4"
    syntax: ClassVar[Syntax] = GEMMA4
