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

A subclass may put the same calls between other markers (`tags`) and name content blocks in which no call
is read (`quiet`): Seed-OSS's `<seed:tool_call>` and `<seed:think>` (seed_oss.py).
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.arguments_json import ArgumentsJson
from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    held_back,
    join_content,
    new_tool_call_id,
)
from ferrox.entrypoints.openai.tool_parsers.scanning import ScanningToolParser

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"
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


class _Arguments(ArgumentsJson):
    """Qwen3-Coder's values sit on lines of their own: one newline after `>` and one before `</parameter>`
    are the format's, not the value's."""

    def prepare(self, key: str, raw: str) -> tuple[str, str]:
        if raw.startswith("\n"):
            raw = raw[1:]
        if raw.endswith("\n"):
            raw = raw[:-1]
        return key.strip(), raw

    def convert(self, text: str, schema: Any) -> Any:
        return convert_parameter(text, schema)


@dataclass(slots=True)
class _Call:
    """What the text after one `<tool_call>` holds: `state` "open" (it may go on), "closed" (the
    call ends at `end`) or "invalid" (no call: the tag is content)."""

    state: str
    name: str | None = None  # known once `<function=NAME>` is complete
    params: list[tuple[str, str]] = field(default_factory=list)  # complete (key, raw value) pairs
    function_closed: bool = False  # no more parameters will come
    end: int = 0


class CallTags:
    """The markers around one call (Qwen3-Coder's `<tool_call>` / `</tool_call>`; Seed-OSS's in seed_oss.py),
    and what the scan derives from them: the tags that may follow a parameter's value."""

    __slots__ = ("open", "close", "after_parameter", "reach")

    def __init__(self, open_tag: str, close_tag: str) -> None:
        self.open, self.close = open_tag, close_tag
        self.after_parameter = (PARAMETER, FUNCTION_END, close_tag)
        # A tag found later starts no earlier than this before the end of the text looked at.
        self.reach = max(len(tag) for tag in self.after_parameter) - 1


QWEN3_CODER_TAGS = CallTags(TOOL_CALL, TOOL_CALL_END)
_AFTER_PARAMETER = QWEN3_CODER_TAGS.after_parameter  # (benches/bench_tool_stream.py's old parser reads it)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _parameter_end(text: str, start: int, final: bool, tags: CallTags) -> int | None:
    """Where the value starting at `start` ends (its `</parameter>`), None when not known (yet)."""
    k = start
    while True:
        close = text.find(PARAMETER_END, k)
        if close < 0:
            return None
        after = _skip_ws(text, close + len(PARAMETER_END))
        if text.startswith(tags.after_parameter, after):
            return close
        if after == len(text):
            return close if final else None
        if not final and any(tag.startswith(text[after:]) for tag in tags.after_parameter):
            return None  # a tag may be arriving
        k = close + 1  # text inside the value


