"""What each marker-based reasoning parser reads (vLLM's names and rules), as data for parser.py.

A family is: the markers that open and close the thinking, what output without an opening marker
is, the chat-template switch that turns thinking on or off, and whether the markers are tokens.

- deepseek_r1, qwen3, glm45: `<think>` / `</think>` (module docstring of parser.py). glm47 is vLLM's
  second name of glm45's parser (GLM-4.7 / GLM-5: their template ends the prompt with `<|assistant|><think>`,
  or `<|assistant|></think>` for `enable_thinking: false`). As in vLLM's parser for both names, a `<tool_call>`
  the model writes before any `</think>` ends the thinking (the call is the answer's: the tool parser reads it).
- kimi_k2: Kimi-K2-Thinking / K2.5 / K2.6. `<think>` / `</think>` are special tokens of Kimi's tokenizer
  (replies keep special tokens); output without `<think>` is reasoning (K2.5's template opens it in the
  prompt). The switch is the template variable `thinking` (on unless false: the template then writes an
  empty think block), not enable_thinking. The model may end its thinking without `</think>` by opening its
  tool-call section: `<|tool_calls_section_begin|>` ends the reasoning and starts the answer, where the
  kimi_k2 tool parser reads the calls. Whether the prompt closed the thinking is read after its last
  `<|im_assistant|>` (earlier turns keep their think blocks).
- seed_oss: ByteDance Seed-OSS's `<seed:think>` / `</seed:think>` (added tokens, not special), read as
  deepseek_r1 (vLLM's parser: output without `<seed:think>` is reasoning up to `</seed:think>`). The model
  opens the thinking itself; there is no on/off switch, but the template variable `thinking_budget: 0` writes
  a closed think block after the prompt's last `<seed:bos>assistant` (earlier assistant turns keep theirs, so
  the prompt is read after its last `<seed:bos>`), and the whole output is then the answer.
- deepseek_v3: DeepSeek-V3.1 / V3.2's hybrid thinking. Their template thinks only when the template
  variable `thinking` is true (it then ends the prompt with `<think>`, else with `</think>`); vLLM's
  parser also takes `enable_thinking: true` (which ferrox's reasoning_effort other than "none"
  sets). Thinking on: read as deepseek_r1; off: the whole output is the answer.
- mistral: Magistral's `[THINK]` / `[/THINK]`, control tokens of Mistral's tokenizers (so replies keep
  special tokens). The model opens its thinking itself; output without `[THINK]` is the answer
  (vLLM's rule), a stray `[/THINK]` is dropped. Magistral's system prompt spells out
  `[THINK]...[/THINK]`, so whether the prompt closed the thinking is read after its last `[/INST]`.
- granite: IBM Granite 3.2+'s plain-text markers "Here is my thought process:" and "Here is my
  response:" (vLLM also takes "Here's"), written when the template variable `thinking` is true.
  Output that does not open with the first marker is the answer. The markers are text, not tokens:
  the engine's grammar gate and thinking_token_budget (one end-of-thinking token) cannot see them,
  so both are refused with this parser, and reasoning tokens are not counted (0, as vLLM's).
- minimax_m2: MiniMax-M2 / M2.1 / M2.5. Their template ends the prompt with `]~b]ai\n<think>\n`, so the model
  writes only the thinking and `</think>`: output without `<think>` is reasoning (deepseek_r1's rule; vLLM's
  minimax_m2 parser), and there is no switch. (A `<minimax:tool_call>` does not end the thinking: vLLM's
  parser waits for `</think>`.)
- minimax_m2_append_think: vLLM's other MiniMax-M2 parser, for clients that keep the thinking in the
  conversation themselves (MiniMax's interleaved thinking: the next request sends it back as content). Nothing
  is split off: the content is the `<think>` the prompt opened, then the output as written, `</think>` and all
  (`inline`). The tags still drive the grammar gate, the thinking budget and the reasoning-token count.
- gemma4: Gemma 4 writes `<|channel>thought\n...<channel|>` (special tokens: replies keep them), the channel's
  `thought\n` label dropped as vLLM's parser drops it. Its template thinks only with `enable_thinking: true`
  (off, it closes an empty channel in the prompt); the model opens the channel itself, so output before a
  `<|channel>` is content (mistral's rule; vLLM drops such text). Gemma 4 goes on with its turn after a tool's
  response and may think again: the prompt is read after its last `<tool_response|>` (vLLM's parser reads it so
  too). A `<|tool_call>` written while thinking ends the thinking (vLLM's is_reasoning_end says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

THINK = ("<think>",), ("</think>",)
GLM_TOOL_CALL = "<tool_call>"
KIMI_TOOL_SECTION = "<|tool_calls_section_begin|>"
GEMMA4_CHANNEL = ("<|channel>",), ("<channel|>",)
MISTRAL_THINK = ("[THINK]",), ("[/THINK]",)
GRANITE_THINK = ("Here is my thought process:", "Here's my thought process:"), \
    ("Here is my response:", "Here's my response:")

KwargsRule = Callable[[Mapping[str, Any]], bool]


def _always(kwargs: Mapping[str, Any]) -> bool:
    return True


def _unless_enable_thinking_false(kwargs: Mapping[str, Any]) -> bool:
    # qwen3 / glm45: on by default; `enable_thinking: false` (or reasoning_effort "none") turns it off.
    return kwargs.get("enable_thinking") is not False


def _thinking_or_enable_thinking(kwargs: Mapping[str, Any]) -> bool:
    # deepseek_v3: off by default; vLLM's parser reads either variable as the switch.
    return bool(kwargs.get("thinking")) or bool(kwargs.get("enable_thinking"))


def _thinking(kwargs: Mapping[str, Any]) -> bool:
    # granite: the template asks for the markers only with `thinking: true`.
    return bool(kwargs.get("thinking"))


def _enable_thinking(kwargs: Mapping[str, Any]) -> bool:
    # gemma4: off by default; `enable_thinking: true` turns it on.
    return bool(kwargs.get("enable_thinking"))


def _unless_thinking_false(kwargs: Mapping[str, Any]) -> bool:
    # kimi_k2: on by default; `thinking: false` turns it off (vLLM reads the value as a bool).
    return bool(kwargs.get("thinking", True))


@dataclass(frozen=True, slots=True)
class Family:
    start_tags: tuple[str, ...]
    end_tags: tuple[str, ...]
    # Output not opening with a start tag is: "reasoning" (the prompt opened the thinking, R1), "content"
    # (granite), or "scan" (mistral: content, until a `[THINK]` opens the thinking).
    untagged: str
    thinks: KwargsRule = _always
    # The tags are single tokens (their ids drive the grammar gate, the budget and the token count).
    tags_are_tokens: bool = True
    # The tags are special tokens: the reply is decoded with skip_special_tokens=False.
    needs_special_tokens: bool = False
    # The token that opens the reply's turn: prompt_ends_reasoning reads the prompt after it only.
    turn_tag: str | None = None
    # Markers that end the thinking when no end tag came, and open the answer (they stay in it): a tool-call
    # section the model starts while thinking (Kimi-K2's, GLM's `<tool_call>`).
    answer_tags: tuple[str, ...] = ()
    # The thinking stays in the content, tags included, after the start tag the prompt opened (the start tag is
    # written first when the reply starts inside the thinking): nothing goes out as reasoning.
    inline: bool = False
    # Text the model writes right after the start tag, dropped with it when there (Gemma 4's `thought\n`).
    label: str = ""


# GLM-4.5 / 4.6 (glm45) and GLM-4.7 (glm47, vLLM's other name of the same parser).
_GLM = Family(*THINK, untagged="reasoning", thinks=_unless_enable_thinking_false, turn_tag="<|assistant|>",
              answer_tags=(GLM_TOOL_CALL,))

FAMILIES: dict[str, Family] = {
    "deepseek_r1": Family(*THINK, untagged="reasoning"),
    "qwen3": Family(*THINK, untagged="reasoning", thinks=_unless_enable_thinking_false),
    "glm45": _GLM,
    "glm47": _GLM,
    # (Seed-OSS's template opens every turn with <seed:bos>, and keeps earlier turns' think blocks.)
    "seed_oss": Family(("<seed:think>",), ("</seed:think>",), untagged="reasoning", turn_tag="<seed:bos>"),
    "deepseek_v3": Family(*THINK, untagged="reasoning", thinks=_thinking_or_enable_thinking),
    "mistral": Family(*MISTRAL_THINK, untagged="scan", needs_special_tokens=True, turn_tag="[/INST]"),
    "granite": Family(*GRANITE_THINK, untagged="content", thinks=_thinking, tags_are_tokens=False),
    "kimi_k2": Family(*THINK, untagged="reasoning", thinks=_unless_thinking_false, needs_special_tokens=True,
                      turn_tag="<|im_assistant|>", answer_tags=(KIMI_TOOL_SECTION,)),
    "minimax_m2": Family(*THINK, untagged="reasoning"),
    "minimax_m2_append_think": Family(*THINK, untagged="reasoning", inline=True),
    "gemma4": Family(*GEMMA4_CHANNEL, untagged="scan", thinks=_enable_thinking, needs_special_tokens=True,
                     turn_tag="<tool_response|>", answer_tags=("<|tool_call>",), label="thought\n"),
}
