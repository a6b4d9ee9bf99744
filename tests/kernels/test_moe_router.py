"""The one-launch MoE router (kernels/moe_router.py) against the two launches it replaces: the
router GEMV (kernels/gemv.py, fp32 logits) then route_top_k, and against a float64 reference of
the norm and the product; under the interpreter on CPU and at real shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fused_moe import route_top_k
from ferrox.kernels.gemv import gemv
from ferrox.kernels.moe_router import MAX_EXPERTS, fused_router_supported, router_top_k

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_fused_moe import rms_norm_ref


def _case(device, dtype, experts, hidden, top_k, renormalize, norm):
    h = torch.randn(1, hidden, device=device).to(dtype)
    weight = (torch.randn(experts, hidden, device=device) / hidden ** 0.5).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(hidden, device=device)).to(dtype) if norm else None
    return h, weight, norm_weight


# E 8 (Mixtral) / 60 (Qwen2-MoE, not a power of two) / 128 (Qwen3-MoE); k 1, 2, 4, 8; one K tile and
# several (hidden 3000 > 2048, masked tail).
@pytest.mark.parametrize(("experts", "hidden", "top_k", "renormalize"),
                         [(8, 96, 2, True), (60, 3000, 4, False), (128, 64, 8, True), (5, 40, 1, False)])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "plain"])
def test_router_top_k_matches_the_gemv_then_route_top_k(kernel_device, seed, experts, hidden, top_k, renormalize,
                                                         norm):
    h, weight, norm_weight = _case(kernel_device, torch.float32, experts, hidden, top_k, renormalize, norm)
    weights, ids, logits = router_top_k(h, weight, top_k, renormalize, norm_weight=norm_weight, eps=1e-5)
    ref_logits = gemv(h, weight, norm_weight=norm_weight, eps=1e-5, out_dtype=torch.float32)
    x = rms_norm_ref(h, norm_weight, 1e-5) if norm else h.double()
    assert relative_error(logits, x @ weight.double().T) < 1e-5
    assert relative_error(logits, ref_logits) < 1e-5
    ref_weights, ref_ids = route_top_k(logits, top_k, renormalize)  # the same logits: the same picks
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == (1, top_k)
    assert torch.equal(ids, ref_ids)
    assert relative_error(weights, ref_weights) < 1e-6
    # The arrival counter is left at zero: a second launch (a CUDA-graph replay) routes again.
    h2 = torch.randn_like(h)
    again, again_ids, again_logits = router_top_k(h2, weight, top_k, renormalize, norm_weight=norm_weight, eps=1e-5)
    assert torch.equal(again_ids, route_top_k(again_logits, top_k, renormalize)[1])


def test_ties_go_to_the_lower_expert_and_nan_logits_never_pick_a_bad_id(kernel_device):
    hidden, experts = 32, 16
    h = torch.ones(1, hidden, device=kernel_device)
    weight = torch.zeros(experts, hidden, device=kernel_device)
    weight[[3, 9, 12]] = 0.1  # three equal top logits, the rest equal too
    weights, ids, _ = router_top_k(h, weight, 4, True)
    assert ids.tolist() == [[3, 9, 12, 0]]
    assert torch.allclose(weights.sum(), torch.tensor(1.0, device=kernel_device))
    weight[5] = float("nan")  # a NaN row: a NaN logit, ranked as -inf
    weights, ids, _ = router_top_k(h, weight, 4, False)
    assert ids.tolist() == [[3, 9, 12, 0]]


def test_router_top_k_names_what_it_cannot_take(kernel_device):
    h = torch.randn(1, 32, device=kernel_device)
    with pytest.raises(ValueError, match="top_k"):
        router_top_k(h, torch.randn(8, 32, device=kernel_device), 9, True)
    with pytest.raises(ValueError, match="experts"):
        router_top_k(h, torch.randn(MAX_EXPERTS + 1, 32, device=kernel_device), 2, True)
    with pytest.raises(ValueError, match=r"\[1, 32\]"):
        router_top_k(torch.randn(2, 32, device=kernel_device), torch.randn(8, 32, device=kernel_device), 2, True)
    assert not fused_router_supported(8, torch.zeros(8, 32, dtype=torch.float8_e4m3fn))


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "hidden", "top_k"), [(128, 2048, 8), (8, 4096, 2), (60, 2048, 4)],
                         ids=["qwen3-30b-a3b", "mixtral", "qwen2-moe"])
def test_router_top_k_at_real_shapes(cuda_device, seed, experts, hidden, top_k):
    h, weight, norm_weight = _case(cuda_device, torch.bfloat16, experts, hidden, top_k, True, True)
    for _ in range(3):
        weights, ids, logits = router_top_k(h, weight, top_k, True, norm_weight=norm_weight, eps=1e-6)
        ref_logits = gemv(h, weight, norm_weight=norm_weight, eps=1e-6, out_dtype=torch.float32)
        assert relative_error(logits, ref_logits) < 1e-5
        ref_weights, ref_ids = route_top_k(logits, top_k, True)
        assert torch.equal(ids, ref_ids) and relative_error(weights, ref_weights) < 1e-6
        h = torch.randn_like(h)
