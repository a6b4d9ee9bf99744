"""The per-expert loop of the torch MoE paths (CPU, and the fused kernels' references): each expert
runs once on the rows of the tokens routed to it, and its outputs are added into their tokens'
rows weighted by the routing weights, in float32."""

from __future__ import annotations

from collections.abc import Callable

import torch


def per_expert(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               expert_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_fn(topk_ids[t, j], rows)[t] for every token t, [T, H] in x's
    dtype; expert_fn(e, tokens) gets the indices of the tokens routed to expert e and returns their
    outputs [len(tokens), H]. One host sync for the per-expert counts; experts with no tokens are
    skipped, and so are ids from num_experts on (pairs routed to another rank: expert parallelism)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        pairs = order[start:start + count]
        start += count
        if count == 0 or expert >= num_experts:
            continue
        tokens = pairs // top_k
        y = expert_fn(expert, tokens)
        out.index_add_(0, tokens, y.float() * topk_weights.reshape(-1)[pairs, None].float())
    return out.to(x.dtype)
