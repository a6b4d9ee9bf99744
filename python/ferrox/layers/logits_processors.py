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
    """Set single (row, token) entries to -inf (min_tokens hides EOS and stop ids). The values are
    made on the logits' device: `logits[rows, cols] = float` copies a host scalar and, on CUDA,
    waits for the stream (the step in flight, under async scheduling)."""
    logits.index_put_((rows, cols), torch.full(rows.shape, _NEG_INF, dtype=logits.dtype, device=logits.device))


def apply_banned_tokens_if(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, cond: torch.Tensor) -> None:
    """Set (row, token) entries to -inf where `cond` holds, without reading it on the host (a bad word's
    ban that hangs on a token still on the device). Adding -inf or 0 accumulates: a pair listed twice
    with different conditions is banned if either holds."""
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    logits.index_put_((rows, cols), torch.where(cond, _NEG_INF, zero), accumulate=True)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p: [B]; a 0 entry leaves its row unchanged."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


# On CPU, top-p first looks at this many most likely tokens; rows whose nucleus is larger fall back to
# a full sort. A full sort of a 49k vocabulary costs ~3 ms per row on CPU, a top-256 well under 0.2 ms.
# On CUDA the sort is cheap and deciding which rows need it would wait for the device (a host sync that
# would stall async scheduling), so every top-p row is sorted there.
_TOP_P_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      top_k_max: int | None = None) -> torch.Tensor:
    """top_k: [B] int64 (vocab size = off); top_p: [B] float32 (1.0 = off). top_k_max: the largest
    top_k below the vocabulary size (SamplingMetadata.top_k_max); given, nothing here waits for the
    device on CUDA."""
    if top_k is not None:
        logits = _apply_top_k(logits, top_k, top_k_max)
    if top_p is None:
        return logits
    if logits.is_cuda:
        return torch.where((top_p >= 1.0).unsqueeze(1), logits, _top_p_by_sort(logits, top_p))
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


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int | None = None) -> torch.Tensor:
    # a partial top-k (up to the largest k in use) is much cheaper than a full sort of the vocabulary
    vocab = logits.shape[-1]
    if k_max is None:
        k_max = int(top_k.max())  # (waits for the device on CUDA: callers there pass the host's bound)
    k_max = max(1, min(k_max, vocab))
    values = torch.topk(logits, k_max, dim=-1).values
    kth = values.gather(1, (top_k - 1).clamp(min=0, max=k_max - 1).unsqueeze(1))
    # Rows without a top-k (top_k = vocab) may sit above k_max: they keep every token.
    return torch.where((top_k >= vocab).unsqueeze(1), logits, logits.masked_fill(logits < kth, _NEG_INF))


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
