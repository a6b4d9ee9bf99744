"""What every tool parser returns, and the piece they share: one JSON call body -> deltas.

A parser turns a model's text into OpenAI `tool_calls`, either at once (`extract`) or as the
text streams in (`feed` per text delta, then `finish`). Streaming sends, per call, first its
id and name, then fragments of the arguments' raw JSON text; the fragments joined equal the
`arguments` string the non-streaming path gives for the same text.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ferrox.entrypoints.openai.tool_parsers.json_scan import Member, scan_object

# Keys under which models put the arguments object (Hermes/Qwen say "arguments", Llama 3 "parameters").
ARGUMENT_KEYS = ("arguments", "parameters")


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=new_tool_call_id)


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # text outside the tool calls (None when there is none)
    tool_calls: list[ToolCall]

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


@dataclass(slots=True)
class DeltaToolCall:
    index: int
    id: str | None = None  # only in a call's first delta, with its name
    name: str | None = None
    arguments: str | None = None  # a fragment to append


@dataclass(slots=True)
class DeltaMessage:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


def _arguments_text(body: str, member: Member | None, complete: bool) -> str | None:
    """The arguments' JSON text so far (None: nothing to say yet). A stringified arguments value
    ("arguments": "{\\"a\\": 1}") is decoded, and only once complete."""
    if member is None:
        return "{}" if complete else None
    end = member.value_end
    raw = body[member.value_start : end if end is not None else len(body)]
    if raw.startswith('"'):
        if end is None:
            return None
        decoded = _json_string(raw)
        if decoded is None:  # an invalid escape: no arguments to stream (the body is no call)
            return None
        return decoded
    return raw


def _json_string(raw: str) -> str | None:
    """A JSON string literal's value; None when it does not decode (a model may write `"\\q"`, which the
    scanner passes as a string but JSON refuses): the parsers treat that as text, never raise."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


def call_from_body(body: str) -> ToolCall | None:
    """A finished call body -> ToolCall, or None when it is not a valid call object."""
    scan = scan_object(body)
    if scan.error or scan.end is None or body[scan.end :].strip():
        return None
    try:
        obj = json.loads(body[: scan.end])
    except json.JSONDecodeError:
        return None
    name_member = scan.member("name")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or name_member is None:
        return None
    arguments = _arguments_text(body, scan.member(*ARGUMENT_KEYS), complete=True)
    return ToolCall(name=obj["name"], arguments=arguments or "{}")


class CallStreamer:
    """Streams one call body ({"name": ..., "arguments": {...}}) as it grows."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_tool_call_id()
        self.name: str | None = None
        self.arguments_sent = ""

    def update(self, body: str) -> list[DeltaToolCall]:
        scan = scan_object(body)
        if scan.error:
            return []
        deltas: list[DeltaToolCall] = []
        if self.name is None:
            member = scan.member("name")
            if member is None or member.value_end is None:
                return []
            name = _json_string(body[member.value_start : member.value_end])
            if name is None:
                return []
            self.name = name
            deltas.append(DeltaToolCall(self.index, id=self.id, name=name, arguments=""))
        arguments = _arguments_text(body, scan.member(*ARGUMENT_KEYS), complete=scan.end is not None)
        if arguments is not None and len(arguments) > len(self.arguments_sent):
            fragment = arguments[len(self.arguments_sent) :]
            self.arguments_sent = arguments
            if deltas:
                deltas[0].arguments = fragment
            else:
                deltas.append(DeltaToolCall(self.index, arguments=fragment))
        return deltas


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: text that must
    wait, in case the marker is arriving split over several deltas."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ContentGate:
    """Streamed content around tool calls, so that it joins (once stripped) to what extract() gives
    when it keeps the text before the first call and, after each call, only a stretch that holds more
    than whitespace: whitespace after a call waits, and is dropped if a call or the end follows."""

    def __init__(self) -> None:
        self._after_call = False
        self._pending = ""

    def text(self, text: str) -> str:
        """Content text arriving; returns what to send now."""
        if not self._after_call or not text:
            return text
        self._pending += text
        if not self._pending.strip():
            return ""
        out, self._pending, self._after_call = self._pending, "", False
        return out

    def call(self) -> None:
        """A call starts: whitespace held since the previous one is dropped."""
        self._pending = ""
        self._after_call = True


def join_content(pieces: list[str]) -> str | None:
    """extract()'s side of ContentGate: pieces[0] is the text before the first call, pieces[i] the
    text after call i; whitespace-only pieces after calls are dropped."""
    joined = pieces[0] + "".join(p for p in pieces[1:] if p.strip())
    return joined.strip() or None


class ToolParser(ABC):
    """One instance per response: extract() is stateless; feed()/finish() keep stream state.

    `tools` are the request's OpenAI tools ([{"type": "function", "function": {...}}]); parsers
    whose format carries untyped argument text (qwen3_coder) read the parameter schemas there."""

    name: ClassVar[str]
    # The format's markers are special tokens (Mistral's [TOOL_CALLS]): the reply must be decoded
    # with skip_special_tokens=False for the parser to see them, as vLLM's mistral parser asks.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self.tools_called = False  # set once a streamed call has sent its name

    def function_parameters(self, name: str) -> dict[str, Any]:
        """The JSON schema `properties` of the request's function `name` ({} when unknown)."""
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and function.get("name") == name:
                parameters = function.get("parameters")
                properties = parameters.get("properties") if isinstance(parameters, dict) else None
                return properties if isinstance(properties, dict) else {}
        return {}

    @abstractmethod
    def extract(self, text: str) -> ExtractedToolCalls: ...

    @abstractmethod
    def feed(self, delta: str) -> DeltaMessage:
        """Consume a text delta; returns what to send now (falsy when nothing)."""

    @abstractmethod
    def finish(self) -> DeltaMessage:
        """End of stream: release held-back text."""
