"""Pythonic calls (Llama 3.2 / Llama 4, ToolACE): the whole reply is a Python list of calls with
keyword arguments, `[get_weather(city="Paris", days=3), get_time()]`, optionally between Llama 4's
`<|python_start|>` / `<|python_end|>`. Argument values must be literals (strings, numbers, True /
False / None, lists, tuples, dicts of those); each call's arguments are their JSON. Any other reply
(text, a list that is not all such calls, text after the list) is content.

Since only the whole reply decides, streaming holds the text while it can still become a call list
and sends the calls at the end; as soon as it cannot (a reply that starts with a word, or with
"[1]"), what was held goes out as content and the rest streams as it comes.
"""

from __future__ import annotations

import ast
import json
import warnings
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
)

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_WS = " \t\r\n"


def _parse_call(source: str) -> ToolCall | None:
    """`name(key=literal, ...)` -> ToolCall; None for anything else."""
    try:
        with warnings.catch_warnings():  # model text with "\q" in a string: Python warns of the escape
            warnings.simplefilter("ignore")
            node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):  # a set, bytes, complex, NaN...
        return None
    return ToolCall(name=node.func.id, arguments=text)


class _ListScanner:
    """Reads the reply a character at a time (resuming where it stopped), tracking brackets and
    string literals just enough to find each call's text; ast checks each call as it closes."""

    def __init__(self) -> None:
        self.i = 0
        self.state = "lead"  # lead, item, name, paren, args, sep, after
        self.error = False
        self.calls: list[ToolCall] = []
        self._call_start = 0
        self._depth = 0
        self._quote = ""  # the open string literal's quote, "" outside strings
        self._start_seen = False
        self._end_seen = False

    def advance(self, text: str, final: bool) -> None:
        """Read on to the end of `text` (or to where it cannot tell yet); `final`: nothing follows,
        so a reply that is not a whole call list is an error."""
        i, n = self.i, len(text)
        while i < n and not self.error:
            c, state = text[i], self.state
            if state == "args":
                i = self._args(text, i, final)
                if i < 0:  # cannot tell yet
                    i = -i - 1
                    break
                continue
            if c in _WS and state != "name":
                i += 1
            elif state == "lead":
                if not self._start_seen and text.startswith(PYTHON_START, i):
                    self._start_seen = True
                    i += len(PYTHON_START)
                elif not self._start_seen and PYTHON_START.startswith(text[i:]) and not final:
                    break
                elif c == "[":
                    self.state, i = "item", i + 1
                else:
                    self.error = True
            elif state == "item":
                if c == "]" and self.calls:  # (a trailing comma is fine, an empty list is not a call)
                    self.state, i = "after", i + 1
                elif c.isalpha() or c == "_":
                    self.state, self._call_start, i = "name", i, i + 1
                else:
                    self.error = True
            elif state == "name":
                if c.isalnum() or c == "_":
                    i += 1
                else:
                    self.state = "paren"
            elif state == "paren":
                if c == "(":
                    self.state, self._depth, i = "args", 1, i + 1
                else:
                    self.error = True
            elif state == "sep":
                if c in ",]":
                    self.state, i = ("item" if c == "," else "after"), i + 1
                else:
                    self.error = True
            else:  # after the list: only Llama 4's end marker may follow
                if not self._end_seen and text.startswith(PYTHON_END, i):
                    self._end_seen = True
                    i += len(PYTHON_END)
                elif not self._end_seen and PYTHON_END.startswith(text[i:]) and not final:
                    break
                else:
                    self.error = True
        self.i = i
        if final and self.state != "after":
            self.error = True

    def _args(self, text: str, i: int, final: bool) -> int:
        """One step inside a call's parentheses; the next index, or -(i + 1) to wait at i."""
        c = text[i]
        if self._quote:
            if c == "\\":
                return i + 2 if i + 1 < len(text) else -(i + 1)
            if text.startswith(self._quote, i):
                i += len(self._quote)
                self._quote = ""
                return i
            if len(self._quote) == 3 and self._quote.startswith(text[i:]) and not final:
                return -(i + 1)
            return i + 1
        if c in "\"'":
            if text.startswith(c * 3, i):
                self._quote = c * 3
                return i + 3
            if (c * 3).startswith(text[i:]) and not final:
                return -(i + 1)  # "" or """?
            self._quote = c
            return i + 1
        if c in "([{":
            self._depth += 1
        elif c in ")]}":
            self._depth -= 1
            if self._depth == 0:
                call = _parse_call(text[self._call_start : i + 1])
                if call is None:
                    self.error = True
                else:
                    self.calls.append(call)
                    self.state = "sep"
        return i + 1


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._scanner = _ListScanner()
        self._content = False  # the reply turned out not to be a call list

    def extract(self, text: str) -> ExtractedToolCalls:
        scanner = _ListScanner()
        scanner.advance(text, final=True)
        if scanner.error:
            return ExtractedToolCalls(content=text.strip() or None, tool_calls=[])
        return ExtractedToolCalls(content=None, tool_calls=scanner.calls)

    def feed(self, delta: str) -> DeltaMessage:
        if self._content:
            return DeltaMessage(content=delta or None)
        self._text += delta
        self._scanner.advance(self._text, final=False)
        if self._scanner.error:
            self._content = True
            return DeltaMessage(content=self._text or None)
        return DeltaMessage()

    def finish(self) -> DeltaMessage:
        if self._content:
            return DeltaMessage()
        self._scanner.advance(self._text, final=True)
        if self._scanner.error:
            self._content = True
            return DeltaMessage(content=self._text or None)
        self.tools_called = True
        return DeltaMessage(
            tool_calls=[
                DeltaToolCall(k, id=call.id, name=call.name, arguments=call.arguments)
                for k, call in enumerate(self._scanner.calls)
            ]
        )
