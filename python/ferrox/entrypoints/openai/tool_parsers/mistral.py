"""Mistral / Mixtral instruct: tool calls follow a `[TOOL_CALLS]` marker, in one of two shapes.

- older tokenizers (Mistral-7B-Instruct v0.3, Mixtral-8x22B, Nemo): one marker, then a JSON array
  `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]`;
- v11+ tokenizers (Mistral Small 3.1+, Devstral, Magistral): one marker per call, the name, then the
  arguments object: `[TOOL_CALLS]f{...}[TOOL_CALLS]g{...}`, with `[ARGS]` (and `[CALL_ID]<id>`)
  between name and object when special tokens are kept in the text.

The markers are special tokens, so the reply must be decoded with skip_special_tokens=False
(ToolParser.needs_special_tokens; vLLM's parser sets it on the request). Text outside the calls is
content; a marker followed by neither shape (or by an arguments object that does not parse, or is
cut short) is content too. The arguments are the object's own JSON text; streaming sends each call
whole once its object has closed. Call ids are 9 letters and digits: Mistral's chat templates
refuse any other id when the calls come back in the conversation.
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    ContentGate,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_body,
    held_back,
    join_content,
)
from ferrox.entrypoints.openai.tool_parsers.json_scan import scan_object

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_WS = " \t\r\n"
# A function name runs up to the arguments; these characters cannot be in one.
_NOT_IN_NAME = frozenset(_WS + "[]{}()<>,;\"'")
_ID_CHARS = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    return "".join(random.choices(_ID_CHARS, k=9))


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _head_name(head: str, complete: bool) -> str | None | bool:
    """The text between the marker and the arguments' `{`: `name`, then optionally
    `[CALL_ID]<id>` and `[ARGS]`. Complete: the name, or None when the head is malformed.
    Not complete (no `{` yet): True while it may still become a head, else False."""
    h = head.lstrip(_WS)
    n = 0
    while n < len(h) and h[n] not in _NOT_IN_NAME:
        n += 1
    name, rest = h[:n], h[n:]
    if rest.startswith(CALL_ID):
        rest = rest[len(CALL_ID) :]
        k = 0
        while k < len(rest) and rest[k].isalnum():
            k += 1
        rest = rest[k:]
    elif rest and CALL_ID.startswith(rest):
        return False if complete else bool(name)
    if rest.startswith(ARGS):
        rest = rest[len(ARGS) :]
    elif rest and ARGS.startswith(rest):
        return False if complete else bool(name)
    ok = not rest.strip(_WS) and (bool(name) or (not complete and not rest))
    if complete:
        return name if ok else None
    return ok


@dataclass(slots=True)
class _Segment:
    """What the text after one marker holds: `state` "open" (it may go on), "closed" (it ends at
    `end`), or "invalid" (no call: the marker is content). `spans` are the calls' texts, start and
    end (None while unfinished): whole `{"name", "arguments"}` objects for the array shape, the
    arguments object for the name shape (whose function name is `name`)."""

    state: str
    spans: list[tuple[int, int | None]] = field(default_factory=list)
    end: int = 0
    array: bool = False
    name: str | None = None


def _scan_array(text: str, start: int, final: bool) -> _Segment:
    seg = _Segment("open", array=True)

    def stop(at: int) -> _Segment:  # the calls so far stand; the text from `at` is content
        if not seg.spans:
            return _Segment("invalid")
        seg.state, seg.end = "closed", at
        return seg

    j = start + 1  # past the '['
    while True:
        j = _skip_ws(text, j)
        if j == len(text):
            return stop(j) if final else seg
        if text[j] == "]":
            return stop(j + 1)
        if text[j] != "{":
            return stop(j)
        scan = scan_object(text, j)
        if scan.error:
            return stop(j)
        if scan.end is None:
            if final:
                return stop(j)
            seg.spans.append((j, None))
            return seg
        if call_from_body(text[j : scan.end]) is None:
            return stop(j)
        seg.spans.append((j, scan.end))
        k = _skip_ws(text, scan.end)
        if k == len(text):
            return stop(k) if final else seg
        if text[k] == ",":
            j = k + 1
        elif text[k] == "]":
            return stop(k + 1)
        else:
            return stop(scan.end)


def _scan_segment(text: str, start: int, final: bool) -> _Segment:
    """The segment after the marker that ends at `start`. `final`: the text is all there is. A
    decision made on a prefix (not final) holds for every longer text, so streaming and extract()
    agree."""
    i = _skip_ws(text, start)
    if i == len(text):
        return _Segment("invalid" if final else "open")
    if text[i] == "[":
        return _scan_array(text, i, final)
    brace = text.find("{", i)
    if brace < 0:
        return _Segment("open" if not final and _head_name(text[i:], complete=False) else "invalid")
    name = _head_name(text[i:brace], complete=True)
    if not isinstance(name, str):
        return _Segment("invalid")
    scan = scan_object(text, brace)
    if scan.error:
        return _Segment("invalid")
    if scan.end is None:
        return _Segment("invalid") if final else _Segment("open", [(brace, None)], name=name)
    try:
        ok = isinstance(json.loads(text[brace : scan.end]), dict)
    except json.JSONDecodeError:
        ok = False
    if not ok:
        return _Segment("invalid")
    return _Segment("closed", [(brace, scan.end)], end=scan.end, name=name)


class _Depth:
    """Bracket depth of a segment's text outside JSON strings, read as it arrives. A segment can only
    change state (a call completes, the text proves not to be one) where the depth falls back to
    the call level, or while outside any bracket; elsewhere rescanning it would find nothing new,
    and skipping those rescans keeps a long arguments object linear to stream."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._depth = 0
        self._string = False
        self._escape = False

    def worth_a_scan(self, text: str) -> bool:
        fired = False
        for c in text[self._pos :]:
            if self._string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._string = False
            elif c == '"':
                self._string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                fired = fired or self._depth <= 1
        self._pos = len(text)
        return fired or (self._depth <= 0 and not self._string)


