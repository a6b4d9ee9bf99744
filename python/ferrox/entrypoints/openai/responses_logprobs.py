"""Logprobs on /v1/responses (`include: ["message.output_text.logprobs"]`, `top_logprobs`): OpenAI's
output_text `logprobs` entries ({token, bytes, logprob, top_logprobs}). As vLLM does, they cover every
token the output generated (the message's part holds them all: a reply with thinking or tool calls
reports those tokens too); a stream's output_text.delta events carry the entries that came since the
last one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ferrox.entrypoints.openai.serving import chosen_entry, finite, token_text, top_entries
from ferrox.outputs import Logprob


class OutputTextLogprobs:
    def __init__(self, top_n: int, as_token_ids: bool) -> None:
        self.top_n, self.as_token_ids = top_n, as_token_ids
        self.entries: list[dict[str, Any]] = []
        self._sent = 0  # entries already on a delta event

    def add(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]] | None) -> None:
        for tid, position in zip(token_ids, logprobs or [], strict=False):
            chosen = chosen_entry(position, tid)
            self.entries.append({**self._entry(tid, chosen), "top_logprobs": [
                self._entry(t, lp) for t, lp in top_entries(position, self.top_n)]})

    def _entry(self, token_id: int, lp: Logprob) -> dict[str, Any]:
        text = token_text(token_id, lp, self.as_token_ids)
        return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": finite(lp.logprob)}

    def take_new(self) -> list[dict[str, Any]]:
        """The entries no delta event carried yet."""
        new, self._sent = self.entries[self._sent:], len(self.entries)
        return new
