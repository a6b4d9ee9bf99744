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
        self._text = ""
        self._mode: str | None = None  # None: undecided, "content", "calls"
        self._pos = 0
        self._calls: list[CallStreamer] = []

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
        self._text += delta
        out = DeltaMessage()
        if self._mode is None:
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
            self._mode, self._pos = "calls", start
            self._calls.append(CallStreamer(0))
        elif self._mode == "content":
            out.content = delta
            return out
        while True:  # "calls": stream the current object; move on when it closes
            call = self._calls[-1]
            scan = scan_object(self._text, self._pos)
            if scan.error:
                return out
            if scan.member(*ARGUMENT_KEYS) is not None or scan.end is not None:
                out.tool_calls += call.update(self._text[self._pos : scan.end or len(self._text)])
                self.tools_called = self.tools_called or call.name is not None
            if scan.end is None:
                return out
            i = scan.end
            while i < len(self._text) and self._text[i] in _SEPARATORS:
                i += 1
            if i == len(self._text):
                return out  # the next object (if any) has not started
            self._pos = i
            self._calls.append(CallStreamer(len(self._calls)))

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._mode is None and self._text:
            out.content = self._text
        elif self._mode == "calls" and not self.tools_called:
            out.content = self._text  # JSON that was not a call: it is the answer
        return out