def _call(text: str, seg: _Segment, start: int, end: int) -> ToolCall:
    """A complete call of a segment (the scan checked that it is one)."""
    if seg.array:
        call = call_from_body(text[start:end])
        assert call is not None
        call.id = mistral_tool_call_id()
        return call
    return ToolCall(name=seg.name or "", arguments=text[start:end], id=mistral_tool_call_id())


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS], [ARGS] and [CALL_ID] are control tokens

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0  # everything before it has been sent or dropped
        self._segment_start: int | None = None  # just past the marker being read
        self._depth = _Depth(0)
        self._segment_sent = 0  # calls of that segment sent
        self._num_calls = 0
        self._gate = ContentGate()

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        pieces: list[str] = []
        piece: list[str] = []
        pos = 0
        while True:
            marker = text.find(MARKER, pos)
            if marker < 0:
                piece.append(text[pos:])
                break
            piece.append(text[pos:marker])
            pos = marker + len(MARKER)
            seg = _scan_segment(text, pos, final=True)
            if seg.state == "invalid":
                piece.append(MARKER)
                continue
            pieces.append("".join(piece))
            piece = []
            for start, end in seg.spans:
                assert end is not None
                calls.append(_call(text, seg, start, end))
            pos = seg.end
        pieces.append("".join(piece))
        return ExtractedToolCalls(content=join_content(pieces), tool_calls=calls)

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        return self._advance(final=False)

    def finish(self) -> DeltaMessage:
        return self._advance(final=True)

    def _advance(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        text = self._text
        while True:
            if self._segment_start is None:
                marker = text.find(MARKER, self._pos)
                if marker < 0:
                    end = len(text) if final else len(text) - held_back(text[self._pos :], MARKER)
                    self._gate.into(out, text[self._pos : end])
                    self._pos = end
                    return out
                self._gate.into(out, text[self._pos : marker])
                self._segment_start = self._pos = marker + len(MARKER)
                self._depth = _Depth(self._segment_start)
                continue
            if not final and not self._depth.worth_a_scan(text):
                return out
            seg = _scan_segment(text, self._segment_start, final)
            if seg.state == "invalid":
                self._gate.into(out, MARKER)  # not a call after all: scan on after the marker
                self._segment_start = None
                continue
            self._stream(out, text, seg)
            if seg.state == "open":
                return out
            self._pos = seg.end
            self._segment_start = None
            self._segment_sent = 0

    def _stream(self, out: DeltaMessage, text: str, seg: _Segment) -> None:
        """Send the segment's calls that are complete. A call goes out whole, once its arguments
        object has closed and parsed: before that, the text may still turn out not to be a call
        (and then it is content), which a call already sent could not take back."""
        for start, end in seg.spans[self._segment_sent :]:
            if end is None:
                return
            call = _call(text, seg, start, end)
            self._gate.call()
            self.tools_called = True
            out.tool_calls.append(DeltaToolCall(self._num_calls, id=call.id, name=call.name, arguments=call.arguments))
            self._num_calls += 1
            self._segment_sent += 1
