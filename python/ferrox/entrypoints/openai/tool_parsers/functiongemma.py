"""FunctionGemma's tool calls (`functiongemma`, vLLM's name; google/functiongemma-270m-it, a Gemma 3 270M):

    <start_function_call>call:get_weather{city:<escape>Paris<escape>,days:3,opts:{unit:<escape>C<escape>}}<end_function_call>

The arguments are written as FunctionGemma's chat template writes them back (its `format_argument`): keys
bare, a string between two `<escape>` tokens (its text verbatim: there is no escaping inside), `true` /
`false`, a number as is, an object `{key:value,...}`, an array `[value,...]`. Several calls follow one
another. The markers and `<escape>` are special tokens of FunctionGemma's tokenizer, so the reply must keep
them (vLLM's parser turns skip_special_tokens off too).

The values, as vLLM's parser reads them where it reads them at all: a top-level `<escape>`d string whose text
is JSON is that JSON value (`count:<escape>42<escape>` -> 42), unless the request's tools let the parameter
be a string (then the text stays a string). Where ferrox reads more than vLLM, which takes only the
`key:<escape>text<escape>` pairs (at any depth, all as top-level keys): a bare value is JSON when it reads
as JSON (numbers, true, false, null), else its text; objects and arrays are read as such, and an `<escape>`d
string inside them stays a string; a key may be `<escape>`d; blanks between the parts are skipped. The
arguments are the JSON object of the values, keys in the order written (a repeated key keeps its first
value: a stream cannot take back a sent one; vLLM keeps the last). A name is any text without blanks,
quotes, `<`, `>`, `{`, `}` (vLLM: `\\w+`).

What counts as a call, the same whole or streamed:
- `<start_function_call>`, blanks, `call:`, a valid name and `{` open a call; otherwise the marker is content
  and so is what follows it;
- a member (`key:value`) stands once its `,` or the object's `}` has arrived; one that does not read ends
  the call there, and the rest of it, up to its `<end_function_call>` (or the next call's marker, or the end
  of the reply), is dropped (vLLM skips text that is no `key:<escape>text<escape>` pair and reads the pairs
  after it; ferrox stops, as what follows a broken member cannot be told apart from its text);
- the call ends at the arguments' `}`, and the `<end_function_call>` after it (blanks between) is part of it;
- a reply cut short inside the arguments keeps the call with the members that had stood (vLLM reads the
  complete pairs of such a call too);
- text around the calls stays content (ferrox keeps text between and after calls, as its other parsers do;
  vLLM keeps only the text before the first call).

Streaming sends a call's id and name (with `{`) once its `{` has arrived, each member as it stands, and `}`
at the arguments' end: the pieces joined are the `arguments` extract() gives for the same text. Content
streams as it comes, but for the first characters of a marker, held back until the next delta says
whether it is one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.arguments_json import ArgumentsJson
from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    held_back,
    new_tool_call_id,
)
from ferrox.entrypoints.openai.tool_parsers.marked_calls import skip_ws, valid_name
from ferrox.entrypoints.openai.tool_parsers.scanning import ScanningToolParser

CALL_BEGIN = "<start_function_call>"
CALL_END = "<end_function_call>"
ESCAPE = "<escape>"
CALL_PREFIX = "call:"
_BARE_ENDS = ",}]"  # what ends a bare value (a number, true, false, null or plain text)


def _json_or_text(text: str) -> Any:
    ok, value = _json_value(text)
    return value if ok else text


@dataclass(frozen=True, slots=True)
class Syntax:
    """The markers of a FunctionGemma-style format and how it is typed (Gemma 4's is the same with other tokens:
    gemma4.py)."""

    begin: str
    end: str
    escape: str  # the string delimiter
    bare: Callable[[str], Any]  # a bare value's text -> its value
    # A top-level `escape`d string whose text is JSON is that JSON, unless the tool's schema allows a string.
    escaped_json: bool

    @property
    def markers(self) -> tuple[str, str, str]:
        return self.escape, self.end, self.begin


FUNCTIONGEMMA = Syntax(CALL_BEGIN, CALL_END, ESCAPE, bare=_json_or_text, escaped_json=True)


class _Unreadable(Exception):
    """The member's text is not FunctionGemma's argument syntax."""


def _json_value(text: str) -> tuple[bool, Any]:
    """text as JSON, when it reads and JSON can write it back (no NaN / Infinity)."""
    try:
        value = json.loads(text)
        json.dumps(value, allow_nan=False)
    except (ValueError, RecursionError):
        return False, None
    return True, value


class _ValueReader:
    """Reads one complete value (or `key:value` member) of FunctionGemma's argument syntax."""

    def __init__(self, text: str, syntax: Syntax) -> None:
        self.text = text
        self.i = 0
        self.escape = syntax.escape
        self.bare = syntax.bare

    def member(self) -> tuple[str, Any, bool]:
        """`key:value` that is the whole text -> key, value, and whether the value was an `<escape>`d string."""
        key = self._key(":")
        self.i += 1
        self._ws()
        escaped = self.text.startswith(self.escape, self.i)
        value = self.value()
        if skip_ws(self.text, self.i) != len(self.text):
            raise _Unreadable
        return key, value, escaped

    def value(self) -> Any:
        text = self.text
        self._ws()
        if text.startswith(self.escape, self.i):
            end = text.find(self.escape, self.i + len(self.escape))
            if end < 0:
                raise _Unreadable
            value = text[self.i + len(self.escape) : end]
            self.i = end + len(self.escape)
            self._ws()
            return value
        if text.startswith("{", self.i):
            return self._object()
        if text.startswith("[", self.i):
            return self._array()
        start = self.i
        while self.i < len(text) and text[self.i] not in _BARE_ENDS:
            self.i += 1
        bare = text[start : self.i].strip()
        if not bare or any(c in bare for c in "{[<"):
            raise _Unreadable
        return self.bare(bare)

    def _object(self) -> dict[str, Any]:
        self.i += 1  # the `{`
        obj: dict[str, Any] = {}
        self._ws()
        if self._take("}"):
            return obj
        while True:
            key = self._key(":")
            self.i += 1
            obj[key] = self.value()
            self._ws()
            if self._take("}"):
                return obj
            if not self._take(","):
                raise _Unreadable

    def _array(self) -> list[Any]:
        self.i += 1  # the `[`
        items: list[Any] = []
        self._ws()
        if self._take("]"):
            return items
        while True:
            items.append(self.value())
            self._ws()
            if self._take("]"):
                return items
            if not self._take(","):
                raise _Unreadable

    def _key(self, end: str) -> str:
        """A key (bare or `<escape>`d), up to `end`, which is left to read."""
        self._ws()
        text = self.text
        if text.startswith(self.escape, self.i):
            close = text.find(self.escape, self.i + len(self.escape))
            if close < 0:
                raise _Unreadable
            key = text[self.i + len(self.escape) : close]
            self.i = close + len(self.escape)
            self._ws()
        else:
            stop = text.find(end, self.i)
            if stop < 0:
                raise _Unreadable
            key = text[self.i : stop].strip()
            if any(c in key for c in "{}[],<>\"'") or not key or any(c.isspace() for c in key):
                raise _Unreadable
            self.i = stop
        if not key or not text.startswith(end, self.i):
            raise _Unreadable
        return key

    def _ws(self) -> None:
        self.i = skip_ws(self.text, self.i)

    def _take(self, c: str) -> bool:
        if self.text.startswith(c, self.i):
            self.i += 1
            return True
        return False


