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

from ferrox.entrypoints.openai.tool_parsers.json_scan import Member, ObjectScan, ObjectScanner, scan_object

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
    """Streams one call body ({"name": ..., "arguments": {...}}) as it grows.

    update() takes only the body's new text: the scanner resumes where it stopped and the arguments go
    out as the slice that arrived, so a call of n characters costs O(n) in deltas of any size."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_tool_call_id()
        self.name: str | None = None
        self.arguments: Member | None = None  # the first "arguments" / "parameters" member, once seen
        self._scanner = ObjectScanner()
        self._members_seen = 0
        self._name_member: Member | None = None
        self._bad_name = False  # the name is complete and does not decode: this is no call
        self._string_arguments = False  # the arguments are a JSON string, sent decoded once complete
        self._sent = 0  # characters of the arguments text sent
        self._arguments_done = False  # the arguments text is final and sent (or never will be)

    @property
    def scan(self) -> ObjectScan:
        """scan_object() of the body so far."""
        return self._scanner.scan

    @property
    def length(self) -> int:
        return self._scanner.length

    def body(self) -> str:
        return self._scanner.text(0, self._scanner.length)

    def feed(self, text: str, begin: int = 0) -> None:
        """The body goes on with text[begin:]."""
        self._scanner.feed(text, begin)
        members = self._scanner.scan.members
        if len(members) == self._members_seen:
            return
        for m in members[self._members_seen :]:
            if m.key == "name":
                if self._name_member is None:
                    self._name_member = m
            elif m.key in ARGUMENT_KEYS and self.arguments is None:
                self.arguments = m
                self._string_arguments = self._scanner.text(m.value_start, m.value_start + 1) == '"'
        self._members_seen = len(members)

    def update(self, text: str) -> list[DeltaToolCall]:
        """The body goes on with text: what to send now."""
        self.feed(text)
        return self.deltas()

    def deltas(self) -> list[DeltaToolCall]:
        """What the body so far adds to what was sent: first id and name, then arguments text."""
        scan = self._scanner.scan
        if scan.error:
            return []
        deltas: list[DeltaToolCall] = []
        if self.name is None:
            member = self._name_member
            if self._bad_name or member is None or member.value_end is None:
                return []
            name = _json_string(self._scanner.text(member.value_start, member.value_end))
            if name is None:
                self._bad_name = True
                return []
            self.name = name
            deltas.append(DeltaToolCall(self.index, id=self.id, name=name, arguments=""))
        fragment = self._arguments_fragment(complete=scan.end is not None)
        if fragment:
            if deltas:
                deltas[0].arguments = fragment
            else:
                deltas.append(DeltaToolCall(self.index, arguments=fragment))
        return deltas

    def _arguments_fragment(self, complete: bool) -> str:
        """The arguments text (as _arguments_text reads it) that has not been sent yet."""
        if self._arguments_done:
            return ""
        member = self.arguments
        if member is None:
            if complete:
                self._arguments_done = True
                return "{}"
            return ""
        start, end = member.value_start, member.value_end
        if self._string_arguments:
            if end is None:
                return ""
            self._arguments_done = True
            return _json_string(self._scanner.text(start, end)) or ""
        if end is None:
            end = self._scanner.length
        else:
            self._arguments_done = True
        if end - start <= self._sent:
            return ""
        fragment = self._scanner.text(start + self._sent, end)
        self._sent = end - start
        return fragment


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker: text that must
    wait, in case the marker is arriving split over several deltas."""
    if not marker:
        return 0
    # The longest such suffix starts at the first marker[0], within reach, that the rest of text
    # goes on to match (a test per place where marker[0] occurs, not per suffix length).
    i = text.find(marker[0], len(text) - min(len(marker) - 1, len(text)))
    while i >= 0:
        if marker.startswith(text[i:]):
            return len(text) - i
        i = text.find(marker[0], i + 1)
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

    def into(self, out: DeltaMessage, text: str) -> None:
        """Content text arriving, what to send now appended to `out`'s content."""
        text = self.text(text)
        if text:
            out.content = (out.content or "") + text


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
