"""layers/grouped_topk.py against a per-token reference written here and against transformers' own
routers (GLM-4.5, DeepSeek-V3 with its correction bias, DeepSeek-V2's group_limited_greedy)."""

from __future__ import annotations

import pytest
import torch
from ferrox.layers.grouped_topk import grouped_topk


def reference(logits: torch.Tensor, top_k: int, scoring_func: str, renormalize: bool, groups: int, topk_group: int,
              bias: torch.Tensor | None, scale: float) -> list[dict[int, float]]:
    """One token at a time, in plain Python over the float32 scores: {expert id: weight} per token."""
    out = []
    experts = logits.shape[1]
    per_group = experts // groups
    for row in logits.float():
        scores = torch.softmax(row, -1) if scoring_func == "softmax" else torch.sigmoid(row)
        choice = (scores + bias if bias is not None else scores).tolist()
        group_scores = []
        for g in range(groups):
            members = sorted(choice[g * per_group:(g + 1) * per_group], reverse=True)
            group_scores.append(sum(members[:2]) if bias is not None else members[0])
        kept = sorted(range(groups), key=lambda g: group_scores[g], reverse=True)[:topk_group]
        candidates = [e for e in range(experts) if e // per_group in kept]
        chosen = sorted(candidates, key=lambda e: choice[e], reverse=True)[:top_k]
        weights = {e: float(scores[e]) for e in chosen}
        if renormalize:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        out.append({e: w * scale for e, w in weights.items()})
    return out


def as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i.tolist(), w.tolist(), strict=True)) for w, i in zip(weights, ids, strict=True)]