def read_member(text: str, syntax: Syntax = FUNCTIONGEMMA) -> tuple[str, Any, bool] | None:
    """One top-level `key:value` -> key, value, whether the value was `<escape>`d; None when it does not read."""
    try:
        return _ValueReader(text, syntax).member()
    except (_Unreadable, RecursionError):
        return None


def _allows_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    declared = schema.get("type")
    return "string" in (declared if isinstance(declared, list) else [declared])


class _Arguments(ArgumentsJson):
    """Members as read_member() reads them: add(key, text) takes the member's whole text, known to read."""

    def __init__(self, properties: dict[str, Any], syntax: Syntax) -> None:
        super().__init__(properties)
        self._syntax = syntax

    def convert(self, text: str, schema: Any) -> Any:
        member = read_member(text, self._syntax)
        assert member is not None
        _, value, escaped = member
        if escaped and self._syntax.escaped_json and not _allows_string(schema):  # vLLM's reading of it
            ok, loaded = _json_value(value)
            if ok:
                return loaded
        return value


# Where the scan stands. `_buf` holds only the text still needed.
_TEXT = 0  # content: `_buf` is the text not sent yet (a marker's first characters, held back)
_HEADER = 1  # `_buf` starts just after `<start_function_call>`: `call:NAME{` is to come
_MEMBER = 2  # in the arguments: `_buf` starts at a member; `_k` is how far its scan has got
_CLOSE = 3  # the arguments ended: an `<end_function_call>` may follow (blanks before it)
_SKIP = 4  # the rest of a broken call, dropped up to its end marker


