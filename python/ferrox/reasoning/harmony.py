"""gpt-oss's harmony response format: the `openai_gptoss` reasoning parser (vLLM's name).

After the prompt's `<|start|>assistant` a gpt-oss model writes one or more messages:

    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>

A message is a header (role, `<|channel|>NAME`, an optional ` to=RECIPIENT` before or after the
channel, an optional content type: `<|constrain|>json` or a bare `json`), `<|message|>`, a body, and a
terminator (`<|end|>`; `<|call|>` and `<|return|>` end the turn and are the model's stop tokens, so
the detokenized output usually lacks them). The markers are special tokens of o200k_harmony: the
reply must be decoded with skip_special_tokens=False (`needs_special_tokens`), as the routes do.

What each message is (vLLM's rules; here the same whole and streamed):
- `analysis` channel, and any message to a recipient that is not a function (gpt-oss's built-in
  browser / python tools, which ferrox never runs): reasoning;
- addressed `to=functions.NAME`: a tool call. With `tool_calls=True` (the request's tool parser is
  `openai`, which reads them) it passes into the content as one canonical harmony message, else it
  is dropped (vLLM's parse_chat_output leaves calls out of the content);
- `final`, and `commentary` without a recipient (a preamble before tool calls): content;
- text outside any message (a continued final message: the prompt ended inside it): content.
Two messages of one kind are joined by a newline, as vLLM joins them; control tokens never reach
either part. The split works on text (one implementation for whole outputs and deltas, so a streamed
answer concatenates to the non-streamed one); reasoning tokens are counted on token ids.

gpt-oss cannot stop thinking on request, and the end of its thinking is several tokens
(`<|channel|>final<|message|>`), not one: a structured output's grammar gate and thinking_token_budget
(both one end-of-thinking token in the engine) are refused with this parser (end_token_id is None).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ferrox.errors import InvalidArgumentError

NAME = "openai_gptoss"

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
TERMINATORS = (END, RETURN, CALL)
ANALYSIS = "analysis"
FUNCTIONS = "functions."
# What gpt-oss was trained on (the template writes `Reasoning: <effort>` into the system message).
REASONING_EFFORTS = ("low", "medium", "high")

_LONGEST = max(len(m) for m in MARKERS)
_MARKER_RE = re.compile("|".join(re.escape(m) for m in MARKERS))
_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_RE = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header: what comes between its start and `<|message|>`."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None

    @property
    def kind(self) -> str:
        """"call" (to a function), "reasoning" or "content" (module docstring)."""
        if self.recipient is not None:
            return "call" if self.recipient.startswith(FUNCTIONS) else "reasoning"
        return "reasoning" if self.channel == ANALYSIS else "content"

    @property
    def function_name(self) -> str:
        return (self.recipient or "").removeprefix(FUNCTIONS)

    def render(self) -> str:
        """The header as gpt-oss writes it, for a message passed on to the tool parser."""
        text = f"{START}assistant{CHANNEL}{self.channel or 'commentary'}"
        if self.recipient is not None:
            text += f" to={self.recipient}"
        if self.content_type is not None:
            text += f" {CONSTRAIN}{self.content_type}"
        return text + MESSAGE


def parse_header(text: str) -> Header:
    """The header text (markers included, `<|message|>` excluded): `assistant<|channel|>commentary
    to=functions.f <|constrain|>json`, `assistant to=functions.f<|channel|>commentary json`, ..."""
    channel = _CHANNEL_RE.search(text)
    recipient = _RECIPIENT_RE.search(text)
    content_type: str | None = None
    if CONSTRAIN in text:
        after = text.split(CONSTRAIN, 1)[1].split()
        content_type = after[0] if after else None
    elif channel is not None:
        # The template writes the type bare after the channel: `<|channel|>commentary json`.
        rest = _RECIPIENT_RE.sub("", text[channel.end():]).split()
        content_type = rest[0] if rest else None
    return Header((channel.group(1) or None) if channel else None,
                  recipient.group(1) if recipient else None, content_type)


def held_back(text: str) -> int:
    """Length of the end of `text` that may be the start of a marker. A marker has its `<` first and
    nowhere else, so only the last `<` within a marker's length can start one."""
    i = text.rfind("<", max(0, len(text) - _LONGEST + 1))
    return len(text) - i if i >= 0 and any(m.startswith(text[i:]) for m in MARKERS) else 0


@dataclass(slots=True)
class Event:
    """What the scanner read: "text" (outside any message), "open" (a header is complete),
    "body" (a message's text), "close" (its terminator, or "" at the end of the output)."""

    kind: str
    text: str = ""
    header: Header | None = None


