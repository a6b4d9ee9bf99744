"""Logits transformations, batched over rows, on the logits' device.

Each function takes float32 logits [B, V] (or a row subset) and returns them modified in place
where that is safe. Definitions follow vLLM / OpenAI:
- repetition penalty over prompt + output tokens (CTRL paper: divide positive logits, multiply
  negative ones), presence and frequency penalties over output tokens only;
- top-k keeps the k largest, top-p the smallest set whose probability reaches p (the top token
  always survives), min-p drops tokens whose probability is below min_p * max probability.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """rows: [R] row indices; prompt_mask [R, V] bool; output_counts [R, V] float32;
    repetition/frequency/presence: [R] float32."""
    sub = logits[rows]
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1)
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub -= frequency.unsqueeze(1) * output_counts
    sub -= presence.unsqueeze(1) * (output_counts > 0).to(sub.dtype)
    logits[rows] = sub


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor) -> None:
    """Flat (row, token, bias) triples; one index_put covers the whole batch."""
    logits.index_put_((rows, cols), values, accumulate=True)


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """allowed: [R, V] bool; tokens outside it get -inf (allowed_token_ids, structured outputs)."""
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)


def apply_banned_tokens(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
    """Set single (row, token) entries to -inf (min_tokens hides EOS and stop ids)."""
    logits[rows, cols] = _NEG_INF


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p: [B]; a 0 entry leaves its row unchanged."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


# Top-p first looks at this many most likely tokens; rows whose nucleus is larger fall back to a full
# sort. A full sort of a 49k vocabulary costs ~3 ms per row on CPU, a top-256 well under 0.2 ms.
_TOP_P_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """top_k: [B] int64 (vocab size = off); top_p: [B] float32 (1.0 = off)."""
    if top_k is not None:
        logits = _apply_top_k(logits, top_k)
    if top_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    k = min(_TOP_P_CANDIDATES, logits.shape[-1])
    top_probs = torch.topk(probs, k, dim=-1).values  # descending
    cum = torch.cumsum(top_probs, dim=-1)
    p = top_p.unsqueeze(1)
    # keep a token when the mass strictly before it (in descending order) is below p: the smallest
    # set reaching p; the most likely token always stays.
    num_keep = ((cum - top_probs) < p).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = top_probs.gather(1, num_keep - 1)
    result = logits.masked_fill(probs < threshold, _NEG_INF)
    off = top_p >= 1.0
    if bool(off.any()):
        result = torch.where(off.unsqueeze(1), logits, result)
    # Rows whose nucleus is not inside the candidates (flat distributions) need the exact full sort.
    wide = (~off) & (cum[:, -1] < top_p)
    if bool(wide.any()):
        rows = torch.nonzero(wide).flatten()
        result[rows] = _top_p_by_sort(logits[rows], top_p[rows])
    return result


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # a partial top-k is much cheaper than a full sort of the vocabulary
    k_max = int(top_k.max())
    values = torch.topk(logits, k_max, dim=-1).values
    kth = values.gather(1, (top_k - 1).clamp(max=k_max - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth, _NEG_INF)


def _top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    # drop the low tail whose total mass stays within 1 - p; the last (largest) column is never
    # dropped, so at least one token survives.
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