class FunctionGemmaToolParser(ScanningToolParser):
    name = "functiongemma"
    # `<start_function_call>`, `<end_function_call>` and `<escape>` are special tokens of its tokenizer.
    needs_special_tokens = True
    syntax: ClassVar[Syntax] = FUNCTIONGEMMA

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._state = _TEXT
        # A member's scan: `_k` in `_buf`, the bracket depth there, and whether it is inside an `<escape>`d string.
        self._k = 0
        self._depth = 0
        self._in_string = False
        self._arguments: _Arguments | None = None  # the open call's

    # ---- the reader ------------------------------------------------------------------------------

    def _close_call(self, out: DeltaMessage, rest: str, state: int) -> bool:
        """The open call's arguments end; `rest` is the text after them, read in `state`."""
        self._send(out, "}")
        self._num_calls += 1
        self._arguments, self._delta = None, None
        self._buf, self._state = rest, state
        return True

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move over `_buf`; False when it needs more text (or, final, is done)."""
        buf, state = self._buf, self._state
        if state == _TEXT:
            at = buf.find(self.syntax.begin)
            if at < 0:
                end = len(buf) if final else len(buf) - held_back(buf, self.syntax.begin)
                self._gate.into(out, buf[:end])
                self._buf = buf[end:]
                return False
            self._gate.into(out, buf[:at])
            self._buf, self._state = buf[at + len(self.syntax.begin) :], _HEADER
            return True
        if state == _HEADER:
            return self._header(out, final)
        if state == _MEMBER:
            return self._member(out, final)
        if state == _CLOSE:
            i = skip_ws(buf, 0)
            if buf.startswith(self.syntax.end, i):
                self._buf, self._state = buf[i + len(self.syntax.end) :], _TEXT
                return True
            if not final and self.syntax.end.startswith(buf[i:]):
                return False  # the end marker may be arriving
            self._state = _TEXT  # no end marker: what follows is content
            return True
        assert state == _SKIP
        at_end, at_begin = buf.find(self.syntax.end), buf.find(self.syntax.begin)
        if at_end < 0 and at_begin < 0:
            keep = 0 if final else max(held_back(buf, self.syntax.end), held_back(buf, self.syntax.begin))
            self._buf = buf[len(buf) - keep :]
            return False
        if at_begin >= 0 and (at_end < 0 or at_begin < at_end):
            self._buf, self._state = buf[at_begin:], _TEXT
        else:
            self._buf, self._state = buf[at_end + len(self.syntax.end) :], _TEXT
        return True

    def _header(self, out: DeltaMessage, final: bool) -> bool:
        """`_buf` follows a call marker: `call:NAME{` opens the call, anything else leaves the marker as content."""
        buf = self._buf
        i = skip_ws(buf, 0)
        head = buf[i : i + len(CALL_PREFIX)]
        if head != CALL_PREFIX:
            if not final and CALL_PREFIX.startswith(head):
                return False
            return self._no_call(out)
        start = i + len(CALL_PREFIX)
        brace = buf.find("{", start)
        name = buf[start : brace if brace >= 0 else len(buf)]
        if name and not valid_name(name):
            return self._no_call(out)
        if brace < 0:
            if final:
                return self._no_call(out)
            return False
        if not name:
            return self._no_call(out)
        self._gate.call()
        self.tools_called = True
        self._arguments = _Arguments(self.function_parameters(name), self.syntax)
        self._delta = DeltaToolCall(self._num_calls, id=new_tool_call_id(), name=name, arguments="{")
        out.tool_calls.append(self._delta)
        self._buf, self._state = buf[brace + 1 :], _MEMBER
        self._k, self._depth, self._in_string = 0, 0, False
        return True

    def _no_call(self, out: DeltaMessage) -> bool:
        """The marker opens no call: it is content, and reading goes on after it."""
        self._gate.into(out, self.syntax.begin)
        self._state = _TEXT
        return True

    def _member(self, out: DeltaMessage, final: bool) -> bool:
        """Scan `_buf` from `_k` for the end of the member it starts with: a `,` or `}` outside brackets and strings."""
        buf, k = self._buf, self._k
        while k < len(buf):
            if self._in_string:
                close = buf.find(self.syntax.escape, k)
                if close < 0:
                    k = max(k, len(buf) - len(self.syntax.escape) + 1)
                    break
                k, self._in_string = close + len(self.syntax.escape), False
                continue
            c = buf[k]
            if c == "<":
                marker = next((m for m in self.syntax.markers if buf.startswith(m, k)), None)
                if marker == self.syntax.escape:
                    k, self._in_string = k + len(self.syntax.escape), True
                    continue
                if marker is not None:  # a marker inside the arguments: the member (and call) ends unfinished
                    self._k = k
                    return self._close_call(out, buf[k:], _SKIP)
                if not final and any(m.startswith(buf[k:]) for m in self.syntax.markers):
                    break  # a marker may be arriving
            elif c in "{[":
                self._depth += 1
            elif c in "}]" and self._depth:
                self._depth -= 1
            elif c in ",}" and not self._depth:
                return self._end_member(out, buf[:k], buf[k + 1 :], c == "}")
            k += 1
        self._k = k
        if final:  # cut short inside the arguments: the member in progress is dropped
            return self._close_call(out, "", _TEXT)
        return False

    def _end_member(self, out: DeltaMessage, member: str, rest: str, last: bool) -> bool:
        """A member's text has arrived whole (`last`: the arguments' `}` ended it)."""
        assert self._arguments is not None
        self._k, self._depth, self._in_string = 0, 0, False
        if member.strip():  # (an empty one: `{}`, or a `,` before the `}`)
            read = read_member(member, self.syntax)
            if read is None:
                return self._close_call(out, rest, _SKIP)
            fragment = self._arguments.add(read[0], member)
            if fragment:
                self._send(out, fragment)
        if last:
            return self._close_call(out, rest, _CLOSE)
        self._buf = rest
        return True
