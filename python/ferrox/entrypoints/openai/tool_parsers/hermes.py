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
        # The text not consumed yet: a marker's first characters, held back in case the marker is
        # arriving. The rest went out as content or into the open call's body (kept by its streamer),
        # so no delta rescans the text before it.
        self._tail = ""
        self._call: CallStreamer | None = None
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
        out = DeltaMessage()
        text = self._tail + delta
        pos = 0
        while True:
            if self._call is None:
                start = text.find(START, pos)
                if start < 0:
                    keep = held_back(text[pos:], START)
                    self._emit_content(out, text[pos : len(text) - keep])
                    self._tail = text[len(text) - keep :]
                    return out
                self._emit_content(out, text[pos:start])
                self._pending_ws = ""
                self._call = CallStreamer(self._num_calls)
                pos = start + len(START)
                continue
            end = text.find(END, pos)
            body_end = end if end >= 0 else len(text) - held_back(text[pos:], END)
            out.tool_calls += self._call.update(text[pos:body_end])
            if end < 0:
                self._tail = text[body_end:]
                return out
            self._close_call(out, closed=True)
            pos = end + len(END)

    def _close_call(self, out: DeltaMessage, closed: bool) -> None:
        assert self._call is not None
        if self._call.name is None:  # never became a call: the text is content after all
            self._emit_content(out, START + self._call.body() + (END if closed else ""))
        else:
            self.tools_called = True
            self._num_calls += 1
        self._call = None

    def finish(self) -> DeltaMessage:
        out = DeltaMessage()
        if self._call is not None:
            out.tool_calls += self._call.update(self._tail)
            self._close_call(out, closed=False)
        else:
            self._emit_content(out, self._tail)
        self._tail = ""
        return out
