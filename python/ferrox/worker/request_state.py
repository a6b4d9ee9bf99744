"""Per-request state the model runner keeps across steps (one row of the persistent batch).

Added when the engine accepts a request, dropped when the engine hears it finished or aborted.
Preemption keeps it: a preempted request resumes with the same generator and penalty counts.
Its output count follows the tokens the core accepted (`InputBatch.append_accepted`), never
the runner's own samples: a sample the core drops (a preempted or stopped request's in-flight
token) must not count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ferrox.sampling_params import SamplingParams


@dataclass(slots=True)
class PromptLogprobsAccumulator:
    """Prompt logprobs arrive chunk by chunk (chunked prefill); positions 1..len-1 are filled."""

    num_top: int
    token_logprobs: dict[int, tuple[float, int, list[int], list[float]]] = field(default_factory=dict)
    emitted: bool = False


@dataclass(slots=True)
class RequestState:
    req_id: str
    slot: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_ids_for_min_tokens: list[int]  # EOS (unless ignore_eos) + stop_token_ids
    num_output_tokens: int = 0  # accepted by the core
    generator: torch.Generator | None = None  # only for seeded random sampling
    draws: int = 0  # steps this seeded request has sampled (its CUDA draws' Philox counter)
    # Device state only for requests that use it: penalties in a row of the batch's PenaltyRows.
    penalty_row: int | None = None
    allowed_mask: torch.Tensor | None = None  # [V] bool, allowed_token_ids
    prompt_logprobs: PromptLogprobsAccumulator | None = None
    # bad_words (ferrox.bad_words): one-token words' tokens, banned at every step; longer words, whose last
    # token is banned when the accepted output ends with the rest; the output tail those need.
    bad_tokens: list[int] = field(default_factory=list)
    bad_sequences: list[list[int]] = field(default_factory=list)
    recent_output: list[int] = field(default_factory=list)

    def init_bad_words(self) -> None:
        for seq in self.params.bad_words_token_ids or []:
            if len(seq) > 1:
                self.bad_sequences.append(seq)
            else:
                self.bad_tokens.append(seq[0])

    def note_output(self, tokens: list[int]) -> None:
        """Keep the accepted output's tail that the longest bad word's prefix can match."""
        keep = max(len(seq) for seq in self.bad_sequences) - 1
        self.recent_output.extend(tokens)
        del self.recent_output[:-keep]

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0

    # The mask is built on the host and copied from pinned memory without blocking: a request joins
    # while a step is in flight, and a blocking copy would wait for that step (see input_batch.py).
    def init_allowed_mask(self, vocab_size: int, device: torch.device) -> None:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[torch.tensor(self.params.allowed_token_ids or [], dtype=torch.int64)] = True
        self.allowed_mask = _to_device(mask, device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
