"""MiniMax-M2's tool calls (`minimax_m2`, vLLM's name for MiniMax-M2 / M2.1 / M2.5): a block of invokes,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    <invoke name="get_time">
    </invoke>
    </minimax:tool_call>

Names may be quoted ("..." or '...') or bare. A value is the text up to the first `</parameter>`, stripped of
the blanks around it, and typed by the request's tools as vLLM's parser types it (convert_value): the types
the parameter's schema allows (`type`, a list of types, the types of its `enum` values, `anyOf` / `oneOf` /
`allOf`; string when it says none) are tried in the order integer, number, boolean (true/1/yes/on,
false/0/no/off), object / array (JSON), string; a value none of them reads is JSON when it parses, else
text. `null`, `none` and `nil` (any case) are null, as in vLLM -- except for a parameter whose schema allows
only strings, whose text stays (a string stays a string). The arguments are the JSON object of the values,
keys in the order written (a repeated key keeps its first value).

What counts as a call, the same whole or streamed:
- a block starts a call only when an `<invoke name=...>` with a valid name follows its marker (after blanks);
  otherwise the marker is content, and so is what follows it;
- after a call, the block holds blanks and further invokes up to `</minimax:tool_call>`; anything else ends the
  block there and is content (ferrox keeps text after the calls, as its other parsers do; vLLM drops it);
- inside an invoke, text that is no tag is skipped, as vLLM reads only the tags; a parameter whose
  `</parameter>` does not come before the `</invoke>` (or the block's end, or the end of the reply) is dropped;
- a call stands once its header is complete, also when the reply is cut short after it (it then holds the
  parameters that were complete), as vLLM's streaming sends it.

Streaming sends a call's id and name (with `{`) at its header, each parameter once its `</parameter>` has
arrived, and `}` at its `</invoke>`: the pieces joined are the `arguments` extract() gives for the same
text. Content streams as it comes, but for the first characters of a block marker, held back until the next
delta says whether it is one.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.arguments_json import ArgumentsJson
from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    held_back,
    new_tool_call_id,
)
from ferrox.entrypoints.openai.tool_parsers.marked_calls import skip_ws, valid_name
from ferrox.entrypoints.openai.tool_parsers.scanning import ScanningToolParser

BLOCK_BEGIN = "<minimax:tool_call>"
BLOCK_END = "</minimax:tool_call>"
INVOKE = "<invoke name="
INVOKE_END = "</invoke>"
PARAMETER = "<parameter name="
PARAMETER_END = "</parameter>"
# What may come next inside an invoke; the first of the last three also ends a value.
_IN_INVOKE = (PARAMETER, INVOKE_END, BLOCK_END)
_ENDS_VALUE = (PARAMETER_END, INVOKE_END, BLOCK_END)
_TAG_REACH = max(len(tag) for tag in _IN_INVOKE) - 1  # a tag arriving split starts at most this far before the end

# Type names as vLLM's minimax_m2 parser reads them, in the order it tries them.
_STRING_TYPES = frozenset({"string", "str", "text"})
_TYPE_ORDER = ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str", "text")
_NULLS = ("null", "none", "nil")
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _declared_types(schema: Any) -> set[str]:
    """The types a parameter's schema allows (lower case), read as vLLM reads them; empty when it says none."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    declared = schema.get("type")
    for t in declared if isinstance(declared, list) else [declared]:
        if isinstance(t, str):
            types.add(t.lower())
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        types.add("null" if value is None else "boolean" if isinstance(value, bool) else "integer"
                  if isinstance(value, int) else "number" if isinstance(value, float) else "string"
                  if isinstance(value, str) else "array" if isinstance(value, list) else "object"
                  if isinstance(value, dict) else "string")
    for key in ("anyOf", "oneOf", "allOf"):
        choices = schema.get(key)
        for choice in choices if isinstance(choices, list) else []:
            types |= _declared_types(choice) or {"string"}  # a choice that says nothing is a string (vLLM)
    return types


