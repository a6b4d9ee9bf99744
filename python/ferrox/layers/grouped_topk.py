"""Grouped top-k routing (DeepSeek-V2/V3, GLM-4.5): experts come in groups, a token first picks its
best `topk_group` groups, then its top k experts inside them.

The steps, as DeepSeek-V3 and GLM-4.5 define them (transformers' DeepseekV3TopkRouter /
Glm4MoeTopkRouter, DeepSeek-V2's `group_limited_greedy`, vLLM's grouped_topk):

1. scores = softmax (DeepSeek-V2) or sigmoid (V3, GLM-4.5) of the router logits, in float32;
2. choice scores = scores + e_score_correction_bias (V3's "noaux_tc" load-balancing bias: it steers
   which experts are chosen, never how much they weigh);
3. each group is ranked by the sum of its two best choice scores when there is a bias (V3) or
   `group_top2` says so (Mistral 4's softmax router), else by its best score (V2); experts outside the
   best `topk_group` groups are masked out;
4. the top k choice scores name the experts;
5. their weights are the ORIGINAL scores (no bias), renormalised to sum to 1 if asked, then times
   `routed_scaling_factor`.

One group (num_expert_group 1) is plain top-k over the choice scores.
"""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, scoring_func: str, renormalize: bool,
                 num_expert_group: int = 1, topk_group: int = 1,
                 e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0,
                 group_top2: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int32) for router_logits [T, E]. group_top2: rank groups by their
    two best scores (None: when there is a correction bias)."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func {scoring_func!r}: expected one of {SCORING_FUNCS}")
    if num_expert_group < 1 or num_experts % num_expert_group:
        raise ValueError(f"{num_experts} experts do not split into {num_expert_group} groups")
    per_group = num_experts // num_expert_group
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group {topk_group} must be within 1..{num_expert_group} (the groups)")
    if not 1 <= top_k <= topk_group * per_group:
        raise ValueError(f"top_k {top_k} must be within 1..{topk_group * per_group} (the experts of the "
                         f"{topk_group} groups kept)")
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else torch.sigmoid(logits)
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group > 1 and topk_group < num_expert_group:
        grouped = choice.view(num_tokens, num_expert_group, per_group)
        if group_top2 or (group_top2 is None and e_score_correction_bias is not None):
            group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        best_groups = torch.topk(group_scores, topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        keep = keep.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        # The epsilon keeps a row of underflowed sigmoids finite (transformers' and vLLM's 1e-20).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids.to(torch.int32)
