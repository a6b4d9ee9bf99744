"""Builds the sampler's per-row tensors for one step from the persistent request states.

The static part (temperatures, top-k/p, min-p, logit_bias, allowed-token masks) depends only
on which requests are in the batch and in what order, so it is cached under that key: in steady
decoding the batch does not change between steps and the sampler reuses the same tensors.
The dynamic part (penalty counts, min_tokens bans, which seeded rows draw) is rebuilt per step
and only when some row needs it.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ferrox.layers.sampler import PenaltyInputs, SamplingMetadata
from ferrox.worker.request_state import RequestState


class SamplingBatchBuilder:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._key: tuple[str, ...] | None = None
        self._static: SamplingMetadata | None = None
        self._flags: tuple[bool, bool, bool] = (False, False, False)

    def build(self, states: list[RequestState], sample_mask: list[bool]) -> SamplingMetadata:
        key = tuple(s.req_id for s in states)
        if key != self._key or self._static is None:
            self._static = self._build_static(states)
            self._key = key
        md = self._static
        has_seeded, has_penalties, has_min_tokens = self._flags
        if not (has_seeded or has_penalties or has_min_tokens):
            return md
        md = replace(md)
        if has_seeded:
            md.generators = {
                i: s.generator for i, s in enumerate(states) if s.generator is not None and sample_mask[i]
            }
        if has_penalties:
            md.penalties = self._penalties(states)
        if has_min_tokens:
            md.banned = self._min_tokens_bans(states)
        return md

    def invalidate(self) -> None:
        self._key = None

    # ---- static part --------------------------------------------------------------------------
    def _build_static(self, states: list[RequestState]) -> SamplingMetadata:
        dev, vocab = self.device, self.vocab_size
        params = [s.params for s in states]
        greedy = [p.is_greedy for p in params]
        self._flags = (
            any(s.generator is not None for s in states),
            any(s.has_penalties for s in states),
            any(p.min_tokens > 0 for p in params),
        )
        max_lp = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        md = SamplingMetadata(all_greedy=all(greedy), max_num_logprobs=max_lp)
        if not md.all_greedy:
            if any(greedy):
                md.greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=dev)
            md.temperature = torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)], dtype=torch.float32, device=dev
            )
            if any(p.top_k > 0 for p in params):
                md.top_k = torch.tensor(
                    [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], dtype=torch.int64, device=dev
                )
            if any(p.top_p < 1.0 for p in params):
                md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        for i, p in enumerate(params):
            for tok, bias in (p.logit_bias or {}).items():
                bias_rows.append(i)
                bias_cols.append(tok)
                bias_vals.append(bias)
        if bias_rows:
            md.logit_bias = (
                torch.tensor(bias_rows, dtype=torch.int64, device=dev),
                torch.tensor(bias_cols, dtype=torch.int64, device=dev),
                torch.tensor(bias_vals, dtype=torch.float32, device=dev),
            )
        allowed_rows = [i for i, p in enumerate(params) if p.allowed_token_ids]
        if allowed_rows:
            masks = [states[i].ensure_allowed_mask(vocab, dev) for i in allowed_rows]
            md.allowed = (torch.tensor(allowed_rows, dtype=torch.int64, device=dev), torch.stack(masks))
        return md

    # ---- dynamic part ---------------------------------------------------------------------------
    def _penalties(self, states: list[RequestState]) -> PenaltyInputs | None:
        rows = [i for i, s in enumerate(states) if s.has_penalties]
        if not rows:
            return None
        for i in rows:
            states[i].ensure_penalty_state(self.vocab_size, self.device)
        sel = [states[i] for i in rows]
        dev = self.device
        return PenaltyInputs(
            rows=torch.tensor(rows, dtype=torch.int64, device=dev),
            prompt_mask=torch.stack([s.prompt_mask for s in sel]),  # type: ignore[misc]
            output_counts=torch.stack([s.output_counts for s in sel]),  # type: ignore[misc]
            repetition=torch.tensor([s.params.repetition_penalty for s in sel], dtype=torch.float32, device=dev),
            frequency=torch.tensor([s.params.frequency_penalty for s in sel], dtype=torch.float32, device=dev),
            presence=torch.tensor([s.params.presence_penalty for s in sel], dtype=torch.float32, device=dev),
        )

    def _min_tokens_bans(self, states: list[RequestState]) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows: list[int] = []
        cols: list[int] = []
        for i, s in enumerate(states):
            if s.in_min_tokens:
                rows.extend([i] * len(s.stop_ids_for_min_tokens))
                cols.extend(s.stop_ids_for_min_tokens)
        if not rows:
            return None
        dev = self.device
        return torch.tensor(rows, dtype=torch.int64, device=dev), torch.tensor(cols, dtype=torch.int64, device=dev)
