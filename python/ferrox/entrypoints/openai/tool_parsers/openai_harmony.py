"""gpt-oss (harmony format): vLLM's `openai` tool parser.

A call is a message addressed to a function, on the commentary channel:

    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the recipient may come before the channel: `<|start|>assistant to=functions.f<|channel|>commentary json`).
Its name is the recipient after `functions.`, its arguments the message's body as written, streamed as it
comes (so the fragments join to exactly the non-streamed arguments; vLLM re-serializes a whole call's
JSON, which would make the two differ). `final` messages and commentary without a recipient (a
preamble before the calls) are content, joined by a newline as vLLM joins them; `analysis` messages and
messages to gpt-oss's built-in tools are thinking, never content.

The parser reads either the whole output (no reasoning parser) or the content of the `openai_gptoss`
reasoning parser, which passes calls on as canonical harmony messages and the rest as plain text. The
markers are special tokens: the reply is decoded with skip_special_tokens=False (needs_special_tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ferrox.entrypoints.openai.tool_parsers.base import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    new_tool_call_id,
)
from ferrox.reasoning.harmony import Event, HarmonyScanner


class OpenAIHarmonyToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._scanner = HarmonyScanner()
        self._kind = "content"  # the open message's kind: "content", "reasoning" or "call"
        self._said = False  # a content message had text (the next one is joined by a newline)
        self._sep = False  # the open content message needs that newline before its first text
        self._num_calls = 0

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole text through a fresh stream (one set of rules for both paths)."""
        parser = OpenAIHarmonyToolParser(self.tools)
        delta = parser._read(parser._scanner.feed(text, finished=True))
        calls: list[ToolCall] = []
        for piece in delta.tool_calls:
            if piece.id is not None:
                calls.append(ToolCall(name=piece.name or "", arguments=piece.arguments or "", id=piece.id))
            else:
                calls[-1].arguments += piece.arguments or ""
        return ExtractedToolCalls(content=delta.content, tool_calls=calls)

    def feed(self, delta: str) -> DeltaMessage:
        return self._read(self._scanner.feed(delta))

    def finish(self) -> DeltaMessage:
        return self._read(self._scanner.feed("", finished=True))

    def _read(self, events: Iterable[Event]) -> DeltaMessage:
        out = DeltaMessage()
        content: list[str] = []
        for event in events:
            self._event(event, out, content)
        out.content = "".join(content) or None
        return out

    def _event(self, event: Event, out: DeltaMessage, content: list[str]) -> None:
        if event.kind == "open":
            assert event.header is not None
            self._kind = event.header.kind
            if self._kind == "call":
                out.tool_calls.append(DeltaToolCall(self._num_calls, id=new_tool_call_id(),
                                                    name=event.header.function_name, arguments=""))
                self._num_calls += 1
                self.tools_called = True
            self._sep = self._kind == "content" and self._said
        elif event.kind == "close":
            self._kind = "content"
            self._sep = False
        elif self._kind == "call":
            if out.tool_calls and out.tool_calls[-1].index == self._num_calls - 1:
                last = out.tool_calls[-1]
                last.arguments = (last.arguments or "") + event.text
            else:
                out.tool_calls.append(DeltaToolCall(self._num_calls - 1, arguments=event.text))
        elif self._kind == "content":
            if self._sep:
                content.append("\n")
                self._sep = False
            content.append(event.text)
            self._said = True