def assert_same_routing(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert set(g) == set(w), f"token {t}: experts {sorted(g)} vs {sorted(w)}"
        for e in g:
            assert g[e] == pytest.approx(w[e], rel=1e-5, abs=1e-7), f"token {t} expert {e}"


CASES = [  # top_k, scoring, renormalize, experts, groups, topk_group, bias, scale
    (2, "softmax", False, 8, 1, 1, False, 1.0),
    (2, "softmax", True, 8, 1, 1, False, 1.0),
    (3, "softmax", False, 16, 4, 2, False, 16.0),     # DeepSeek-V2 group_limited_greedy
    (4, "sigmoid", True, 16, 4, 2, True, 2.5),        # DeepSeek-V3 / GLM-4.5
    (4, "sigmoid", True, 16, 1, 1, True, 1.0),        # GLM-4.5 (n_group 1)
    (3, "sigmoid", False, 12, 3, 1, True, 1.0),
    (2, "sigmoid", True, 12, 6, 3, False, 1.0),
]


@pytest.mark.parametrize(("top_k", "scoring", "renorm", "experts", "groups", "topk_group", "with_bias", "scale"),
                         CASES)
def test_matches_reference(top_k: int, scoring: str, renorm: bool, experts: int, groups: int, topk_group: int,
                           with_bias: bool, scale: float) -> None:
    gen = torch.Generator().manual_seed(experts * 31 + top_k)
    logits = torch.randn(40, experts, generator=gen) * 2
    bias = torch.randn(experts, generator=gen) * 0.5 if with_bias else None
    weights, ids = grouped_topk(logits, top_k, scoring_func=scoring, renormalize=renorm, num_expert_group=groups,
                                topk_group=topk_group, e_score_correction_bias=bias, routed_scaling_factor=scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (40, top_k)
    assert_same_routing(as_dicts(weights, ids), reference(logits, top_k, scoring, renorm, groups, topk_group, bias,
                                                          scale))


def test_bias_steers_choice_not_weight() -> None:
    """A large bias on expert 0 picks it, but its weight is its own sigmoid score."""
    logits = torch.full((1, 4), 0.0)
    logits[0, 1] = 3.0
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    weights, ids = grouped_topk(logits, 1, scoring_func="sigmoid", renormalize=False, e_score_correction_bias=bias)
    assert ids.tolist() == [[0]]
    assert weights.item() == pytest.approx(0.5)


def test_rejects_bad_shapes() -> None:
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="groups"):
        grouped_topk(logits, 2, scoring_func="sigmoid", renormalize=True, num_expert_group=3)
    with pytest.raises(ValueError, match="top_k"):
        grouped_topk(logits, 5, scoring_func="sigmoid", renormalize=True, num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="scoring_func"):
        grouped_topk(logits, 2, scoring_func="tanh", renormalize=True)


def _router_on_logits(router: torch.nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a transformers router whose weight is the identity, so its logits are ours."""
    with torch.no_grad():
        router.weight.copy_(torch.eye(logits.shape[1]))
        _, weights, ids = router(logits)
    return weights, ids


@pytest.mark.parametrize(("groups", "topk_group", "renorm"), [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_matches_transformers_glm4_moe_router(groups: int, topk_group: int, renorm: bool) -> None:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    experts = 16
    config = Glm4MoeConfig(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=4, n_group=groups,
                           topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=2.5)
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(groups * 7 + topk_group)
    logits = torch.randn(50, experts, generator=gen) * 2
    router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.3)
    hf_weights, hf_ids = _router_on_logits(router, logits)
    weights, ids = grouped_topk(logits, 4, scoring_func="sigmoid", renormalize=renorm, num_expert_group=groups,
                                topk_group=topk_group, e_score_correction_bias=router.e_score_correction_bias,
                                routed_scaling_factor=2.5)
    assert_same_routing(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids))


def test_matches_transformers_deepseek_v3_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    experts = 32
    config = DeepseekV3Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=6, n_group=8,
                              topk_group=3, norm_topk_prob=True, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, experts, generator=gen) * 2
    router.e_score_correction_bias.copy_(torch.randn(experts, generator=gen) * 0.3)
    hf_weights, hf_ids = _router_on_logits(router, logits)
    weights, ids = grouped_topk(logits, 6, scoring_func="sigmoid", renormalize=True, num_expert_group=8, topk_group=3,
                                e_score_correction_bias=router.e_score_correction_bias, routed_scaling_factor=2.5)
    assert_same_routing(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids))


def test_matches_transformers_deepseek_v2_group_limited_greedy() -> None:
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    experts = 16
    config = DeepseekV2Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=3, n_group=4,
                              topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0,
                              num_attention_heads=4, num_key_value_heads=4)
    router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, experts, generator=gen) * 2
    hf_weights, hf_ids = _router_on_logits(router, logits)
    weights, ids = grouped_topk(logits, 3, scoring_func="softmax", renormalize=False, num_expert_group=4,
                                topk_group=2, routed_scaling_factor=16.0)
    assert_same_routing(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids))


@pytest.mark.parametrize(("groups", "topk_group", "renorm"), [(1, 1, True), (4, 2, True), (4, 1, False)])
def test_matches_transformers_mistral4_router(groups: int, topk_group: int, renorm: bool) -> None:
    """Mistral 4's (models/mistral4.py): softmax scores, groups ranked by their two best without a bias
    (group_top2), weights renormalised then scaled."""
    from transformers import Mistral4Config
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    experts = 16
    config = Mistral4Config(hidden_size=experts, n_routed_experts=experts, num_experts_per_tok=4, n_group=groups,
                            topk_group=topk_group, norm_topk_prob=renorm, routed_scaling_factor=1.5)
    router = Mistral4TopkRouter(config)
    logits = torch.randn(50, experts, generator=torch.Generator().manual_seed(groups * 5 + topk_group)) * 2
    hf_weights, hf_ids = _router_on_logits(router, logits)
    weights, ids = grouped_topk(logits, 4, scoring_func="softmax", renormalize=renorm, num_expert_group=groups,
                                topk_group=topk_group, routed_scaling_factor=1.5, group_top2=True)
    assert_same_routing(as_dicts(weights, ids), as_dicts(hf_weights, hf_ids))
    if topk_group < groups:  # (ranked by their best score instead, some tokens route elsewhere)
        _, best_ids = grouped_topk(logits, 4, scoring_func="softmax", renormalize=renorm, num_expert_group=groups,
                                   topk_group=topk_group, routed_scaling_factor=1.5)
        assert (best_ids.sort(-1).values != ids.sort(-1).values).any()
