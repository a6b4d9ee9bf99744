"""FP8 non-gated ReLU^2 experts (Nemotron 3's, as NVIDIA's FP8 release stores them: layers/quant/fp8_moe.py) in the
fused MoE kernels (kernels/fused_moe.py: activation RELU2, GATED off, w13_scale over the up rows alone) against the
torch reference `experts_fp8_torch` with relu(up)^2 (layers/quant/fp8_moe_ref.py): per-row and block scales, the
grouped and the small-batch path, uneven loads with an expert left empty, the one-token step with a residual, and
the argument checks. On CPU in the Triton interpreter child (conftest.py), at tiny shapes; at Nemotron 3 Nano's
shapes on the GPU (`gpu`).

The experts are tests/kernels/test_fused_moe_fp8.py's (rows, columns and experts of different magnitudes, so a
misplaced scale shows), their w13 cut to its first I rows (and scale rows)."""

from __future__ import annotations

import functools

import pytest
import torch
from ferrox.kernels.fused_moe import Activation, fused_moe
from ferrox.layers.fused_moe import Relu2, gated_activation_torch
from ferrox.layers.quant.fp8_moe_ref import experts_fp8_torch

from tests.kernels.test_fused_moe_fp8 import (
    SMALL_GEMM,
    SMALL_GEMV,
    assert_close,
    fp8_experts,
    routing,
    token_errors,
)

RELU2 = functools.partial(gated_activation_torch, activation=Relu2())
LAYOUTS = {"per-row": None, "block-32x32": (32, 32)}


def relu2_fp8_experts(experts: int, hidden: int, inter: int, block: tuple[int, int] | None, device):
    """(w13 [E, I, H], w13_scale, w2 [E, H, I], w2_scale): the up rows alone and their scales."""
    w13, w13_scale, w2, w2_scale = fp8_experts(experts, hidden, inter, block, device)
    scale_rows = inter if block is None else inter // block[0]
    return w13[:, :inter].contiguous(), w13_scale[:, :scale_rows].contiguous(), w2, w2_scale


def run_case(device, dtype, block, *, small_batch, tokens, experts, top_k, hidden=64, inter=64, config=SMALL_GEMM,
             gemv_config=SMALL_GEMV, residual=False) -> None:
    w13, w13_scale, w2, w2_scale = relu2_fp8_experts(experts, hidden, inter, block, device)
    x = torch.randn(tokens, hidden, device=device).to(dtype)
    empty = experts - 2 if top_k < experts - 1 else None
    weights, ids = routing(tokens, experts, top_k, device, empty=empty)
    if empty is not None:
        assert not (ids == empty).any()  # an expert with no tokens
    res = torch.randn(tokens, hidden, device=device).to(dtype) if residual else None
    out = fused_moe(x, w13, w2, weights, ids, small_batch=small_batch, config=config, gemv_config=gemv_config,
                    residual=res, w13_scale=w13_scale, w2_scale=w2_scale, block=block, activation=Activation.RELU2)
    ref = experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, block, activation=RELU2)
    assert out.shape == (tokens, hidden) and out.dtype == dtype and not out.isnan().any()
    extra = res if res is not None else 0
    assert_close(out, ref + extra, device)
    # The check can fail: each expert's up scales given to the next expert, or SiLU's shape (relu alone) in place
    # of the square, are far off.
    wrong = experts_fp8_torch(x, w13, w13_scale.roll(1, 0), w2, w2_scale, weights, ids, block, activation=RELU2)
    assert float(token_errors(out, wrong + extra).max()) > 0.2
    unsquared = experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, block, activation=torch.relu)
    assert float(token_errors(out, unsquared + extra).max()) > 0.2


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_relu2_experts_match_the_reference(kernel_device, seed, layout, small_batch):
    run_case(kernel_device, torch.float32, LAYOUTS[layout], small_batch=small_batch, tokens=13, experts=6, top_k=2)


@pytest.mark.parametrize("small_batch", [False, True], ids=["grouped", "small-batch"])
def test_fp8_relu2_experts_bf16(kernel_device, seed, small_batch):
    run_case(kernel_device, torch.bfloat16, None, small_batch=small_batch, tokens=9, experts=6, top_k=3)


def test_fp8_relu2_one_token_step(kernel_device, seed):
    """A decode step's experts (the path chosen by default: matrix-vector products per pair), top 6 as Nemotron 3
    Nano routes, with the decoder's residual."""
    run_case(kernel_device, torch.float32, None, small_batch=None, tokens=1, experts=10, top_k=6, residual=True)


def test_fp8_relu2_refusals(kernel_device):
    w13, w13_scale, w2, w2_scale = relu2_fp8_experts(4, 64, 64, None, kernel_device)
    x = torch.randn(2, 64, device=kernel_device)
    weights, ids = routing(2, 4, 2, kernel_device)
    with pytest.raises(ValueError, match="w13_scale must be float32 \\[4, 64\\]"):  # gated [E, 2I] scales
        fused_moe(x, w13, w2, weights, ids, w13_scale=torch.cat([w13_scale, w13_scale], 1), w2_scale=w2_scale,
                  activation=Activation.RELU2)
    with pytest.raises(ValueError, match="without biases"):
        fused_moe(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, activation=Activation.RELU2,
                  w13_bias=torch.zeros(4, 64, device=kernel_device))


NANO = dict(experts=128, hidden=2688, inter=1856, top_k=6)  # NVIDIA-Nemotron-3-Nano-30B-A3B's E layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 4, 64, 300])
def test_fp8_relu2_experts_at_nemotron_3_nano_shapes_on_the_gpu(seed, tokens):
    """Nemotron 3 Nano's experts in bf16, per-row scales (its per-tensor ones written into rows), with the configs
    the engine chooses (matrix-vector for a few tokens, grouped above), against the reference."""
    device = torch.device("cuda")
    w13, w13_scale, w2, w2_scale = relu2_fp8_experts(NANO["experts"], NANO["hidden"], NANO["inter"], None, device)
    x = torch.randn(tokens, NANO["hidden"], device=device).to(torch.bfloat16)
    weights, ids = routing(tokens, NANO["experts"], NANO["top_k"], device)
    out = fused_moe(x, w13, w2, weights, ids, w13_scale=w13_scale, w2_scale=w2_scale, activation=Activation.RELU2)
    ref = experts_fp8_torch(x, w13, w13_scale, w2, w2_scale, weights, ids, None, activation=RELU2)
    assert_close(out, ref, device)