class HarmonyScanner:
    """Harmony text in deltas -> events. Text that may be the start of a marker waits for the next
    delta; a header waits for its `<|message|>` (a header cut by the end of the output is dropped)."""

    __slots__ = ("state", "_pending", "_header")

    def __init__(self) -> None:
        self.state = "outside"  # "outside", "header" or "body"
        self._pending = ""
        self._header = ""

    def feed(self, delta: str, finished: bool = False) -> Iterator[Event]:
        text, self._pending = self._pending + delta, ""
        pos = 0
        while True:
            match = _MARKER_RE.search(text, pos)
            stop = match.start() if match else len(text) - (0 if finished else held_back(text[pos:]))
            piece = text[pos:stop]
            if self.state == "header":
                self._header += piece
            elif piece:
                yield Event("text" if self.state == "outside" else "body", piece)
            if match is None:
                self._pending = text[stop:]
                break
            yield from self._marker(match.group())
            pos = match.end()
        if finished:
            if self.state == "body":
                yield Event("close")
            self.state, self._header = "outside", ""

    def _marker(self, marker: str) -> Iterator[Event]:
        if marker in (START, CHANNEL):
            if self.state == "body":
                yield Event("close")
            if self.state != "header" or marker == START:  # a new header (a stray one is dropped)
                self._header = ""
            self.state = "header"
            self._header += marker if marker == CHANNEL else ""
        elif marker == MESSAGE:
            if self.state == "body":  # a second <|message|> in a body: no header of its own
                yield Event("close")
            header = parse_header(self._header) if self.state == "header" else Header()
            self.state, self._header = "body", ""
            yield Event("open", header=header)
        elif marker in TERMINATORS:
            if self.state == "body":
                yield Event("close", text=marker)
            self.state, self._header = "outside", ""
        elif self.state == "header":  # <|constrain|>: part of a header; dropped elsewhere
            self._header += marker


@dataclass(frozen=True, slots=True)
class HarmonyTokens:
    """The ids of the markers (and of `analysis`, the token after `<|channel|>` that opens a thinking)."""

    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int
    analysis: int


