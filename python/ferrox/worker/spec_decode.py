"""Verification of a step that carries speculative drafts (the runner's side of issue 13).

A request with d drafts was computed as a causal query of 1 + d tokens; the forward pass gave it
1 + d logits rows (SchedulerOutput.logits_start_loc). Here those rows become target distributions
with the request's own sampling settings, and layers/rejection_sampler.py decides how many drafts
to keep plus one token of the target's own (the correction, or the bonus when all were kept).

Per-position sampling settings: the request's row of the persistent batch is repeated over its
1 + d positions (`expand`), so temperature, top-k/top-p/min-p, logit_bias and allowed_token_ids apply
at every position as they would one step at a time. Settings whose value depends on the tokens
before the position (penalties, min_tokens) are not expanded: the engine adds such requests with
allow_drafts=False, so they always have d = 0 here and their single row is exactly their
non-speculative row. A grammar's mask is per position (applied by the runner before this: the
grammar's state after each draft, StructuredOutputManager.fill_bitmask_with_drafts). Logprobs are reported for every token a request keeps: each comes from
the raw logits row that scored it (the row of its position), as one step at a time would.

Draft tokens are deterministic given the context (prompt lookup, or a draft model's argmax), so
verification runs with draft_probs=None: accept x with probability p(x), else draw from p without x
— the exact rejection sampling for a one-hot draft distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ferrox.layers.rejection_sampler import rejection_sample
from ferrox.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, processed_logits


@dataclass(slots=True)
class VerifyResult:
    # [num_reqs, max_drafts + 1] on the device: each request's accepted drafts, then its own token; -1 after.
    token_ids: torch.Tensor
    num_sampled: torch.Tensor  # [num_reqs] int32 on the device: tokens per request (1 + accepted drafts)
    # One row per logits row (request r's position j at logits_start_loc[r] + j), scoring token_ids[r, j]
    # (the rows past num_sampled[r] score a placeholder and are dropped on the host).
    logprobs: LogprobsTensors | None

    def last_tokens(self) -> torch.Tensor:
        """[num_reqs] each request's last token (what the next step's placeholder stands for)."""
        return self.token_ids.gather(1, (self.num_sampled.to(torch.int64) - 1)[:, None]).squeeze(1)


def expand_rows(num_drafts: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
    """[sum(1 + d_r)] the request index of every logits row (request r's row repeated 1 + d_r times)."""
    return np.repeat(np.arange(num_drafts.size, dtype=np.int64), num_drafts.astype(np.int64) + 1)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Processed logits -> what the verifier compares with: the sampler's distribution on random rows
    (temperature, min-p, top-k/top-p, softmax, as Sampler._sample_random builds it before its draw),
    the processed logits themselves on greedy rows (argmax'ed as the plain sampler does)."""
    if md.all_greedy:
        return logits
    probs = torch.softmax(processed_logits(logits, md), dim=-1)
    if md.greedy_rows is not None:
        return torch.where(md.greedy_rows.unsqueeze(1), logits, probs)
    return probs


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    md: SamplingMetadata,
    *,
    num_drafts: npt.NDArray[np.int32],
    draft_token_ids: npt.NDArray[np.int64],
    greedy: npt.NDArray[np.bool_],
    generators: dict[int, torch.Generator],
) -> VerifyResult:
    """logits: [sum(1 + d_r), V] raw, edited in place; md: the sampling metadata of the expanded rows.
    greedy: [num_reqs]; generators: request index -> its seeded generator. Nothing here waits for the
    device: the results stay there until the runner's copy to the host (async scheduling)."""
    scored = sampler.process(logits, md)
    target = target_probs(logits, md)
    out = rejection_sample(
        target, torch.from_numpy(np.ascontiguousarray(draft_token_ids, dtype=np.int64)), num_drafts,
        greedy=torch.from_numpy(np.ascontiguousarray(greedy, dtype=np.bool_)), generators=generators,
        default_generator=sampler.default_generator)
    logprobs = None
    if scored is not None:
        # Logits row start_loc[r] + j scored request r's token j: the padded tokens, laid out as the rows.
        rows = torch.from_numpy(expand_rows(num_drafts)).to(logits.device)
        cols = torch.from_numpy(np.concatenate([np.arange(d + 1) for d in num_drafts.tolist()])).to(logits.device)
        logprobs = sampler.logprobs(scored, out.token_ids[rows, cols].clamp(min=0), md)
    return VerifyResult(out.token_ids, out.num_sampled, logprobs)
