"""ThinkingBudget: one request's `thinking_token_budget` (vLLM's rule), as the mask that ends its thinking.

A reasoning model thinks between `<think>` and `</think>`. With a budget of N, once a request has
thought N tokens its next token is forced to be `</think>` (its mask row allows that token alone), so
the answer starts there, within max_tokens. The count starts after the last `<think>`: the prompt's
when the prompt opens the thinking (DeepSeek-R1's template; the tokens after it count), else the one
the model writes (Qwen3). A `</think>` the model writes itself ends the count, and so does an answer
token (the parser's answer tags: Kimi-K2 opening its tool-call section while thinking, which is never
cut by a forced `</think>`); a later `<think>` starts a new one with the whole budget. A budget of 0 closes the thinking at once. No `<think>` in
sight, no count: a reply that does not open its thinking is not cut.

The structured-output manager owns these: it sees every kept token of a constrained request
(accept_tokens) and fills the mask rows the samplers apply (fill_bitmask, fill_rows), so a budget
needs no sampler or kernel of its own. Requests with a budget take no speculative drafts (the
engine core's _drafts_allowed): a forced row is one position, not a run of verified ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ThinkingBudget:
    __slots__ = ("budget", "start_token", "end_token", "answer_tokens", "thinking", "count")

    def __init__(self, budget: int, start_token: int, end_token: int, prompt_token_ids: Sequence[int],
                 answer_tokens: Sequence[int] = ()) -> None:
        if budget < 0:
            raise ValueError(f"thinking_token_budget: must be >= 0, got {budget}")
        self.budget = budget
        self.start_token = start_token
        self.end_token = end_token
        self.answer_tokens = frozenset(answer_tokens)  # tokens that end the thinking and start the answer
        self.thinking = False
        self.count = 0  # tokens thought since the last `<think>`
        # Where the prompt leaves off: inside the thinking when its last tag is `<think>`.
        for i in range(len(prompt_token_ids) - 1, -1, -1):
            token = prompt_token_ids[i]
            if token == end_token or token in self.answer_tokens:
                break
            if token == start_token:
                self.thinking = True
                self.count = len(prompt_token_ids) - 1 - i
                break

    def accept(self, token: int) -> None:
        """One kept token of the request's output."""
        if token == self.start_token:
            # The count runs from the last `<think>` (vLLM's rule; Qwen3 writes its own first).
            self.thinking, self.count = True, 0
        elif self.thinking:
            if token == self.end_token or token in self.answer_tokens:
                self.thinking = False
            else:
                self.count += 1

    def forced_token(self) -> int | None:
        """The token the next row must be (`</think>`), or None while the budget lasts."""
        return self.end_token if self.thinking and self.count >= self.budget else None

    def may_force_within(self, tokens: int) -> bool:
        """Whether `tokens` more kept tokens (not yet accepted: a step in flight) could make the next
        row forced. The engine asks before the previous step's tokens are accepted, to decide whether
        this step's sampling waits for a mask."""
        if self.thinking:
            return self.count + tokens >= self.budget
        return tokens > 0 and self.budget == 0  # the pending token may be `<think>`


def force_row(row: torch.Tensor, token: int) -> None:
    """Make one int32 allow-bits row allow `token` alone (llguidance's layout: bit j of word w allows
    token 32 * w + j)."""
    row.zero_()
    bit = token % 32
    # int32 words: bit 31 is the sign bit.
    row[token // 32] = (1 << bit) if bit < 31 else -(1 << 31)
