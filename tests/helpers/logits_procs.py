"""Custom logits processors for the tests (ferrox.logits_processor), each leaving its mark in the tokens:

- ForceToken: a request with extra_args {"force_token": T} samples T at every step (other rows untouched);
  per-row state moved by the BatchUpdates, so a mix-up of rows shows as another request's token.
- CountUp: extra_args {"count_from": C}: the token C + (tokens generated so far), read from the output list
  the processor was handed when the request was added -- stale lists show as repeated or skipped tokens.
- EchoPrompt (an AdapterLogitsProcessor): extra_args {"echo": true}: the prompt's tokens again, in order,
  from a per-request callable of (prompt_ids, output_ids, logits_row).
"""

from __future__ import annotations

from typing import Any

import torch
from ferrox.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, MoveDirectionality


def _only(logits_row: torch.Tensor, token: int) -> torch.Tensor:
    keep = logits_row[token].clone()
    logits_row.fill_(float("-inf"))
    logits_row[token] = keep
    return logits_row


class _PerRow(LogitsProcessor):
    """Row -> state, moved by the batch updates as vLLM's contract says (removed, added, moved)."""

    key = ""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, Any] = {}
        self.batch_size = 0
        self.max_num_seqs = config.max_num_seqs

    def state(self, params: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> Any:
        raise NotImplementedError

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self.batch_size = batch_update.batch_size
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for row, params, prompt_ids, output_ids in batch_update.added:
            assert self.max_num_seqs is None or row < self.max_num_seqs, row
            extra = params.extra_args or {}
            if self.key in extra:
                self.rows[row] = self.state(extra[self.key], prompt_ids, output_ids)
            else:
                self.rows.pop(row, None)
        for a, b, direction in batch_update.moved:
            sa, sb = self.rows.pop(a, None), self.rows.pop(b, None)
            if sa is not None:
                self.rows[b] = sa
            if direction is MoveDirectionality.SWAP and sb is not None:
                self.rows[a] = sb

    def is_argmax_invariant(self) -> bool:
        return False


class ForceToken(_PerRow):
    key = "force_token"

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        token = (sampling_params.extra_args or {}).get("force_token")
        if token is not None and (not isinstance(token, int) or token < 0):
            raise ValueError(f"force_token must be a token id, got {token!r}")

    def state(self, value: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> Any:
        return int(value)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        assert logits.shape[0] == self.batch_size, (logits.shape, self.batch_size)
        for row, token in self.rows.items():
            _only(logits[row], token)
        return logits


class CountUp(_PerRow):
    key = "count_from"

    def state(self, value: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> Any:
        return int(value), output_ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        out = logits.clone()  # (a new tensor: the engine copies it back)
        for row, (start, output_ids) in self.rows.items():
            _only(out[row], start + len(output_ids))
        return out


class EchoPrompt(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Any:
        if not (params.extra_args or {}).get("echo"):
            return None

        def echo(prompt_ids: list[int], output_ids: list[int], row: torch.Tensor) -> torch.Tensor:
            return _only(row, prompt_ids[len(output_ids) % len(prompt_ids)])

        return echo


class NotAProcessor:
    pass


class Boom(_PerRow):
    """Raises in apply while some row's request asked for it (extra_args {"boom": true}): a broken processor."""

    key = "boom"

    def state(self, value: Any, prompt_ids: list[int] | None, output_ids: list[int]) -> Any:
        return bool(value)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if any(self.rows.values()):
            raise RuntimeError("boom")
        return logits
