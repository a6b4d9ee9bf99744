"""Qwen3-Coder's XML-ish calls: each is

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

Values are bare text (code, often over many lines), so a value's type comes from the request's
tools: the parameter's JSON schema says integer, number, boolean, object/array (JSON, or a Python
literal), null or string; a parameter the schema does not type is read as JSON when it parses, else
kept as text. The arguments string is the JSON of those values, keys in the order written (a
repeated key keeps its first value).

A `</parameter>` ends a value only when the next thing after it is a tag (`<parameter=`,
`</function>`, `</tool_call>`) or the end of the text, so a value may hold the tags itself. A call
whose function header is complete stands even if the text is cut short after it, as in vLLM: the
value being written runs to the end. Streaming sends a call's id and name at its header, then each
parameter once its value is complete, then the closing brace.
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    ContentGate,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    held_back,
    join_content,
    new_tool_call_id,
)

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
_AFTER_PARAMETER = (PARAMETER, FUNCTION_END, TOOL_CALL_END)
_WS = " \t\r\n"
_NOT_IN_NAME = frozenset(_WS + "{}<>\"'")

# Type names as vLLM's qwen3_coder parser reads them (models and schemas use loose spellings).
_STRING_TYPES = frozenset({"string", "str", "text", "varchar", "char", "enum"})
_BOOLEAN_TYPES = frozenset({"boolean", "bool", "binary"})
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
_NUMBER_PREFIXES = ("num", "float", "double")
_CONTAINER_TYPES = frozenset({"object", "array", "arr"})
_CONTAINER_PREFIXES = ("dict", "list")


def _declared_type(schema: Any) -> tuple[str | None, bool]:
    """(the first non-null type the schema declares, or None; whether null is allowed)."""
    if not isinstance(schema, dict):
        return None, False
    raw: list[Any] = []
    declared = schema.get("type")
    if declared is not None:
        raw = declared if isinstance(declared, list) else [declared]
    else:
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            for option in options if isinstance(options, list) else []:
                if isinstance(option, dict) and option.get("type") is not None:
                    t = option["type"]
                    raw += t if isinstance(t, list) else [t]
    types = [t.strip().lower() for t in raw if isinstance(t, str)]
    enum = schema.get("enum")
    if not types and isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        types = ["string"]  # {"enum": ["1", "2"]}: the values are text
    nullable = "null" in types
    others = [t for t in types if t != "null"]
    return (others[0] if others else ("null" if nullable else None)), nullable


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


def _number(value: str) -> Any:
    text = value.strip()
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return value
    if not math.isfinite(number):
        return value
    return int(number) if number.is_integer() else number


def _container(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:  # a Python literal ({'a': 1}, [True, None]) is a common slip
        return ast.literal_eval(value.strip())
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return value


def convert_parameter(value: str, schema: Any) -> Any:
    """A parameter's text -> the value its JSON schema declares; the text itself when it does not
    read as that type."""
    kind, nullable = _declared_type(schema)
    if kind is None:
        return _json_or_text(value)
    if value.strip().lower() in ("null", "none") and (nullable or kind not in _STRING_TYPES):
        return None
    if kind in _STRING_TYPES or kind == "null":
        return value
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(value.strip())
        except ValueError:
            return value
    if kind.startswith(_NUMBER_PREFIXES):
        return _number(value)
    if kind in _BOOLEAN_TYPES:
        flag = value.strip().lower()
        return flag == "true" if flag in ("true", "false") else value
    if kind in _CONTAINER_TYPES or kind.startswith(_CONTAINER_PREFIXES):
        return _container(value)
    return _json_or_text(value)


class _Arguments:
    """Builds one call's arguments JSON text a parameter at a time: '{' + fragments + '}' is what
    json.dumps(dict, ensure_ascii=False) gives for the same keys and values."""

    def __init__(self, properties: dict[str, Any]) -> None:
        self._properties = properties
        self._keys: set[str] = set()

    def add(self, key: str, raw: str) -> str:
        """The fragment for one parameter ("" for a repeated key)."""
        key = key.strip()
        if key in self._keys:
            return ""
        if raw.startswith("\n"):  # the format puts the value on lines of its own
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        value = convert_parameter(raw, self._properties.get(key))
        try:
            value_json = json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # a set, bytes, NaN...: keep the text
            value_json = json.dumps(raw, ensure_ascii=False)
        fragment = ("" if not self._keys else ", ") + json.dumps(key, ensure_ascii=False) + ": " + value_json
        self._keys.add(key)
        return fragment


@dataclass(slots=True)
class _Call:
    """What the text after one `<tool_call>` holds: `state` "open" (it may go on), "closed" (the
    call ends at `end`) or "invalid" (no call: the tag is content)."""

    state: str
    name: str | None = None  # known once `<function=NAME>` is complete
    params: list[tuple[str, str]] = field(default_factory=list)  # complete (key, raw value) pairs
    function_closed: bool = False  # no more parameters will come
    end: int = 0


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _parameter_end(text: str, start: int, final: bool) -> int | None:
    """Where the value starting at `start` ends (its `</parameter>`), None when not known (yet)."""
    k = start
    while True:
        close = text.find(PARAMETER_END, k)
        if close < 0:
            return None
        after = _skip_ws(text, close + len(PARAMETER_END))
        if text.startswith(_AFTER_PARAMETER, after):
            return close
        if after == len(text):
            return close if final else None
        if not final and any(tag.startswith(text[after:]) for tag in _AFTER_PARAMETER):
            return None  # a tag may be arriving
        k = close + 1  # text inside the value


def _scan_call(text: str, start: int, final: bool) -> _Call:
    """The call whose `<tool_call>` ends at `start`. `final`: the text is all there is. What is
    decided on a prefix (not final) holds for every longer text, so streaming and extract() agree."""
    i = _skip_ws(text, start)
    if not text.startswith(FUNCTION, i):
        return _Call("open" if not final and FUNCTION.startswith(text[i:]) else "invalid")
    name_start = i + len(FUNCTION)
    gt = text.find(">", name_start)
    name = text[name_start : gt if gt >= 0 else len(text)]
    if any(c in _NOT_IN_NAME for c in name) or (gt >= 0 and not name):
        return _Call("invalid")
    if gt < 0:
        return _Call("invalid" if final else "open")
    call = _Call("open", name=name)

    def close(end: int) -> _Call:
        call.state, call.end, call.function_closed = "closed", end, True
        return call

    pos = gt + 1
    while True:
        p = _skip_ws(text, pos)
        if text.startswith(FUNCTION_END, p):
            call.function_closed = True
            q = _skip_ws(text, p + len(FUNCTION_END))
            if text.startswith(TOOL_CALL_END, q):
                return close(q + len(TOOL_CALL_END))
            if not final and TOOL_CALL_END.startswith(text[q:]):
                return call  # complete, but its end tag may be arriving
            return close(p + len(FUNCTION_END))
        if text.startswith(TOOL_CALL_END, p):  # no </function>
            return close(p + len(TOOL_CALL_END))
        if text.startswith(PARAMETER, p):
            key_start = p + len(PARAMETER)
            key_end = text.find(">", key_start)
            if key_end < 0:
                return close(len(text)) if final else call
            value_start = key_end + 1
            value_end = _parameter_end(text, value_start, final)
            if value_end is not None:
                call.params.append((text[key_start:key_end], text[value_start:value_end]))
                pos = value_end + len(PARAMETER_END)
                continue
            if not final:
                return call
            # No </parameter>: the value stops at </function>, or runs to the end (cut short).
            function_end = text.find(FUNCTION_END, value_start)
            if function_end >= 0:
                call.params.append((text[key_start:key_end], text[value_start:function_end]))
                pos = function_end
                continue
            value = text[value_start : len(text) - held_back(text[value_start:], PARAMETER_END)]
            call.params.append((text[key_start:key_end], value))
            return close(len(text))
        # Anything else between parameters is skipped, up to the next tag.
        found = [j for j in (text.find(tag, p) for tag in _AFTER_PARAMETER) if j >= 0]
        if not found:
            return close(len(text)) if final else call
        pos = min(found)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0  # everything before it has been sent or dropped
        self._call_start: int | None = None  # just past the <tool_call> being read
        self._num_calls = 0
        self._gate = ContentGate()
        self._arguments: _Arguments | None = None  # the open call's, once its name went out
        self._params_sent = 0
        self._closed_sent = False

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        piece: list[str] = []
        pos = 0
        while True:
            tag = text.find(TOOL_CALL, pos)
            if tag < 0:
                piece.append(text[pos:])
                break
            piece.append(text[pos:tag])
            pos = tag + len(TOOL_CALL)
            call = _scan_call(text, pos, final=True)
            if call.state == "invalid":
                piece.append(TOOL_CALL)
                continue
            pieces.append("".join(piece))
            piece = []
            assert call.name is not None
            arguments = _Arguments(self.function_parameters(call.name))
            body = "".join(arguments.add(key, raw) for key, raw in call.params)
            calls.append(ToolCall(name=call.name, arguments="{" + body + "}"))
            pos = call.end
        pieces.append("".join(piece))
        return ExtractedToolCalls(content=join_content(pieces), tool_calls=calls)

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> DeltaMessage:
        return self._advance(final=True)

    def _content(self, out: DeltaMessage, text: str) -> None:
        text = self._gate.text(text)
        if text:
            out.content = (out.content or "") + text

    def _advance(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        text = self._text
        while True:
            if self._call_start is None:
                tag = text.find(TOOL_CALL, self._pos)
                if tag < 0:
                    end = len(text) if final else len(text) - held_back(text[self._pos :], TOOL_CALL)
                    self._content(out, text[self._pos : end])
                    self._pos = end
                    return out
                self._content(out, text[self._pos : tag])
                self._call_start = self._pos = tag + len(TOOL_CALL)
                continue
            call = _scan_call(text, self._call_start, final)
            if call.state == "invalid":
                self._content(out, TOOL_CALL)  # not a call after all: scan on after the tag
                self._call_start = None
                continue
            self._stream(out, call)
            if call.state == "open":
                return out
            self._pos = call.end
            self._call_start = None
            self._num_calls += 1
            self._arguments = None
            self._params_sent = 0
            self._closed_sent = False

    def _stream(self, out: DeltaMessage, call: _Call) -> None:
        if call.name is None:
            return
        fragment = ""
        first = self._arguments is None
        if self._arguments is None:
            self._gate.call()
            self.tools_called = True
            self._arguments = _Arguments(self.function_parameters(call.name))
            fragment = "{"
        for key, raw in call.params[self._params_sent :]:
            fragment += self._arguments.add(key, raw)
        self._params_sent = len(call.params)
        if call.function_closed and not self._closed_sent:
            fragment += "}"
            self._closed_sent = True
        if first:
            out.tool_calls.append(DeltaToolCall(self._num_calls, id=new_tool_call_id(), name=call.name, arguments=fragment))
        elif fragment:
            out.tool_calls.append(DeltaToolCall(self._num_calls, arguments=fragment))