def _scan_call(text: str, start: int, final: bool, tags: CallTags) -> _Call:
    """The call whose opening tag (`<tool_call>`) ends at `start`. `final`: the text is all there is. What is
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
            if text.startswith(tags.close, q):
                return close(q + len(tags.close))
            if not final and tags.close.startswith(text[q:]):
                return call  # complete, but its end tag may be arriving
            return close(p + len(FUNCTION_END))
        if text.startswith(tags.close, p):  # no </function>
            return close(p + len(tags.close))
        if text.startswith(PARAMETER, p):
            key_start = p + len(PARAMETER)
            key_end = text.find(">", key_start)
            if key_end < 0:
                return close(len(text)) if final else call
            value_start = key_end + 1
            value_end = _parameter_end(text, value_start, final, tags)
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
        found = [j for j in (text.find(tag, p) for tag in tags.after_parameter) if j >= 0]
        if not found:
            return close(len(text)) if final else call
        pos = min(found)


# Characters the streaming scan has looked at (finds and whitespace skips). Tests read it
# (chars_examined) to check that streaming a call looks at each character a bounded number of times.
_examined = 0


def chars_examined() -> int:
    return _examined


def _find(text: str, sub: str, start: int) -> int:
    global _examined
    j = text.find(sub, start)
    _examined += (len(text) if j < 0 else j + len(sub)) - start
    return j


def _skip(text: str, i: int) -> int:
    global _examined
    j = _skip_ws(text, i)
    _examined += j - i + 1
    return j


def _find_tag(text: str, start: int, tags: CallTags) -> int:
    """Where the first `<parameter=`, `</function>` or closing tag at or after start begins, or -1."""
    found = [j for j in (_find(text, tag, start) for tag in tags.after_parameter) if j >= 0]
    return min(found) if found else -1


# Where the streaming scan stands. It keeps only the text it still needs (`_buf`), and where in it
# each search has got, so that a delta is looked at once plus at most a tag's length of held-back text.
_CONTENT = 0  # outside calls: `_buf` is a `<tool_call>`'s first characters, held back
_HEADER = 1  # `_buf` starts just after `<tool_call>` (it is content again if no `<function=NAME>` follows)
_BETWEEN = 2  # between parameters: `_buf` starts where the next tag is looked for
_KEY = 3  # `_buf` starts with `<parameter=`; the key's `>` is looked for from `_k`
_VALUE = 4  # in a value: `_vparts` + `_buf[:_k]` is value text; `</parameter>` is looked for from `_k`
_VALUE_CLOSE = 5  # in a value, `_buf` starts with a `</parameter>` that ends it if a tag follows; `_k`: past the blanks after it
_FUNCTION_CLOSED = 6  # `_buf` starts just after `</function>`; `_k`: past the blanks after it
_QUIET = 7  # in a quiet block (content where no call is read): `_buf` is where its closing marker is looked for


class Qwen3CoderToolParser(ScanningToolParser):
    name = "qwen3_coder"
    # The markers around a call (a format with other markers and the same inside: seed_oss.py).
    tags: ClassVar[CallTags] = QWEN3_CODER_TAGS
    # (opening, closing) markers of content blocks in which no call is read (Seed-OSS's thinking); a block
    # left open runs to the end of the text. None: no such blocks.
    quiet: ClassVar[tuple[str, str] | None] = None

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = _CONTENT
        self._k = 0  # how far the current search has got in _buf
        self._name_start: int | None = None  # in _HEADER, once `<function=` is matched
        self._key = ""  # the parameter being read
        self._vparts: list[str] = []  # its value's text so far, less what _buf holds
        self._arguments: _Arguments | None = None  # the open call's, once its name went out
        self._closed_sent = False

    def _next_tag(self, text: str, start: int, find: Callable[[str, str, int], int] = str.find) -> tuple[int, bool]:
        """Where the first call's opening tag or quiet block's opening marker at or after start begins (-1:
        neither), and whether it is a quiet block's."""
        at = find(text, self.tags.open, start)
        if self.quiet is None:
            return at, False
        quiet = find(text, self.quiet[0], start)
        if quiet >= 0 and (at < 0 or quiet < at):
            return quiet, True
        return at, False

    def _held_back(self, text: str) -> int:
        """Content that must wait: the longest end of text that may begin a call's or a quiet block's marker."""
        held = held_back(text, self.tags.open)
        return held if self.quiet is None else max(held, held_back(text, self.quiet[0]))

    def extract(self, text: str) -> ExtractedToolCalls:
        open_tag = self.tags.open
        calls: list[ToolCall] = []
        pieces: list[str] = []
        piece: list[str] = []
        pos = 0
        while True:
            tag, quiet = self._next_tag(text, pos)
            if tag < 0:
                piece.append(text[pos:])
                break
            if quiet:
                assert self.quiet is not None
                opening, closing = self.quiet
                close = text.find(closing, tag + len(opening))
                end = len(text) if close < 0 else close + len(closing)
                piece.append(text[pos:end])
                pos = end
                continue
            piece.append(text[pos:tag])
            pos = tag + len(open_tag)
            call = _scan_call(text, pos, True, self.tags)
            if call.state == "invalid":
                piece.append(open_tag)
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

    def _param(self, out: DeltaMessage, raw: str) -> None:
        assert self._arguments is not None
        fragment = self._arguments.add(self._key, raw)
        if fragment:
            self._send(out, fragment)

    def _function_closed(self, out: DeltaMessage) -> None:
        if not self._closed_sent:
            self._send(out, "}")
            self._closed_sent = True

    def _close_call(self, out: DeltaMessage, rest: str) -> None:
        """The call ends; `rest` is the text after it."""
        self._function_closed(out)
        self._buf, self._state, self._k = rest, _CONTENT, 0
        self._num_calls += 1
        self._arguments = None
        self._closed_sent = False
        self._delta = None

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move of the scan over _buf; False when it needs more text (or, final, is done)."""
        buf, state = self._buf, self._state
        if state == _CONTENT:
            tag, quiet = self._next_tag(buf, 0, _find)
            if tag < 0:
                end = len(buf) if final else len(buf) - self._held_back(buf)
                self._gate.into(out, buf[:end])
                self._buf = buf[end:]
                return False
            if quiet:
                assert self.quiet is not None
                end = tag + len(self.quiet[0])
                self._gate.into(out, buf[:end])
                self._buf, self._state = buf[end:], _QUIET
                return True
            self._gate.into(out, buf[:tag])
            self._buf, self._state, self._k, self._name_start = buf[tag + len(self.tags.open) :], _HEADER, 0, None
            return True
        if state == _QUIET:
            assert self.quiet is not None
            closing = self.quiet[1]
            close = _find(buf, closing, 0)
            if close < 0:
                end = len(buf) if final else len(buf) - held_back(buf, closing)
                self._gate.into(out, buf[:end])
                self._buf = buf[end:]
                return False
            end = close + len(closing)
            self._gate.into(out, buf[:end])
            self._buf, self._state = buf[end:], _CONTENT
            return True
        if state == _HEADER:
            return self._header(out, final)
        if state == _BETWEEN:
            p = _skip(buf, self._k)
            if buf.startswith(FUNCTION_END, p):
                self._function_closed(out)
                self._buf, self._state, self._k = buf[p + len(FUNCTION_END) :], _FUNCTION_CLOSED, 0
                return True
            if buf.startswith(self.tags.close, p):  # no </function>
                self._close_call(out, buf[p + len(self.tags.close) :])
                return True
            if buf.startswith(PARAMETER, p):
                self._buf, self._state, self._k = buf[p:], _KEY, len(PARAMETER)
                return True
            # Anything else between parameters is skipped, up to the next tag.
            tag = _find_tag(buf, p, self.tags)
            if tag < 0:
                if final:
                    self._close_call(out, "")
                    return True
                # Blanks and skipped text are not needed again; a tag may be arriving at the end.
                keep = max(p, len(buf) - self.tags.reach)
                self._buf, self._k = buf[keep:], 0
                return False
            self._buf, self._k = buf[tag:], 0
            return True
        if state == _KEY:
            key_end = _find(buf, ">", self._k)
            if key_end < 0:
                if final:
                    self._close_call(out, "")
                    return True
                self._k = len(buf)
                return False
            self._key = buf[len(PARAMETER) : key_end]
            self._vparts = []
            self._buf, self._state, self._k = buf[key_end + 1 :], _VALUE, 0
            return True
        if state == _VALUE:
            close = _find(buf, PARAMETER_END, self._k)
            if close < 0:
                if final:
                    return self._value_cut(out)
                cut = len(buf) - held_back(buf[self._k :], PARAMETER_END)
                self._vparts.append(buf[:cut])
                self._buf, self._k = buf[cut:], 0
                return False
            self._vparts.append(buf[:close])
            self._buf, self._state, self._k = buf[close:], _VALUE_CLOSE, len(PARAMETER_END)
            return True
        if state == _VALUE_CLOSE:
            after = self._k = _skip(buf, self._k)
            after_parameter = self.tags.after_parameter
            if buf.startswith(after_parameter, after) or (final and after == len(buf)):
                self._param(out, "".join(self._vparts))
                self._vparts = []
                self._buf, self._state, self._k = buf[len(PARAMETER_END) :], _BETWEEN, 0
                return True
            if after == len(buf) or (not final and any(tag.startswith(buf[after:]) for tag in after_parameter)):
                return False  # a tag may be arriving
            # Text inside the value: the `</parameter>` and the blanks after it are part of it.
            self._vparts.append(buf[:after])
            self._buf, self._state, self._k = buf[after:], _VALUE, 0
            return True
        assert state == _FUNCTION_CLOSED
        q = self._k = _skip(buf, self._k)
        if buf.startswith(self.tags.close, q):
            self._close_call(out, buf[q + len(self.tags.close) :])
            return True
        if not final and self.tags.close.startswith(buf[q:]):
            return False  # complete, but its end tag may be arriving
        self._close_call(out, buf)
        return True

    def _header(self, out: DeltaMessage, final: bool) -> bool:
        buf = self._buf
        if self._name_start is None:
            i = self._k = _skip(buf, self._k)
            if not buf.startswith(FUNCTION, i):
                if not final and FUNCTION.startswith(buf[i:]):
                    return False
                return self._not_a_call(out)
            self._name_start = self._k = i + len(FUNCTION)
        gt = _find(buf, ">", self._k)
        if any(c in _NOT_IN_NAME for c in buf[self._k : gt if gt >= 0 else len(buf)]):
            return self._not_a_call(out)
        if gt < 0:
            if final:
                return self._not_a_call(out)
            self._k = len(buf)
            return False
        name = buf[self._name_start : gt]
        if not name:
            return self._not_a_call(out)
        self._gate.call()
        self.tools_called = True
        self._arguments = _Arguments(self.function_parameters(name))
        self._delta = DeltaToolCall(self._num_calls, id=new_tool_call_id(), name=name, arguments="{")
        out.tool_calls.append(self._delta)
        self._buf, self._state, self._k = buf[gt + 1 :], _BETWEEN, 0
        return True

    def _not_a_call(self, out: DeltaMessage) -> bool:
        """The `<tool_call>` starts no call: it is content, and the scan goes on after it."""
        self._gate.into(out, self.tags.open)
        self._state, self._k = _CONTENT, 0
        return True

    def _value_cut(self, out: DeltaMessage) -> bool:
        """The end of the text in a value that no `</parameter>` closed: it stops at the first
        `</function>` in it, else runs to the end (cut short)."""
        value = "".join(self._vparts) + self._buf
        self._vparts = []
        function_end = _find(value, FUNCTION_END, 0)
        if function_end >= 0:
            self._param(out, value[:function_end])
            self._buf, self._state, self._k = value[function_end:], _BETWEEN, 0
            return True
        self._param(out, value[: len(value) - held_back(value, PARAMETER_END)])
        self._close_call(out, "")
        return True
