"""gpt-oss's experts in the fused MoE kernels (kernels/fused_moe.py: biases on both products, the clamped
SwiGLU) against the torch loop (layers/fused_moe.experts_torch) and a float64 formula: the grouped path
and the small-batch path, top-k 4 and 2, an expert that gets no tokens. On CPU in the Triton interpreter
child (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.fused_moe import GemmConfig, GemvConfig, fused_moe
from ferrox.layers.fused_moe import SwigluOai, experts_torch

from tests.kernels.kernel_refs import relative_error

SMALL_GEMM = GemmConfig(16, 16, 16, 4, 1)
SMALL_GEMV = GemvConfig(gate_up_rows=32, gate_up_block_k=32, down_rows=64, down_block_k=16, num_warps=4)
ACT = SwigluOai(alpha=1.702, limit=1.0)


def _ref64(x, w13, w2, b13, b2, weights, ids, act: SwigluOai) -> torch.Tensor:
    """Expert by expert in float64, transformers' GptOssExperts formula over [gate | up] rows."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e].double() @ x[t].double() + b13[e].double()
            gate, up = gate_up[:inter].clamp(max=act.limit), gate_up[inter:].clamp(-act.limit, act.limit)
            h = (up + 1) * gate * torch.sigmoid(gate * act.alpha)
            out[t] += weights[t, j].double() * (w2[e].double() @ h + b2[e].double())
    return out


def _case(device, tokens: int, top_k: int, experts: int = 6, hidden: int = 40, inter: int = 24, empty: int = 3):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    b13 = torch.randn(experts, 2 * inter, generator=gen) * 0.5
    b2 = torch.randn(experts, hidden, generator=gen) * 0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, empty] = -1e9  # expert `empty` gets no token
    values, ids = torch.topk(logits, top_k, dim=-1)
    weights = torch.softmax(values, dim=-1)
    return [t.to(device) for t in (x, w13, w2, b13, b2, weights, ids)]


@pytest.mark.parametrize(("tokens", "top_k", "small_batch"), [(9, 4, False), (2, 4, True), (5, 2, False),
                                                              (1, 2, True)])
def test_biased_swiglu_oai_experts_match_the_torch_loop(kernel_device, tokens, top_k, small_batch):
    x, w13, w2, b13, b2, weights, ids = _case(kernel_device, tokens, top_k)
    assert not (ids == 3).any()
    got = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV,
                    w13_bias=b13, w2_bias=b2, swiglu_oai=(ACT.alpha, ACT.limit))
    loop = experts_torch(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, activation=ACT)
    want = _ref64(*(t.cpu() for t in (x, w13, w2, b13, b2, weights, ids)), ACT)
    assert relative_error(loop.cpu().double(), want) < 1e-5
    assert relative_error(got, loop) < 1e-5
    # The clamp and the biases are in play: SiLU-and-mul without biases differs.
    plain = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=SMALL_GEMM, gemv_config=SMALL_GEMV)
    assert (plain - got).abs().max() > 1e-2


def test_biases_need_matching_shapes(kernel_device):
    x, w13, w2, b13, b2, weights, ids = _case(kernel_device, 2, 2)
    with pytest.raises(ValueError, match="w2_bias"):
        fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2[:, :5])
