"""FP8 experts in torch ops: the CPU path of an FP8 mixture-of-experts layer and the fused Triton
kernels' reference (kernels/fused_moe.py).

The experts hold float8 E4M3 weights w13 [E, 2I, H] (non-gated experts, Nemotron-H's: [E, I, H], the up rows
alone) and w2 [E, H, I] with float32 scales in one of
two layouts (layers/quant/fp8_moe.py loads both):

- per row (`block=None`): w13_scale [E, 2I], w2_scale [E, H], one scale per output row of each
  expert; activations quantized per token (the expert input) and per (token, slot) pair (the
  down projection's input), each row's absmax mapped to 448. vLLM's meaning of `--quantization
  fp8` and of per-channel FP8 checkpoints with dynamic activations.
- per block (`block=(BN, BK)`): w13_scale [E, ceil(2I / BN), ceil(H / BK)], w2_scale [E, ceil(H /
  BN), ceil(I / BK)], a scale per BN x BK block of each expert's matrix; activations quantized per
  row and group of BK inputs. Block-wise FP8 checkpoints (Qwen3-30B-A3B-FP8, DeepSeek's layout).

Arithmetic, which the kernels follow: each product is the fake-quantized activations (codes x
scales, float32) times the dequantized weight (codes x scales, float32), summed in float32 (the
same value as the FP8 MMA's code products scaled per group, up to float32 rounding); gate and
up are rounded to the activation dtype before the activation (SiLU-and-mul, or the layer's: relu(up)^2 for
non-gated experts), its result rounded again and quantized for
the down projection, whose output is rounded to the activation dtype and then weighted by the
routing weight and summed over a token's k slots in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ferrox.kernels.fp8_block_gemm import dequantize_fp8_blocks, quantize_fp8_groups_torch
from ferrox.layers.expert_loop import per_expert
from ferrox.layers.ops import silu_and_mul_torch
from ferrox.layers.quant.fp8_linear import quantize_activations_torch


def fake_quantize(x: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """x [M, K] through FP8 and back, float32: per row (block None) or per row and group of BK."""
    if block is None:
        q, scale = quantize_activations_torch(x)
        return q.float() * scale
    group = block[1]
    q, scale = quantize_fp8_groups_torch(x, group)
    return q.float() * scale.repeat_interleave(group, dim=1)[:, :x.shape[1]]


def dequantize_expert(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """One expert's matrix [N, K] in float32: codes x the row's (or the block's) scale."""
    if block is None:
        return weight.float() * scale.float()[:, None]
    return dequantize_fp8_blocks(weight, scale, block, torch.float32)


def experts_fp8_torch(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      block: tuple[int, int] | None,
                      activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul_torch) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token, [T, H] in x's
    dtype (module docstring). An expert id past the last local expert is a pair routed to another
    rank (expert parallelism) and adds nothing (layers/expert_loop.py). activation: over w13's float32
    outputs (layers/fused_moe.py gated_activation_torch), SiLU-and-mul by default."""
    if topk_ids.shape[0] == 0:
        return torch.zeros_like(x)
    xd = fake_quantize(x, block)

    def expert_fn(expert: int, tokens: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(xd[tokens], dequantize_expert(w13[expert], w13_scale[expert], block)).to(x.dtype)
        act = activation(gate_up.float()).to(x.dtype)
        return F.linear(fake_quantize(act, block), dequantize_expert(w2[expert], w2_scale[expert], block)).to(x.dtype)

    return per_expert(x, topk_weights, topk_ids, w13.shape[0], expert_fn)
