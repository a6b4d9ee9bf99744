"""Verification of speculative drafts: which drafted tokens the target model keeps.

A request with d drafts was computed at 1 + d positions in one forward pass; its target
distributions p_0..p_d are the logits rows `logits_start_loc[r]:logits_start_loc[r + 1]` of the
step (p_j predicts the token after draft j - 1; p_d, after the last draft, gives the bonus token).

Greedy rows keep the longest prefix of drafts equal to the target's argmax, then add the argmax at
the first mismatch (or at p_d when all matched): exactly the tokens plain greedy decoding produces.

Sampled rows use speculative sampling (Leviathan et al. 2023; Chen et al. 2023), which leaves
the output distributed exactly as sampling from the target alone: draft x_j, proposed with
probability q_j(x_j), is accepted with probability min(1, p_j(x_j) / q_j(x_j)); at the first
rejection the token is drawn from the residual normalize(max(p_j - q_j, 0)); when all d are
accepted a bonus token is drawn from p_d. An n-gram draft is deterministic (q_j is one-hot), so it
is accepted with probability p_j(x_j) and the residual is p_j with x_j removed.

Randomness: a row with a seeded `torch.Generator` draws exactly d uniforms then one U[0,1) vector
over the vocabulary from it, so its tokens depend only on its seed, drafts and distributions, not on
the rest of the batch. Other rows share `default_generator`. The final draw is the exponential
race (argmax(dist / Exp(1))), as in layers/sampler.py.

Everything runs on the device of `target_probs`; the per-row draft counts and the drafts are host data (they
come from SchedulerOutput.num_draft_tokens and draft_token_ids).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch


@dataclass(slots=True)
class RejectionOutput:
    token_ids: torch.Tensor  # [num_reqs, max_drafts + 1] int64: accepted drafts, then the row's own token; -1 after
    num_sampled: torch.Tensor  # [num_reqs] int32: accepted drafts + 1

    def flat(self) -> torch.Tensor:
        """The tokens row after row, without padding: `update_from_output`'s sampled_token_ids, with
        `num_sampled` as its num_sampled_tokens."""
        return self.token_ids[self.token_ids >= 0]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: Sequence[int] | npt.NDArray[np.int32] | torch.Tensor,
    *,
    draft_probs: torch.Tensor | None = None,
    greedy: torch.Tensor | None = None,
    generators: dict[int, torch.Generator] | None = None,
    default_generator: torch.Generator | None = None,
) -> RejectionOutput:
    """target_probs: [sum(d_r + 1), V] the target's probabilities (after temperature, top-k/top-p,
    penalties...) at each request's 1 + d_r verify positions, request after request. Greedy rows
    are only argmax'ed, so they may hold logits instead.
    draft_token_ids: [sum(d_r)] the drafts, request after request (host: SchedulerOutput.draft_token_ids).
    num_draft_tokens: [num_reqs] d_r (host).
    draft_probs: [sum(d_r), V] the draft model's q_j; None for deterministic (n-gram) drafts.
    greedy: [num_reqs] bool, True for greedy rows; None: every row is sampled.
    generators: request index -> seeded generator (on the probabilities' device)."""
    device = target_probs.device
    counts_np = np.asarray(num_draft_tokens, dtype=np.int64).reshape(-1)
    num_reqs = counts_np.size
    max_d = int(counts_np.max()) if num_reqs else 0
    # The padded index arrays are built on the host (the counts and drafts are host data) and cross to the
    # device as one copy: a verify step runs every step of a speculating engine, and each small upload or index
    # op is a launch the step's latency pays for (benches/bench_rejection.py).
    packed = torch.from_numpy(_pad_plan(counts_np, np.asarray(draft_token_ids, dtype=np.int64), max_d))
    if packed.device != device:  # (pinned, so the copy is queued and the host goes on)
        packed = packed.pin_memory().to(device, non_blocking=True)
    target_rows, padded, draft_idx, valid = _unpack(packed, num_reqs, max_d)
    counts = torch.from_numpy(counts_np)

    greedy_mask = np.zeros(num_reqs, dtype=bool) if greedy is None else greedy.to("cpu", torch.bool).numpy()
    accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    token = torch.empty(num_reqs, dtype=torch.int64, device=device)
    for is_greedy in (True, False):
        rows_np = np.flatnonzero(greedy_mask == is_greedy)
        if rows_np.size == 0:
            continue
        whole = rows_np.size == num_reqs  # (the usual case: no row selection to launch)
        rows_dev = None if whole else torch.from_numpy(rows_np).to(device)
        rows_target, rows_padded, rows_valid, rows_idx = (t if rows_dev is None else t[rows_dev]
                                                          for t in (target_rows, padded, valid, draft_idx))
        if is_greedy:
            acc, tok = _verify_greedy(target_probs, rows_target, rows_padded, rows_valid)
        else:
            gens = {i: generators[int(r)] for i, r in enumerate(rows_np.tolist()) if generators and int(r) in generators}
            acc, tok = _verify_sampled(target_probs, rows_target, rows_padded, rows_valid,
                                       counts[torch.from_numpy(rows_np)], draft_probs, rows_idx, gens,
                                       default_generator)
        if rows_dev is None:
            accepted, token = acc, tok
        else:
            accepted[rows_dev] = acc
            token[rows_dev] = tok
    # Each row: its accepted drafts, then its own token at column `accepted`, -1 after.
    columns = torch.arange(max_d + 1, device=device)[None, :]
    out = torch.where(columns < accepted[:, None], torch.nn.functional.pad(padded, (0, 1)), -1)
    out.scatter_(1, accepted[:, None], token[:, None])
    return RejectionOutput(out, (accepted + 1).to(torch.int32))


def _pad_plan(counts: npt.NDArray[np.int64], drafts: npt.NDArray[np.int64], max_d: int) -> npt.NDArray[np.int64]:
    """The [num_reqs, max_d (+ 1)] padded views of a verify step as one int64 host array, in `_unpack`'s order:
    target_rows (request r's position j, clamped to its bonus position), the padded drafts, each padded draft's
    index in the flat drafts (padding points at some real draft: never used), and which are real."""
    num_reqs = counts.size
    row_start = np.zeros(num_reqs, dtype=np.int64)
    row_start[1:] = np.cumsum(counts + 1)[:-1]
    j = np.arange(max_d + 1, dtype=np.int64)
    target_rows = row_start[:, None] + np.minimum(j[None, :], counts[:, None])
    valid = j[None, :max_d] < counts[:, None]
    draft_start = row_start - np.arange(num_reqs, dtype=np.int64)
    draft_idx = draft_start[:, None] + np.minimum(j[None, :max_d], np.maximum(counts - 1, 0)[:, None])
    draft_idx = np.minimum(draft_idx, max(drafts.size - 1, 0))
    padded = drafts.reshape(-1)[draft_idx] if drafts.size else np.zeros((num_reqs, max_d), dtype=np.int64)
    return np.concatenate([a.reshape(-1).astype(np.int64, copy=False) for a in (target_rows, padded, draft_idx, valid)])


def _unpack(packed: torch.Tensor, num_reqs: int, max_d: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_pad_plan`'s array as (target_rows [R, D + 1], padded drafts [R, D], draft_idx [R, D], valid [R, D] bool)."""
    cells = num_reqs * max_d
    target_rows, padded, draft_idx, valid = packed.split([num_reqs * (max_d + 1), cells, cells, cells])
    return (target_rows.view(num_reqs, max_d + 1), padded.view(num_reqs, max_d), draft_idx.view(num_reqs, max_d),
            valid.view(num_reqs, max_d).bool())


def _leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[R, D] bool -> [R] length of the run of True at the start of each row."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.int64, device=mask.device)
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


def _verify_greedy(target: torch.Tensor, target_rows: torch.Tensor, drafts: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    argmax = target.argmax(dim=-1)[target_rows]  # [R, D + 1]
    accepted = _leading_true((drafts == argmax[:, :-1]) & valid)
    return accepted, argmax.gather(1, accepted[:, None]).squeeze(1)


def _accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Accept with probability min(1, p / q): u < p / q, written without the division (q > 0 for a
    token the draft proposed; p = 0 is never accepted)."""
    return u * q_draft < p_draft


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) per row; p itself where nothing is left (p <= q everywhere, which only
    happens where the draft is always accepted, so the row is never used)."""
    r = (p - q).clamp_(min=0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def _verify_sampled(target: torch.Tensor, target_rows: torch.Tensor, drafts: torch.Tensor, valid: torch.Tensor,
                    counts: torch.Tensor, draft_probs: torch.Tensor | None, draft_idx: torch.Tensor,
                    generators: dict[int, torch.Generator],
                    default_generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    device, vocab = target.device, target.shape[-1]
    num, max_d = drafts.shape
    probs = target.float()
    # Uniforms for acceptance: a seeded row draws exactly its d_r of them from its generator.
    u = torch.rand(num, max_d, device=device, generator=default_generator) if max_d else torch.empty(num, 0, device=device)
    for i, g in generators.items():
        d = int(counts[i])
        if d:
            u[i, :d] = torch.rand(d, device=device, generator=g)
    p_draft = probs[target_rows[:, :max_d], drafts]  # [R, D]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q_draft = draft_probs.float()[draft_idx, drafts]
    accepted = _leading_true(_accept(u, p_draft, q_draft) & valid)
    # One distribution per row at its first rejected position (residual) or its bonus position (p_d).
    at = target_rows.gather(1, accepted[:, None]).squeeze(1)
    p = probs[at]
    rejected = accepted < counts.to(device)
    if max_d:
        pos = accepted.clamp(max=max_d - 1)
        if draft_probs is None:
            q = torch.zeros_like(p)
            q.scatter_(1, drafts.gather(1, pos[:, None]), 1.0)
        else:
            q = draft_probs.float()[draft_idx.gather(1, pos[:, None]).squeeze(1)]
        dist = torch.where(rejected[:, None], _residual(p, q), p)
    else:
        dist = p
    # Exponential race with the row's own U[0, 1) vector (seeded rows: their generator).
    race = torch.rand(num, vocab, device=device, generator=default_generator)
    for i, g in generators.items():
        race[i] = torch.rand(vocab, device=device, generator=g)
    token = (dist / race.clamp_(min=1e-20).log_().neg_()).argmax(dim=-1)
    return accepted, token
