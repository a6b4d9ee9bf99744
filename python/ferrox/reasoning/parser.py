"""The marker-based reasoning parsers: `deepseek_r1`, `qwen3`, `glm45` (and its other name `glm47`),
`deepseek_v3`, `mistral`, `granite` and `kimi_k2`, with vLLM's rules (the markers and switches of each:
families.py).

The `<think>` families read the model's output as: optional leading whitespace and `<think>`
(dropped), the reasoning, `</think>`, the answer. They differ in what an output without `</think>` is:

- deepseek_r1: DeepSeek-R1 and its distills (and QwQ) always think; their chat template opens the
  `<think>` in the prompt. No `</think>` means the reasoning was cut short: all of it is reasoning.
- qwen3: Qwen3 thinks unless `chat_template_kwargs` says `enable_thinking: false` (ferrox's
  `reasoning_effort: "none"` says the same); the template then writes an empty think block into the
  prompt and the whole output is the answer. Thinking on and no `</think>`: all reasoning, as above.
- glm45: GLM-4.5 / 4.6 have Qwen3's switch (`enable_thinking: false` puts an empty think block after
  the prompt's last `<|assistant|>`; on, the model writes `<think>` itself), so they read as qwen3. One
  difference: GLM's template keeps a `<think></think>` in every earlier assistant turn, so whether the
  prompt closed the thinking is read after its last `<|assistant|>` only, as vLLM's glm45 parser does.
- deepseek_v3: DeepSeek-V3.1's switch is the other way round (off unless `thinking: true`); on, it
  reads as deepseek_r1, off the whole output is the answer.
- kimi_k2: Kimi-K2-Thinking / K2.5 read as deepseek_r1 unless `thinking: false` (then all answer), with the
  prompt read after its last `<|im_assistant|>` as glm45's after `<|assistant|>`.
A family may also name answer tags (kimi_k2's `<|tool_calls_section_begin|>`, glm45's `<tool_call>`): a model
that opens its tool calls while still thinking has ended its thinking there, and the tag starts the answer
(kept in it, for the tool parser), as vLLM's parsers read it.
mistral (`[THINK]` / `[/THINK]`) and granite (text markers) differ in what comes before the opening
marker: see families.py. minimax_m2 reads as deepseek_r1 (MiniMax-M2's prompt opens the `<think>`);
minimax_m2_append_think (an `inline` family) splits nothing off: the content is `<think>` and the output as
written, while the tags' ids still serve the engine as above. gemma4 (`<|channel>` / `<channel|>`) reads as
mistral, with its channel's `thought\n` label dropped (families.py).

The split works on text, so the tags must reach the text: the `<think>` families have them as added
tokens that are not special (skip_special_tokens keeps them); Mistral's are special (the reply keeps
special tokens: needs_special_tokens). The token ids are needed too: the engine core counts reasoning
tokens and opens a request's grammar when the end tag is sampled; a tokenizer without the tags as
single tokens is refused at start-up, naming the parser. Granite's markers are text: its parser has no
ids (end_token_id None), and the engine refuses what needs them, as for gpt-oss.

One implementation serves both paths: `split` (a finished output) is `ReasoningStream.feed` over
the whole text, so a streamed answer is, concatenated, exactly the non-streamed one.

gpt-oss's harmony format has a parser of its own (`openai_gptoss`: reasoning/harmony.py) with the same
interface; get_reasoning_parser returns either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ferrox.reasoning.families import FAMILIES, Family
from ferrox.reasoning.harmony import NAME as HARMONY_NAME
from ferrox.reasoning.harmony import HarmonyReasoningParser, HarmonyReasoningStream, get_harmony_parser

# vLLM's names of ferrox's own parsers (ferrox.config imports this module, which imports no torch).
REASONING_PARSERS = (*FAMILIES, HARMONY_NAME)


def reasoning_parser_names() -> tuple[str, ...]:
    """Every parser name: the built-in ones and those a --reasoning-parser-plugin registered (plugin.py)."""
    return (*FAMILIES, HARMONY_NAME)


class _ParserNames:
    """The CLI's choices of --reasoning-parser, read when asked (a plugin adds names after import)."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(reasoning_parser_names())

    def __contains__(self, name: object) -> bool:
        return name in reasoning_parser_names()

    def __len__(self) -> int:
        return len(reasoning_parser_names())


