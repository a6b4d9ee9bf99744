"""Hermes / Qwen style: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

This is also the format ferrox constrains `tool_choice="required"` to (structured/tools.py).
"""

from __future__ import annotations

from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    CallStreamer,
    DeltaMessage,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    call_from_body,
    held_back,
)

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._pos = 0  # everything before it has been sent or dropped
        self._call: CallStreamer | None = None
        self._body_start = 0
        self._num_calls = 0
        self._pending_ws = ""  # whitespace after a call: dropped unless real content follows

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            body_start = start + len(START)
            end = text.find(END, body_start)
            # An unclosed last call (cut by max_tokens, perhaps mid end tag) still counts if it parses.
            stop = end if end >= 0 else len(text) - held_back(text[body_start:], END)
            call = call_from_body(text[body_start:stop])
            if call is not None:
                calls.append(call)
            else:  # not a call after all: keep the text
                content.append(text[start : stop + len(END) if end >= 0 else len(text)])
            if end < 0:
                break
            pos = end + len(END)
        joined = "".join(content).strip()
        return ExtractedToolCalls(content=joined or None, tool_calls=calls)

    def _emit_content(self, out: DeltaMessage, text: str) -> None:
        if not text:
            return
        if self._num_calls:
            self._pending_ws += text
            if not self._pending_ws.strip():
                return
            text, self._pending_ws = self._pending_ws, ""
        out.content = (out.content or "") + text

    def feed(self, delta: str) -> DeltaMessage:
        self._text += delta
        out = DeltaMessage()
        text = self._text
        while True:
            if self._call is None:
                start = text.find(START, self._pos)
                if start < 0:
                    keep = held_back(text[self._pos :], START)
                    self._emit_content(out, text[self._pos : len(text) - keep])
                    self._pos = len(text) - keep
                    return out
                self._emit_content(out, text[self._pos : start])
                self._pending_ws = ""
                self._call = CallStreamer(self._num_calls)
                self._body_start = self._pos = start + len(START)
                continue
            end = text.find(END, self._body_start)
            body_end = end if end >= 0 else len(text) - held_back(text[self._body_start :], END)
            out.tool_calls += self._call.update(text[self._body_start : body_end])
            if end < 0:
                return out
            self._close_call(out, text[self._body_start : end], closed=True)
            self._pos = end + len(END)

    def _close_call(self, out: DeltaMessage, body: str, closed: bool) -> None:
        assert self._call is not None
        if self._call.name is None:  # never became a call: the text is content after all
            self._emit_content(out, START + body + (END if closed else ""))
        else:
            self.tools_called = True
            self._num_calls += 1
        self._call = None

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._call is not None:
            body = self._text[self._body_start :]
            out.tool_calls += self._call.update(body)
            self._close_call(out, body, closed=False)
        else:
            self._emit_content(out, self._text[self._pos :])
        self._pos = len(self._text)
        return out