@dataclass(frozen=True, slots=True)
class HarmonyReasoningParser:
    """The `openai_gptoss` parser, with ReasoningParser's interface (ferrox.reasoning.parser)."""

    tokens: HarmonyTokens
    name: str = NAME
    # Harmony's markers are special tokens: the reply is decoded with skip_special_tokens=False.
    needs_special_tokens: ClassVar[bool] = True
    # No single token ends the thinking: the engine's grammar gate and thinking budget refuse this parser.
    start_token_id: ClassVar[None] = None
    end_token_id: ClassVar[None] = None
    answer_token_ids: ClassVar[tuple[int, ...]] = ()

    def thinks(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """gpt-oss always starts with a message header (its thinking, usually): there is no switch."""
        return True

    def check_template_kwargs(self, template_kwargs: Mapping[str, Any]) -> None:
        """The template writes reasoning_effort as it is: only the three efforts gpt-oss knows pass. Its
        `builtin_tools` would tell the model of a browser / python it may call, which ferrox never runs
        (vLLM offers them only with a tool server): refused."""
        effort = template_kwargs.get("reasoning_effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise InvalidArgumentError(f"reasoning_effort: gpt-oss (--reasoning-parser {NAME}) knows "
                                       f"{', '.join(REASONING_EFFORTS)}, not {effort!r} (it cannot stop thinking)",
                                       param="reasoning_effort")
        if template_kwargs.get("builtin_tools"):
            raise InvalidArgumentError("chat_template_kwargs: builtin_tools names gpt-oss's built-in tools (browser, "
                                       "python), which ferrox does not run; pass functions as `tools`",
                                       param="chat_template_kwargs")

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as gpt-oss's chat template reads it: an assistant turn's thinking under
        `thinking` (clients send back vLLM's `reasoning` / `reasoning_content`; the template renders it
        before the turn's tool call, as harmony asks), and a call's arguments as an object (OpenAI sends
        a JSON string, which the template's `arguments|tojson` would print quoted). A turn with content
        keeps it alone: the template refuses content and thinking together (it renders that content as
        the turn's analysis)."""
        out = []
        for message in messages:
            if message.get("role") != "assistant":
                out.append(message)
                continue
            message = dict(message)
            thought = message.get("reasoning") or message.get("reasoning_content")
            if "thinking" not in message and not message.get("content") and thought and isinstance(thought, str):
                message["thinking"] = thought
            if isinstance(message.get("tool_calls"), list):
                message["tool_calls"] = [_object_arguments(call) for call in message["tool_calls"]]
            out.append(message)
        return out

    def split(self, text: str, thinking: bool = True, tool_calls: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part."""
        reasoning, content = self.stream(thinking, tool_calls).feed(text, finished=True)
        return reasoning or None, content or None

    def stream(self, thinking: bool = True, tool_calls: bool = False) -> HarmonyReasoningStream:
        return HarmonyReasoningStream(self, tool_calls)

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Nothing to read in the prompt: an output that starts outside any message (a continued final
        message) is content by the split's own rule, and no gpt-oss template leaves the prompt inside
        a thinking. The engine's grammar gate never asks (end_token_id is None)."""
        return False

    def count_reasoning_tokens(self, token_ids: Sequence[int], thinking: bool = True) -> int:
        """Tokens of the analysis messages' bodies: usage.completion_tokens_details.reasoning_tokens."""
        stream = self.stream(thinking)
        stream.count_tokens(token_ids)
        return stream.reasoning_tokens


def _object_arguments(call: Any) -> Any:
    """A tool call whose function's arguments are JSON text, with them as the object they spell (text
    that is no JSON object stays as it is)."""
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if function is None or not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return call
    if not isinstance(parsed, dict):
        return call
    return {**call, "function": {**function, "arguments": parsed}}


def get_harmony_parser(token_to_id: Callable[[str], int | None]) -> HarmonyReasoningParser:
    """ValueError naming reasoning_parser when the tokenizer lacks harmony's markers as single tokens."""
    names = {"start": START, "end": END, "message": MESSAGE, "channel": CHANNEL, "constrain": CONSTRAIN,
             "return_": RETURN, "call": CALL, "analysis": ANALYSIS}
    ids = {field: token_to_id(text) for field, text in names.items()}
    missing = [names[field] for field, token in ids.items() if token is None]
    if missing:
        raise ValueError(f"reasoning_parser: {NAME!r} needs {', '.join(missing)} as single tokens of the tokenizer, "
                         "which does not have them (is this a gpt-oss model, with its o200k_harmony tokenizer?)")
    return HarmonyReasoningParser(HarmonyTokens(**{k: int(v) for k, v in ids.items() if v is not None}))


class HarmonyReasoningStream:
    """One choice's output, fed as text deltas: each feed returns (reasoning delta, content delta).
    `ended`: the answer has begun (a content message, a tool call, or text outside any message)."""

    __slots__ = ("parser", "tool_calls", "ended", "reasoning_tokens", "_scanner", "_kind", "_said", "_sep",
                 "_token_state", "_after_channel", "_counting")

    def __init__(self, parser: HarmonyReasoningParser, tool_calls: bool = False) -> None:
        self.parser = parser
        self.tool_calls = tool_calls
        self.ended = False
        self.reasoning_tokens = 0
        self._scanner = HarmonyScanner()
        self._kind = "content"  # the open message's kind (text outside messages is content)
        self._said = {"reasoning": False, "content": False}  # a message of that kind had text
        self._sep = False  # the open message needs a newline before its first text
        self._token_state = "outside"  # count_tokens: "outside", "header" or "body"
        self._after_channel = False
        self._counting = False  # the open message (by token ids) is an analysis one

    def count_tokens(self, token_ids: Sequence[int]) -> None:
        """Count the reasoning tokens among the next output tokens: the bodies of analysis messages."""
        t = self.parser.tokens
        for token in token_ids:
            if token in (t.start, t.channel):
                self._token_state = "header"
                self._after_channel = token == t.channel
                if token == t.start:
                    self._counting = False
                continue
            if token == t.message:
                self._token_state = "body"
                continue
            if token in (t.end, t.call, t.return_):
                self._token_state, self._counting = "outside", False
                continue
            if self._token_state == "header":
                if self._after_channel:
                    self._counting = token == t.analysis
                self._after_channel = False
            elif self._token_state == "body" and self._counting:
                self.reasoning_tokens += 1

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for event in self._scanner.feed(delta, finished):
            if event.kind == "open":
                assert event.header is not None
                self._kind = event.header.kind
                self._sep = self._kind != "call" and self._said[self._kind]
                if self._kind != "reasoning":
                    self.ended = True
                if self._kind == "call" and self.tool_calls:
                    content.append(event.header.render())
            elif event.kind == "close":
                if self._kind == "call" and self.tool_calls:
                    content.append(CALL)
                self._kind = "content"
            elif self._kind == "call":
                if self.tool_calls:
                    content.append(event.text)
            else:
                if event.kind == "text":
                    self.ended = True
                out = reasoning if self._kind == "reasoning" else content
                if self._sep:
                    out.append("\n")
                    self._sep = False
                out.append(event.text)
                self._said[self._kind] = True
        return "".join(reasoning), "".join(content)