REASONING_PARSER_CHOICES = _ParserNames()
START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    family: Family
    # The tags' token ids; None for text markers (granite).
    start_token_id: int | None
    end_token_id: int | None
    # glm45 / mistral: the token that opens the reply's turn; prompt_ends_reasoning reads the prompt after it.
    turn_token_id: int | None = None
    # The family's answer tags that are single tokens: they end the thinking too (count, prompt, budget).
    answer_token_ids: tuple[int, ...] = ()

    @property
    def needs_special_tokens(self) -> bool:
        """The tags are special tokens (Mistral's): replies keep them, or the split never sees them."""
        return self.family.needs_special_tokens

    def check_template_kwargs(self, template_kwargs: Mapping[str, Any]) -> None:
        """Nothing to refuse: the template reads enable_thinking / reasoning_effort as it likes."""

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as they are (the `<think>` templates read reasoning_content themselves)."""
        return messages

    def thinks(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request's output starts inside the model's thinking (vLLM's rule per parser)."""
        return self.family.thinks(template_kwargs or {})

    def split(self, text: str, thinking: bool = True, tool_calls: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part. tool_calls: whether a
        tool parser reads the content (harmony's parser keeps its calls then; here calls are text)."""
        stream = self.stream(thinking)
        reasoning, content = stream.feed(text, finished=True)
        return reasoning or None, content or None

    def stream(self, thinking: bool = True, tool_calls: bool = False) -> ReasoningStream:
        return ReasoningStream(self, thinking)

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt already closed the thinking (its last tag is the end tag: Qwen3's empty
        think block for enable_thinking false, DeepSeek-V3.1's `</think>` for thinking off; or an answer
        tag, a tool-call section a prefilled reply opened). Otherwise a structured-output constraint waits
        for the output's end tag (vLLM's rule). Text markers (granite) have no ids: never."""
        if self.end_token_id is None:
            return False
        for token in reversed(prompt_token_ids):
            if token == self.end_token_id or token in self.answer_token_ids:
                return True
            if token == self.start_token_id or token == self.turn_token_id:
                return False
        return False

    def count_reasoning_tokens(self, token_ids: Sequence[int], thinking: bool = True) -> int:
        """Output tokens of the reasoning (tags excluded): usage.completion_tokens_details.reasoning_tokens."""
        stream = self.stream(thinking)
        stream.count_tokens(token_ids)
        return stream.reasoning_tokens


def get_reasoning_parser(name: str, token_to_id: Callable[[str], int | None]) -> AnyReasoningParser:
    """The parser `name` for a tokenizer (its token_to_id); ValueError naming reasoning_parser when the
    name is unknown or the tokenizer lacks the tags as single tokens."""
    if name not in reasoning_parser_names():
        raise ValueError(f"reasoning_parser: {name!r} is not one of {', '.join(reasoning_parser_names())}")
    if name == HARMONY_NAME:
        return get_harmony_parser(token_to_id)
    family = FAMILIES[name]
    if not family.tags_are_tokens:
        return ReasoningParser(name, family, None, None)
    start_tag, end_tag = family.start_tags[0], family.end_tags[0]
    ids = {tag: token_to_id(tag) for tag in (start_tag, end_tag)}
    missing = [tag for tag, token in ids.items() if token is None]
    if missing:
        raise ValueError(f"reasoning_parser: {name!r} needs {' and '.join(missing)} as single tokens of the "
                         "tokenizer, which does not have them (is this a reasoning model?)")
    # A tokenizer without the turn token (a test's): the prompt is read back to its last tag, as qwen3's.
    turn = token_to_id(family.turn_tag) if family.turn_tag is not None else None
    # Answer tags that are no single token still end the thinking in the text; only their ids are missing.
    answer_ids = tuple(token for tag in family.answer_tags if (token := token_to_id(tag)) is not None)
    return ReasoningParser(name, family, ids[start_tag], ids[end_tag], turn_token_id=turn, answer_token_ids=answer_ids)


class ReasoningStream:
    """One choice's output, fed as text deltas: each feed returns (reasoning delta, content delta).

    States: "start" (only whitespace or a part of a start tag seen: held back, since a leading start
    tag and the whitespace before it are dropped), "scan" (mistral's content before its `[THINK]`),
    "label" (just after a start tag: the family's label, Gemma 4's `thought\n`, dropped when it comes),
    "reasoning" (up to an end tag, dropped, or an answer tag, kept in the content), "content". Text that
    could be the beginning of a tag is held back until the next delta says whether it is one."""

    __slots__ = ("parser", "state", "_pending", "reasoning_tokens", "_counting", "_prefix")

    def __init__(self, parser: ReasoningParser, thinking: bool = True) -> None:
        self.parser = parser
        inline = parser.family.inline
        self.state = "start" if thinking and not inline else "content"
        self._pending = ""
        # inline: the start tag the prompt opened, written before the output (vLLM's minimax_m2_append_think).
        self._prefix = parser.family.start_tags[0] if thinking and inline else ""
        self.reasoning_tokens = 0  # the output's tokens within the thinking, tags excluded (count_tokens)
        # "on" (counting), "wait" (for the start tag: mistral) or "off"; text markers have no ids to count.
        untagged = parser.family.untagged
        self._counting = ("off" if not thinking or parser.end_token_id is None or untagged == "content"
                          else "wait" if untagged == "scan" else "on")

    def count_tokens(self, token_ids: Sequence[int]) -> None:
        """Count the reasoning tokens among the next output tokens (the count stops at the end tag)."""
        for token in token_ids:
            if self._counting == "off":
                return
            if token == self.parser.start_token_id:
                self._counting = "on"
            elif self._counting == "on":
                if token == self.parser.end_token_id or token in self.parser.answer_token_ids:
                    self._counting = "off"
                else:
                    self.reasoning_tokens += 1

    @property
    def ended(self) -> bool:
        """The reasoning is over (the end tag seen, or the output never had any)."""
        return self.state == "content"

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        family = self.parser.family
        text, self._pending, self._prefix = self._prefix + self._pending + delta, "", ""
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.state == "content":
                content.append(text)
                break
            if self.state == "start":
                head = text.lstrip()
                tag = next((t for t in family.start_tags if head.startswith(t)), None)
                if tag is not None:
                    text, self.state = head[len(tag):], "label"
                    continue
                if not finished and any(t.startswith(head) for t in family.start_tags):  # "" or a part of a tag
                    self._pending = text
                    break
                self.state = family.untagged  # no opening tag: the text so far is that, whitespace included
                continue
            if self.state == "label":  # just after a start tag: the family's label, if written, is dropped
                label = family.label
                if label and text.startswith(label):
                    text = text[len(label):]
                elif label and not finished and label.startswith(text):  # "" or a part of the label
                    self._pending = text
                    break
                self.state = "reasoning"
                continue
            # "scan" looks for either tag (a stray end tag is dropped), "reasoning" for the end tag or an
            # answer tag (which stays: it opens the answer).
            tags = (family.start_tags + family.end_tags if self.state == "scan"
                    else family.end_tags + family.answer_tags)
            out = content if self.state == "scan" else reasoning
            at, tag = _find_first(text, tags)
            if tag is not None:
                out.append(text[:at])
                text = text[at:] if tag in family.answer_tags else text[at + len(tag):]
                if self.state == "reasoning":
                    self.state = "content"
                elif tag in family.start_tags:
                    self.state = "label"
                continue
            keep = len(text) - (0 if finished else _tag_prefix_len(text, tags))
            out.append(text[:keep])
            self._pending = text[keep:]
            break
        return "".join(reasoning), "".join(content)


def _find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """The first tag in `text` and where it starts; (-1, None) when there is none."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    if not found:
        return -1, None
    at, tag = min(found, key=lambda hit: (hit[0], -len(hit[1])))
    return at, tag


def _tag_prefix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags` (text to hold back)."""
    for n in range(min(len(text), max(map(len, tags)) - 1), 0, -1):
        if any(len(tag) > n and text.endswith(tag[:n]) for tag in tags):
            return n
    return 0


# Either kind of parser (and of its stream): what the engine and the routes hold.
AnyReasoningParser = ReasoningParser | HarmonyReasoningParser
AnyReasoningStream = ReasoningStream | HarmonyReasoningStream
