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

from ferrox.layers import logits_processors as lp
from ferrox.layers.rejection_sampler import rejection_sample
from ferrox.layers.sampler import LogprobsTensors, Sampler, SamplingMetadata, compute_logprobs


@dataclass(slots=True)
class VerifyResult:
    token_ids: torch.Tensor  # flat: each request's accepted drafts, then its own token (update_from_output's order)
    num_sampled: npt.NDArray[np.int32]  # [num_reqs] tokens per request (1 + accepted drafts)
    # One row per kept token, in token_ids' order (request r's num_sampled[r] rows together).
    logprobs: LogprobsTensors | None


def expand_rows(num_drafts: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
    """[sum(1 + d_r)] the request index of every logits row (request r's row repeated 1 + d_r times)."""
    return np.repeat(np.arange(num_drafts.size, dtype=np.int64), num_drafts.astype(np.int64) + 1)


def target_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Processed logits -> what the verifier compares with: the sampler's distribution on random rows
    (temperature, min-p, top-k/top-p, softmax, as Sampler._sample_random builds it before its draw),
    the processed logits themselves on greedy rows (argmax'ed as the plain sampler does)."""
    if md.all_greedy:
        return logits
    assert md.temperature is not None
    scaled = logits / md.temperature.unsqueeze(1)
    if md.min_p is not None:
        scaled = lp.apply_min_p(scaled, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        scaled = lp.apply_top_k_top_p(scaled, md.top_k, md.top_p)
    probs = torch.softmax(scaled, dim=-1)
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
    logits_start_loc: npt.NDArray[np.int32],
    greedy: npt.NDArray[np.bool_],
    generators: dict[int, torch.Generator],
) -> VerifyResult:
    """logits: [sum(1 + d_r), V] raw, edited in place; md: the sampling metadata of the expanded rows.
    greedy: [num_reqs]; generators: request index -> its seeded generator."""
    raw = logits.clone() if md.max_num_logprobs is not None else None
    sampler.apply_logits_processors(logits, md)
    target = target_probs(logits, md)
    out = rejection_sample(
        target, torch.from_numpy(np.ascontiguousarray(draft_token_ids, dtype=np.int64)), num_drafts,
        greedy=torch.from_numpy(np.ascontiguousarray(greedy, dtype=np.bool_)), generators=generators,
        default_generator=sampler.default_generator)
    num_sampled = out.num_sampled.cpu().numpy()
    token_ids = out.flat()
    logprobs = None
    if raw is not None:
        # Token j of request r (kept drafts first, then its own) was scored by row start_loc[r] + j.
        rows = np.concatenate([np.arange(n, dtype=np.int64) + start
                               for start, n in zip(logits_start_loc[:-1].tolist(), num_sampled.tolist(), strict=True)])
        logprobs = compute_logprobs(raw.index_select(0, torch.from_numpy(rows).to(logits.device)), token_ids,
                                    md.max_num_logprobs or 0)
    return VerifyResult(token_ids, num_sampled, logprobs)