def _json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text)
    except (ValueError, RecursionError):
        return False, None


def convert_value(text: str, schema: Any) -> Any:
    """A parameter's text (stripped) -> its value, typed by the parameter's JSON schema (None: not described)."""
    declared = _declared_types(schema)
    types = declared or {"string"}
    if text.lower() in _NULLS and not (declared and declared <= _STRING_TYPES):
        return None
    for kind in _TYPE_ORDER:
        if kind not in types:
            continue
        if kind in _STRING_TYPES:
            return text
        if kind in ("integer", "int"):
            try:
                return int(text)
            except ValueError:
                continue
        if kind in ("number", "float"):
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() else number
            continue
        if kind in ("boolean", "bool"):
            flag = text.lower()
            if flag in _TRUE or flag in _FALSE:
                return flag in _TRUE
            continue
        ok, value = _json(text)  # object / array
        if ok:
            return value
    ok, value = _json(text)
    return value if ok else text


def _unquote(text: str) -> str:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _first_tag(text: str, tags: tuple[str, ...], start: int) -> tuple[int, str | None]:
    """Where the first of `tags` at or after start begins, and which; (-1, None) when none does."""
    found = [(at, tag) for tag in tags if (at := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, None)


class _Arguments(ArgumentsJson):
    """MiniMax-M2's values: the text between the tags, stripped, typed by the schema (convert_value)."""

    def prepare(self, key: str, raw: str) -> tuple[str, str]:
        return key, raw.strip()

    def convert(self, text: str, schema: Any) -> Any:
        return convert_value(text, schema)


# Where the scan stands. `_buf` holds only the text still needed; `_k` is how far a search in it has got.
_TEXT = 0  # content: `_buf` is the text not sent yet (a block marker's first characters, held back)
_BLOCK = 1  # in a block, before an invoke or the block's end; `_buf` is where content resumes if none comes
_HEADER = 2  # `_buf` as in _BLOCK; the name after `<invoke name=` starts at `_name_start`
_PARAMS = 3  # in an invoke, between parameters
_KEY = 4  # `_buf` starts just after `<parameter name=`
_VALUE = 5  # in a value: `_vparts` + `_buf[:_k]` is its text so far


class MinimaxM2ToolParser(ScanningToolParser):
    name = "minimax_m2"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = _TEXT
        self._k = 0
        self._name_start = 0
        # The block marker, while its block holds no call yet: content again if no call follows it.
        self._fallback = ""
        self._key = ""
        self._vparts: list[str] = []
        self._arguments: _Arguments | None = None  # the open call's

    # ---- the reader ------------------------------------------------------------------------------

    def _close_call(self, out: DeltaMessage, rest: str, state: int) -> bool:
        """The open call ends; `rest` is the text after it, read in `state`."""
        self._send(out, "}")
        self._num_calls += 1
        self._arguments, self._delta = None, None
        self._buf, self._state, self._k = rest, state, 0
        return True

    def _no_call(self, out: DeltaMessage) -> bool:
        """What follows is no call: the block's marker (when the block holds no call) and `_buf` are content."""
        self._gate.into(out, self._fallback)
        self._fallback, self._state, self._k = "", _TEXT, 0
        return True

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move over `_buf`; False when it needs more text (or, final, is done)."""
        buf, state = self._buf, self._state
        if state == _TEXT:
            at = buf.find(BLOCK_BEGIN)
            if at < 0:
                end = len(buf) if final else len(buf) - held_back(buf, BLOCK_BEGIN)
                self._gate.into(out, buf[:end])
                self._buf = buf[end:]
                return False
            self._gate.into(out, buf[:at])
            self._buf, self._state, self._fallback = buf[at + len(BLOCK_BEGIN) :], _BLOCK, BLOCK_BEGIN
            return True
        if state == _BLOCK:
            i = skip_ws(buf, 0)
            if buf.startswith(INVOKE, i):
                self._state, self._name_start = _HEADER, i + len(INVOKE)
                self._k = self._name_start
                return True
            if buf.startswith(BLOCK_END, i) and not self._fallback:
                self._buf, self._state = buf[i + len(BLOCK_END) :], _TEXT
                return True
            rest = buf[i:]
            if not final and (INVOKE.startswith(rest) or BLOCK_END.startswith(rest)):
                return False  # a tag may be arriving
            if not rest and not self._fallback:  # the reply ends in a block after its calls
                self._buf, self._state = "", _TEXT
                return True
            return self._no_call(out)
        if state == _HEADER:
            gt = buf.find(">", self._k)
            arrived = buf[self._k : gt if gt >= 0 else len(buf)]  # the name's text not looked at yet
            if "<" in arrived or "\n" in arrived:
                return self._no_call(out)
            if gt < 0:
                if final:
                    return self._no_call(out)
                self._k = len(buf)
                return False
            name = _unquote(buf[self._name_start : gt])
            if not valid_name(name):
                return self._no_call(out)
            self._gate.call()
            self.tools_called = True
            self._fallback = ""
            self._arguments = _Arguments(self.function_parameters(name))
            self._delta = DeltaToolCall(self._num_calls, id=new_tool_call_id(), name=name, arguments="{")
            out.tool_calls.append(self._delta)
            self._buf, self._state, self._k = buf[gt + 1 :], _PARAMS, 0
            return True
        if state == _PARAMS:
            i = skip_ws(buf, 0)
            if buf.startswith(PARAMETER, i):
                self._buf, self._state, self._k = buf[i + len(PARAMETER) :], _KEY, 0
                return True
            if buf.startswith(INVOKE_END, i):
                return self._close_call(out, buf[i + len(INVOKE_END) :], _BLOCK)
            if buf.startswith(BLOCK_END, i):
                return self._close_call(out, buf[i + len(BLOCK_END) :], _TEXT)
            rest = buf[i:]
            if not final and any(tag.startswith(rest) for tag in _IN_INVOKE):
                return False  # a tag may be arriving
            # Text that is no tag is skipped, up to the next tag.
            at, _ = _first_tag(buf, _IN_INVOKE, i)
            if at < 0:
                if final:  # cut short inside the invoke
                    return self._close_call(out, "", _TEXT)
                self._buf = buf[max(i, len(buf) - _TAG_REACH) :]
                return False
            self._buf = buf[at:]
            return True
        if state == _KEY:
            gt = buf.find(">", self._k)
            lt = buf.find("<", self._k, gt if gt >= 0 else len(buf))
            if lt >= 0:  # no key: the `<parameter name=` is skipped, the tag after it read
                self._buf, self._state = buf[lt:], _PARAMS
                return True
            if gt < 0:
                if final:
                    return self._close_call(out, "", _TEXT)
                self._k = len(buf)
                return False
            self._key, self._vparts = _unquote(buf[:gt]), []
            self._buf, self._state, self._k = buf[gt + 1 :], _VALUE, 0
            return True
        assert state == _VALUE
        at, tag = _first_tag(buf, _ENDS_VALUE, self._k)
        if tag is None:
            if final:  # the parameter never closed: dropped
                return self._close_call(out, "", _TEXT)
            cut = len(buf) - max(held_back(buf[self._k :], t) for t in _ENDS_VALUE)
            self._vparts.append(buf[:cut])
            self._buf, self._k = buf[cut:], 0
            return False
        rest = buf[at + len(tag) :]
        if tag == PARAMETER_END:
            assert self._arguments is not None
            fragment = self._arguments.add(self._key, "".join(self._vparts) + buf[:at])
            if fragment:
                self._send(out, fragment)
            self._vparts = []
            self._buf, self._state, self._k = rest, _PARAMS, 0
            return True
        self._vparts = []  # the invoke (or block) ended inside the value: the parameter is dropped
        return self._close_call(out, rest, _BLOCK if tag == INVOKE_END else _TEXT)
