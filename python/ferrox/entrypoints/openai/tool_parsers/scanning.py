"""The scaffold of a parser that reads its format with a resumable scan (qwen3_coder.py and seed_oss.py
through it, minimax_m2.py, functiongemma.py): the text not yet settled waits in `_buf`, each feed() or
finish() runs the subclass's `_step` until it needs more text, and the open call's arguments text goes into
one delta per message. A format whose reader never looks back extracts a whole text by reading it as one
delta (the default extract), so the streamed and the whole results agree by construction."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    ContentGate,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
)


class ScanningToolParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._buf = ""  # the text the scan has not settled yet
        self._num_calls = 0  # calls sent so far: the open call's index
        self._gate = ContentGate()
        self._delta: DeltaToolCall | None = None  # the open call's delta in the message being built

    @abstractmethod
    def _step(self, out: DeltaMessage, final: bool) -> bool:
        """One move of the scan over `_buf`; False when it needs more text (or, final, is done)."""

    def feed(self, delta: str) -> DeltaMessage:
        self._buf += delta
        return self._advance(final=False)

    def finish(self) -> DeltaMessage:
        return self._advance(final=True)

    def _advance(self, final: bool) -> DeltaMessage:
        out = DeltaMessage()
        self._delta = None
        while self._step(out, final):
            pass
        return out

    def _send(self, out: DeltaMessage, fragment: str) -> None:
        """Arguments text for the open call, into its delta in this message."""
        if self._delta is None:
            self._delta = DeltaToolCall(self._num_calls, arguments="")
            out.tool_calls.append(self._delta)
        self._delta.arguments = (self._delta.arguments or "") + fragment

    def extract(self, text: str) -> ExtractedToolCalls:
        """The calls and content of a whole text, read by a fresh parser as one delta, then the end (a format
        whose whole text reads otherwise overrides this: qwen3_coder.py)."""
        reader = self.__class__(self.tools)
        first, last = reader.feed(text), reader.finish()
        calls: dict[int, ToolCall] = {}
        for delta in first.tool_calls + last.tool_calls:
            call = calls.setdefault(delta.index, ToolCall(name=delta.name or "", arguments="", id=delta.id or ""))
            call.arguments += delta.arguments or ""
        content = ((first.content or "") + (last.content or "")).strip()
        return ExtractedToolCalls(content=content or None, tool_calls=[calls[i] for i in sorted(calls)])
