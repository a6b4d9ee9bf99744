"""The `<think>...</think>` reasoning parsers: `deepseek_r1`, `qwen3` and `glm45`, with vLLM's rules.

Both read the model's output as: optional leading whitespace and `<think>` (dropped), the
reasoning, `</think>`, the answer. They differ in what an output without `</think>` is:

- deepseek_r1: DeepSeek-R1 and its distills (and QwQ) always think; their chat template opens the
  `<think>` in the prompt. No `</think>` means the reasoning was cut short: all of it is reasoning.
- qwen3: Qwen3 thinks unless `chat_template_kwargs` says `enable_thinking: false` (ferrox's
  `reasoning_effort: "none"` says the same); the template then writes an empty think block into the
  prompt and the whole output is the answer. Thinking on and no `</think>`: all reasoning, as above.
- glm45: GLM-4.5 / 4.6 have Qwen3's switch (`enable_thinking: false` puts an empty think block after
  the prompt's last `<|assistant|>`; on, the model writes `<think>` itself), so they read as qwen3. One
  difference: GLM's template keeps a `<think></think>` in every earlier assistant turn, so whether the
  prompt closed the thinking is read after its last `<|assistant|>` only, as vLLM's glm45 parser does.

The split works on text, so the tags must reach the text: both model families have them as
added tokens that are not special (skip_special_tokens keeps them). The token ids are needed too:
the engine core counts reasoning tokens and opens a request's grammar when `</think>` is sampled;
a tokenizer without the tags as single tokens is refused at start-up, naming the parser.

One implementation serves both paths: `split` (a finished output) is `ReasoningStream.feed` over
the whole text, so a streamed answer is, concatenated, exactly the non-streamed one.

gpt-oss's harmony format has a parser of its own (`openai_gptoss`: reasoning/harmony.py) with the same
interface; get_reasoning_parser returns either.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ferrox.reasoning.harmony import NAME as HARMONY_NAME
from ferrox.reasoning.harmony import HarmonyReasoningParser, HarmonyReasoningStream, get_harmony_parser

# vLLM's names; the CLI's choices (ferrox.config imports this module, which imports no torch).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", HARMONY_NAME)
START_TAG = "<think>"
END_TAG = "</think>"
GLM_ASSISTANT = "<|assistant|>"  # where a GLM prompt's reply turn starts


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    name: str
    start_token_id: int
    end_token_id: int
    # qwen3: `enable_thinking: false` in the template kwargs means the output is all answer.
    switchable: bool
    start_tag: str = START_TAG
    end_tag: str = END_TAG
    # glm45: the token that opens the reply's turn; prompt_ends_reasoning reads the prompt after it only.
    turn_token_id: int | None = None
    # The tags are text tokens: the reply keeps them with skip_special_tokens (harmony's markers are not).
    needs_special_tokens: ClassVar[bool] = False

    def check_template_kwargs(self, template_kwargs: Mapping[str, Any]) -> None:
        """Nothing to refuse: the template reads enable_thinking / reasoning_effort as it likes."""

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as they are (the `<think>` templates read reasoning_content themselves)."""
        return messages

    def thinks(self, template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request's output starts inside the model's thinking (vLLM's rule per parser)."""
        return not (self.switchable and template_kwargs and template_kwargs.get("enable_thinking") is False)

    def split(self, text: str, thinking: bool = True, tool_calls: bool = False) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part. tool_calls: whether a
        tool parser reads the content (harmony's parser keeps its calls then; here calls are text)."""
        stream = self.stream(thinking)
        reasoning, content = stream.feed(text, finished=True)
        return reasoning or None, content or None

    def stream(self, thinking: bool = True, tool_calls: bool = False) -> ReasoningStream:
        return ReasoningStream(self, thinking)

    def prompt_ends_reasoning(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt already closed the thinking (its last tag is `</think>`: Qwen3's empty think
        block for enable_thinking false). Otherwise a structured-output constraint waits for the
        output's `</think>` (vLLM's rule)."""
        for token in reversed(prompt_token_ids):
            if token == self.end_token_id:
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
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser: {name!r} is not one of {', '.join(REASONING_PARSERS)}")
    if name == HARMONY_NAME:
        return get_harmony_parser(token_to_id)
    ids = {tag: token_to_id(tag) for tag in (START_TAG, END_TAG)}
    missing = [tag for tag, token in ids.items() if token is None]
    if missing:
        raise ValueError(f"reasoning_parser: {name!r} needs {' and '.join(missing)} as single tokens of the "
                         "tokenizer, which does not have them (is this a reasoning model?)")
    start, end = ids[START_TAG], ids[END_TAG]
    assert start is not None and end is not None
    # A GLM tokenizer without <|assistant|> (a test's): the prompt is read back to its last tag, as qwen3's.
    turn = token_to_id(GLM_ASSISTANT) if name == "glm45" else None
    return ReasoningParser(name, start, end, switchable=name in ("qwen3", "glm45"), turn_token_id=turn)


class ReasoningStream:
    """One choice's output, fed as text deltas: each feed returns (reasoning delta, content delta).

    States: "start" (only whitespace or a part of `<think>` seen: held back, since a leading
    `<think>` and the whitespace before it are dropped), "reasoning", "content". Text that could be
    the beginning of a tag is held back until the next delta says whether it is one."""

    __slots__ = ("parser", "state", "_pending", "reasoning_tokens", "_counting")

    def __init__(self, parser: ReasoningParser, thinking: bool = True) -> None:
        self.parser = parser
        self.state = "start" if thinking else "content"
        self._pending = ""
        self.reasoning_tokens = 0  # the output's tokens before `</think>`, tags excluded (count_tokens)
        self._counting = thinking

    def count_tokens(self, token_ids: Sequence[int]) -> None:
        """Count the reasoning tokens among the next output tokens (the count stops at `</think>`)."""
        for token in token_ids:
            if not self._counting:
                return
            if token == self.parser.end_token_id:
                self._counting = False
            elif token != self.parser.start_token_id:
                self.reasoning_tokens += 1

    @property
    def ended(self) -> bool:
        """The reasoning is over (`</think>` seen, or the output never had any)."""
        return self.state == "content"

    def feed(self, delta: str, finished: bool = False) -> tuple[str, str]:
        text, self._pending = self._pending + delta, ""
        reasoning: list[str] = []
        while True:
            if self.state == "content":
                return "".join(reasoning), text
            if self.state == "start":
                head = text.lstrip()
                if head.startswith(self.parser.start_tag):
                    text, self.state = head[len(self.parser.start_tag):], "reasoning"
                    continue
                if not finished and self.parser.start_tag.startswith(head):  # "" or a part of the tag
                    self._pending = text
                    return "", ""
                self.state = "reasoning"  # no opening tag: the text so far is reasoning, whitespace included
                continue
            end = text.find(self.parser.end_tag)
            if end >= 0:
                reasoning.append(text[:end])
                text, self.state = text[end + len(self.parser.end_tag):], "content"
                continue
            keep = len(text) - (0 if finished else _tag_prefix_len(text, self.parser.end_tag))
            reasoning.append(text[:keep])
            self._pending = text[keep:]
            return "".join(reasoning), ""


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (text to hold back)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# Either kind of parser (and of its stream): what the engine and the routes hold.
AnyReasoningParser = ReasoningParser | HarmonyReasoningParser
AnyReasoningStream = ReasoningStream | HarmonyReasoningStream
