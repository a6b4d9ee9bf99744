"""A forgiving scanner for one JSON object that may still be arriving token by token.

It reports the object's top-level members as raw text spans (key, where the value starts and,
once complete, where it ends). Streaming tool parsers use it to send a function name as soon
as it is complete and the arguments' raw text as it grows: every prefix of an object, array or
string value is a prefix of the final value, so the fragments always reassemble to the text a
non-streaming parse of the finished output slices out.

ObjectScanner reads the text a piece at a time and resumes where it stopped, so a call streamed
in n characters costs O(n) however small its deltas; scan_object() is one whole-text pass of it.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_right
from dataclasses import dataclass, field

_WS = " \t\r\n"
# Where a run of characters that change nothing ends, per state: re scans the run in C.
_STRING_STOP = re.compile(r'["\\]')
_NESTED_STOP = re.compile(r'["{}\[\]]')
_LITERAL_STOP = re.compile(r"[,}\] \t\r\n]")

# Characters the scanners have read, all scanners together. Tests read it (chars_examined) to check
# that streaming reads each character once: a rescan of the text so far shows as a quadratic count.
_examined = 0


def chars_examined() -> int:
    return _examined


@dataclass(slots=True)
class Member:
    key: str
    value_start: int
    value_end: int | None = None  # exclusive; None while the value is incomplete


@dataclass(slots=True)
class ObjectScan:
    members: list[Member] = field(default_factory=list)
    end: int | None = None  # index just past the closing brace, once complete
    error: str | None = None  # the text cannot be (the prefix of) a JSON object
    error_at: int | None = None  # where that shows: the text from here is no part of the object

    def member(self, *keys: str) -> Member | None:
        for m in self.members:
            if m.key in keys:
                return m
        return None


# Scanner states: where the next character falls.
_START = 0  # before the opening brace
_FIRST = 1  # after '{': the first key or '}'
_KEY = 2  # after ',': a key
_KEY_TEXT = 3  # inside a key's string
_COLON = 4  # after a key
_VALUE = 5  # after ':': the value's first character
_STRING = 6  # inside a string value
_NESTED = 7  # inside an object or array value
_LITERAL = 8  # inside a number, true, false or null
_AFTER = 9  # after a value: ',' or '}'
_STOPPED = 10  # the object closed, or the text is not one


class ObjectScanner:
    """scan_object() for text that arrives in pieces: feed() reads only the new piece, from the state
    the previous one left (inside a string, after an escape, at a bracket depth), and `scan` always
    equals scan_object() of all the text fed so far. Positions count from `start`, the offset of the
    first character fed; the text is kept (as the pieces fed) for text()."""

    def __init__(self, start: int = 0) -> None:
        self.scan = ObjectScan()
        self.length = start  # offset just past the text fed so far
        self._parts: list[str] = []
        self._part_starts: list[int] = []  # offset of each part's first character fed
        self._part_shifts: list[int] = []  # offset of each part's index 0
        self._state = _START
        self._escape = False  # the previous character was a backslash inside a string
        self._in_string = False  # inside a string nested in an object or array value
        self._depth = 0  # bracket depth inside an object or array value
        self._key_start = 0
        self._key = ""
        self._member: Member | None = None  # the member whose value is being read

    def text(self, start: int, end: int) -> str:
        """The text fed between offsets start and end."""
        if start >= end:
            return ""
        if start >= self._part_starts[-1]:  # what a stream asks for: text in the last piece
            shift = self._part_shifts[-1]
            return self._parts[-1][start - shift : end - shift]
        k = bisect_right(self._part_starts, start) - 1
        pieces = []
        while start < end:
            stop = min(end, self._part_starts[k + 1] if k + 1 < len(self._parts) else self.length)
            shift = self._part_shifts[k]
            pieces.append(self._parts[k][start - shift : stop - shift])
            start = stop
            k += 1
        return "".join(pieces)

    def feed(self, text: str, begin: int = 0) -> None:
        """Read text[begin:], the characters that follow those fed before."""
        global _examined
        if begin >= len(text):
            return
        shift = self.length - begin  # text[i] is at offset shift + i
        self._parts.append(text)
        self._part_starts.append(self.length)
        self._part_shifts.append(shift)
        self.length = shift + len(text)
        if self._state != _STOPPED:
            i = self._read(text, begin, shift)
            _examined += i - begin

    def _string_end(self, text: str, i: int) -> int | None:
        """Inside a string at text[i]: the index past its closing quote, or None when text ends first."""
        if self._escape:
            self._escape = False
            i += 1
        while True:
            m = _STRING_STOP.search(text, i)
            if m is None:
                return None
            j = m.start()
            if text[j] == '"':
                return j + 1
            if j + 1 == len(text):
                self._escape = True
                return None
            i = j + 2

    def _fail(self, message: str, at: int) -> None:
        self.scan.error = f"{message} at offset {at}"
        self.scan.error_at = at
        self._state = _STOPPED

    def _read(self, text: str, i: int, shift: int) -> int:
        """Run the scan over text[i:]; returns the index where it stopped (len(text) unless it ended)."""
        n = len(text)
        scan = self.scan
        while i < n:
            state = self._state
            if state in (_STRING, _KEY_TEXT):
                end = self._string_end(text, i)
                if end is None:
                    return n
                i = end
                if state == _STRING:
                    assert self._member is not None
                    self._member.value_end = shift + i
                    self._state = _AFTER
                    continue
                try:
                    self._key = json.loads(self.text(self._key_start, shift + i))
                except json.JSONDecodeError:
                    self._fail("bad key", self._key_start)
                    return i
                self._state = _COLON
                continue
            if state == _NESTED:
                if self._in_string:
                    end = self._string_end(text, i)
                    if end is None:
                        return n
                    self._in_string = False
                    i = end
                    continue
                m = _NESTED_STOP.search(text, i)
                if m is None:
                    return n
                i = m.start() + 1
                c = text[i - 1]
                if c == '"':
                    self._in_string = True
                elif c in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth == 0:
                        assert self._member is not None
                        self._member.value_end = shift + i
                        self._state = _AFTER
                continue
            if state == _LITERAL:
                m = _LITERAL_STOP.search(text, i)
                if m is None:
                    return n
                i = m.start()  # the delimiter is read in _AFTER
                assert self._member is not None
                self._member.value_end = shift + i
                self._state = _AFTER
                continue
            c = text[i]
            if c in _WS:
                i += 1
                continue
            at = shift + i
            if state == _VALUE:
                self._member = Member(self._key, at)
                scan.members.append(self._member)
                if c == '"':
                    self._state, i = _STRING, i + 1
                elif c in "{[":
                    self._state, self._depth, self._in_string, i = _NESTED, 1, False, i + 1
                else:  # read from this very character: a delimiter here gives an empty literal
                    self._state = _LITERAL
            elif state == _AFTER:
                if c == ",":
                    self._state, i = _KEY, i + 1
                elif c == "}":
                    scan.end = at + 1
                    self._state = _STOPPED
                    return i + 1
                else:
                    self._fail("expected ',' or '}'", at)
                    return i
            elif state == _COLON:
                if c != ":":
                    self._fail("expected ':'", at)
                    return i
                self._state, i = _VALUE, i + 1
            elif state == _START:
                if c != "{":
                    self._fail("expected '{'", at)
                    return i
                self._state, i = _FIRST, i + 1
            else:  # _FIRST or _KEY
                if c == "}" and state == _FIRST:
                    scan.end = at + 1
                    self._state = _STOPPED
                    return i + 1
                if c != '"':
                    self._fail("expected a key", at)
                    return i
                self._key_start = at
                self._state, i = _KEY_TEXT, i + 1
        return i


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """Scan the object starting at text[start] (leading whitespace allowed)."""
    scanner = ObjectScanner(start)
    scanner.feed(text, start)
    return scanner.scan
