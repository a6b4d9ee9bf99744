"""Formats whose tool calls sit between marker tokens, each call closed by an end marker:

    [SECTION_BEGIN] CALL_BEGIN body CALL_END [ws CALL_BEGIN body CALL_END ...] [SECTION_END]

(DeepSeek-V3 / V3.1 and Kimi-K2 wrap their calls in a section; GLM-4.5 writes each call on its own.) A
MarkedCallsParser names the markers; its subclass reads one call's body (`read_call`).

What counts as calls, the same whole or streamed:
- with a section marker, the calls start after it (only whitespace between calls); a marker that no
  call follows is content, and so is everything after a call that does not read (a bad call after good
  ones: the good ones stand), and text after the section;
- a call needs its end marker, as vLLM's parsers do (a reply cut short inside a call keeps that text as
  content); the body between the markers must read whole, or the call is content.

Streaming sends each call whole, id, name and arguments in one delta, once its end marker has arrived
and its body has read (as vLLM's glm45 parser does): before that, the text may still turn out not to be
a call, which a call already sent could not take back. Content outside the calls streams as it comes,
but for the first characters of a marker, held back until the next delta says whether it is one.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.base import (
    ContentGate,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    held_back,
)

_WS = " \t\r\n"
# A function name runs between markers; these characters cannot be in one.
_NOT_IN_NAME = frozenset(_WS + "{}<>\"'`")

# Reader states.
_TEXT = 0  # content, up to the next section (or call) marker
_SECTION = 1  # inside a section, before a call: whitespace, then a call marker or the section's end
_CALL = 2  # inside a call: its body runs to the end marker


def valid_name(name: str) -> bool:
    return bool(name) and not any(c in _NOT_IN_NAME for c in name)


def json_object_text(text: str) -> str | None:
    """text, stripped, when it is one JSON object; None otherwise."""
    text = text.strip(_WS)
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return text if isinstance(value, dict) else None


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


class MarkedCallsParser(ToolParser):
    section_begin: ClassVar[str | None] = None  # None: calls stand on their own (GLM)
    section_end: ClassVar[str | None] = None
    call_begin: ClassVar[str]
    call_end: ClassVar[str]

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""  # the reply from the first character a decision may still turn back to (_trim)
        self._pos = 0  # everything before it was sent, dropped, or read into a call
        self._scan = 0  # where the search for the next marker (or a call's end) resumes
        self._state = _TEXT
        self._section_start = 0  # where the open section's marker starts
        self._section_calls = 0  # calls read in the open section
        self._call_start = 0  # where the open call's marker starts
        self._num_calls = 0
        self._gate = ContentGate()
        # A long call body waits for its end marker: its deltas are kept apart (`_parts`) and only the last
        # characters (`_probe`) looked at, so that the reply is joined once, not once per delta.
        self._waiting = False
        self._parts: list[str] = []
        self._probe = ""

    def read_call(self, body: str) -> ToolCall | None:
        """The call whose body (the text between the call's markers) is `body`; None when it is no call."""
        raise NotImplementedError

    # ---- the ToolParser interface ----------------------------------------------------------------

    def extract(self, text: str) -> ExtractedToolCalls:
        # One reader for both paths: the whole text is one delta, then the end.
        reader = self.__class__(self.tools)
        first, last = reader.feed(text), reader.finish()
        calls = [ToolCall(name=d.name or "", arguments=d.arguments or "", id=d.id or "")
                 for d in first.tool_calls + last.tool_calls]
        content = ((first.content or "") + (last.content or "")).strip()
        return ExtractedToolCalls(content=content or None, tool_calls=calls)

    def feed(self, delta: str) -> DeltaMessage:
        if self._waiting:
            probe = self._probe + delta
            if self.call_end not in probe:
                self._parts.append(delta)
                self._probe = probe[len(probe) - len(self.call_end) + 1 :]
                return DeltaMessage()
        self._parts.append(delta)
        return self._advance(final=False)

    def finish(self) -> DeltaMessage:
        return self._advance(final=True)

    # ---- the reader ------------------------------------------------------------------------------

    def _advance(self, final: bool) -> DeltaMessage:
        if self._parts:
            self._text += "".join(self._parts)
            self._parts = []
        self._waiting = False
        out = DeltaMessage()
        while self._step(out, final):
            pass
        self._trim()
        return out

    def _trim(self) -> None:
        """Drop the text no decision can come back to: what went out as content or calls, up to where a
        call that fails would turn back into content. Dropped in large runs, so each character is copied
        a bounded number of times."""
        if self._state == _TEXT:
            keep = self._pos
        elif self.section_begin is not None and not self._section_calls:
            keep = self._section_start
        else:
            keep = self._pos if self._state == _SECTION else self._call_start
        if keep and (keep > 4096 or 2 * keep >= len(self._text)):
            self._text = self._text[keep:]
            self._pos, self._scan = self._pos - keep, max(0, self._scan - keep)
            self._section_start, self._call_start = max(0, self._section_start - keep), max(0, self._call_start - keep)

    def _opening(self) -> str:
        return self.section_begin or self.call_begin

    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move over the text; False when it needs more text (or, final, is done)."""
        text = self._text
        if self._state == _TEXT:
            marker = self._opening()
            at = text.find(marker, max(self._pos, self._scan))
            if at < 0:
                end = len(text) if final else len(text) - held_back(text[self._pos :], marker)
                self._gate.into(out, text[self._pos : end])
                self._pos = self._scan = end
                return False
            self._gate.into(out, text[self._pos : at])
            self._pos = self._scan = at + len(marker)
            if self.section_begin is None:
                self._call_start, self._state = at, _CALL
            else:
                self._section_start, self._section_calls, self._state = at, 0, _SECTION
            return True
        if self._state == _SECTION:
            assert self.section_end is not None
            j = skip_ws(text, self._pos)
            if text.startswith(self.call_begin, j):
                self._call_start, self._state = j, _CALL
                self._pos = self._scan = j + len(self.call_begin)
                return True
            if text.startswith(self.section_end, j) and self._section_calls:
                self._pos = self._scan = j + len(self.section_end)
                self._state = _TEXT
                return True
            rest = text[j:]
            if not final and (self.call_begin.startswith(rest) or self.section_end.startswith(rest)):
                return False  # a marker may be arriving
            if final and not rest and self._section_calls:  # the reply ends inside the section
                self._pos, self._state = j, _TEXT
                return True
            return self._not_a_call(j)
        end = text.find(self.call_end, max(self._pos, self._scan))
        if end < 0:
            if not final:
                self._scan = max(self._pos, len(text) - len(self.call_end) + 1)
                self._waiting, self._probe = True, text[self._scan :]
                return False
            return self._not_a_call(self._call_start)  # cut short inside the call
        call = self.read_call(text[self._pos : end])
        if call is None:
            return self._not_a_call(self._call_start)
        self._gate.call()
        self.tools_called = True
        out.tool_calls.append(DeltaToolCall(self._num_calls, id=call.id, name=call.name, arguments=call.arguments))
        self._num_calls += 1
        self._pos = self._scan = end + len(self.call_end)
        if self.section_begin is None:
            self._state = _TEXT
        else:
            self._section_calls += 1
            self._state = _SECTION
        return True

    def _not_a_call(self, at: int) -> bool:
        """What follows the last good call is no call: the text from `at` is content -- all of the section
        when it holds no good call -- and reading goes on after the marker there, in case another
        section (or call) follows."""
        if self.section_begin is not None and not self._section_calls:
            at = self._section_start
        opening = self._opening()
        skip = self._text.startswith(opening, at) and (self.section_begin is None or at == self._section_start)
        self._pos, self._scan, self._state = at, at + len(opening) if skip else at, _TEXT
        return True
