"""A forgiving scanner for one JSON object that may still be arriving token by token.

It reports the object's top-level members as raw text spans (key, where the value starts and,
once complete, where it ends). Streaming tool parsers use it to send a function name as soon
as it is complete and the arguments' raw text as it grows: every prefix of an object, array or
string value is a prefix of the final value, so the fragments always reassemble to the text a
non-streaming parse of the finished output slices out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = " \t\r\n"
_LITERAL_END = ",}] \t\r\n"


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

    def member(self, *keys: str) -> Member | None:
        for m in self.members:
            if m.key in keys:
                return m
        return None


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """text[i] is '"'; index past the closing quote, or None if the string is unfinished."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index past the JSON value starting at text[i], or None if it is unfinished."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    # number / true / false / null: ends at a delimiter; at the end of text it may go on.
    while i < len(text) and text[i] not in _LITERAL_END:
        i += 1
    return i if i < len(text) else None


def scan_object(text: str, start: int = 0) -> ObjectScan:
    """Scan the object starting at text[start] (leading whitespace allowed)."""
    scan = ObjectScan()
    i = _skip_ws(text, start)
    if i == len(text):
        return scan
    if text[i] != "{":
        scan.error = f"expected '{{' at offset {i}"
        return scan
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return scan
        if text[i] == "}" and not scan.members:
            scan.end = i + 1
            return scan
        if text[i] != '"':
            scan.error = f"expected a key at offset {i}"
            return scan
        key_end = _string_end(text, i)
        if key_end is None:
            return scan
        try:
            key = json.loads(text[i:key_end])
        except json.JSONDecodeError:
            scan.error = f"bad key at offset {i}"
            return scan
        i = _skip_ws(text, key_end)
        if i == len(text):
            return scan
        if text[i] != ":":
            scan.error = f"expected ':' at offset {i}"
            return scan
        i = _skip_ws(text, i + 1)
        if i == len(text):
            return scan
        member = Member(key, i)
        scan.members.append(member)
        end = _value_end(text, i)
        if end is None:
            return scan
        member.value_end = end
        i = _skip_ws(text, end)
        if i == len(text):
            return scan
        if text[i] == ",":
            i += 1
            continue
        if text[i] == "}":
            scan.end = i + 1
            return scan
        scan.error = f"expected ',' or '}}' at offset {i}"
        return scan
