"""Llama 3.x JSON style: the whole reply is `{"name": ..., "parameters": {...}}` (several joined
by ';', optionally after `<|python_tag|>`). Anything else is plain content."""

from __future__ import annotations

from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    ARGUMENT_KEYS,
    CallStreamer,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_body,
)
from ferrox.entrypoints.openai.tool_parsers.json_scan import scan_object

PYTHON_TAG = "<|python_tag|>"
_SEPARATORS = " \t\r\n;"


def _calls_start(text: str) -> int | None:
    """Offset of the first call object, or None when the text is not a tool-call reply."""
    i = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, i):
        i += len(PYTHON_TAG)
        i += len(text[i:]) - len(text[i:].lstrip())
    return i if text.startswith("{", i) else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""  # the reply while undecided
        self._parts: list[str] = []  # the reply in "calls" mode, joined only if it is no call after all
        self._mode: str | None = None  # None: undecided, "content", "calls"
        self._calls: list[CallStreamer] = []  # the last one is open until its object closes
        self._stopped = False  # a call's text is not JSON: nothing more goes out

    def extract(self, text: str) -> ExtractedToolCalls:
        i = _calls_start(text)
        if i is None:
            return ExtractedToolCalls(content=text.strip() or None, tool_calls=[])
        calls: list[ToolCall] = []
        while i < len(text):
            scan = scan_object(text, i)
            if scan.error or scan.end is None or scan.member(*ARGUMENT_KEYS) is None:
                return ExtractedToolCalls(content=text.strip() or None, tool_calls=[])
            call = call_from_body(text[i : scan.end])
            if call is None:
                return ExtractedToolCalls(content=text.strip() or None, tool_calls=[])
            calls.append(call)
            i = scan.end
            while i < len(text) and text[i] in _SEPARATORS:
                i += 1
        return ExtractedToolCalls(content=None, tool_calls=calls)

    def feed(self, delta: str) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode == "content":
            out.content = delta
            return out
        if self._mode == "calls":
            self._parts.append(delta)
            self._stream(out, delta, 0)
            return out
        self._text += delta
        head = self._text.lstrip()
        if head.startswith(PYTHON_TAG):
            head = head[len(PYTHON_TAG) :].lstrip()
        elif PYTHON_TAG.startswith(head):
            return out  # cannot tell yet (this also covers an empty head)
        if not head:
            return out
        start = _calls_start(self._text)
        if start is None:
            self._mode = "content"
            out.content = self._text
            return out
        self._mode, self._parts = "calls", [self._text]
        self._calls.append(CallStreamer(0))
        self._stream(out, self._text, start)
        return out

    def _stream(self, out: DeltaMessage, text: str, i: int) -> None:
        """The reply goes on with text[i:]: stream the open object; move on when it closes."""
        while not self._stopped:
            call = self._calls[-1]
            if call.scan.end is not None:  # separators, then the next object
                while i < len(text) and text[i] in _SEPARATORS:
                    i += 1
                if i == len(text):
                    return  # the next object (if any) has not started
                call = CallStreamer(len(self._calls))
                self._calls.append(call)
            offset = call.length - i  # call offset of text[0]
            call.feed(text, i)
            scan = call.scan
            if scan.error:
                self._stopped = True
                return
            if call.arguments is not None or scan.end is not None:
                out.tool_calls += call.deltas()
                self.tools_called = self.tools_called or call.name is not None
            if scan.end is None:
                return
            i = scan.end - offset

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode is None and self._text:
            out.content = self._text
        elif self._mode == "calls" and not self.tools_called:
            out.content = "".join(self._parts)  # JSON that was not a call: it is the answer
        return out
