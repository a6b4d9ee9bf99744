"""Fused mixture-of-experts FFN: every token's top-k experts in two grouped launches.

An MoE layer sends each token to k of E experts (SwiGLU MLPs). Run expert by expert, a batch costs
E small matmuls, a host sync to learn which experts have tokens, and a scatter-add. Here:

Grouped path (any batch). The T*k (token, slot) pairs are sorted by expert on the device
(`align_by_expert`); each expert's run of pairs is padded to a multiple of BLOCK_M, so every
BLOCK_M-row block of the sorted list belongs to exactly one expert. One launch then computes
silu(x W_gate^T) * (x W_up^T) for every block (its program reads the block's expert's w13
slice and gathers its tokens' rows of x), and a second multiplies by w2 and by the pair's routing
weight. The k outputs of a token are then summed (in fp32, one reduction). Pad rows point at the
sentinel pair id T*k and are masked. The grid is the upper bound on blocks (known from shapes),
and programs past the padded total return at once: nothing is read back on the host, so a step
can be captured in a CUDA graph.

Small-batch path (a few decode tokens). Sorting costs more launches than the work, so each
(token, slot) pair runs matrix-vector products straight on its selected expert's rows: only the
k selected experts' weights are read (a batch-1 step of Qwen3-30B-A3B reads 8 of 128 experts).
The down kernel streams all of the token's k slots in one tile and sums them in registers, so it
writes the final [T, H] rows itself (plus the residual, for the one-token decode path).

Routing. `route_top_k` is softmax, top-k and renormalisation in one launch (torch's is ~6). In the
one-token decode path (attention/fused_decode.py, `fused_moe_from_logits`) the layer's RMSNorm runs
in the gate/up kernel's prologue, as in kernels/gemv.py (the sum of squares accumulated beside the
products, rstd applied to the row sums; the normed vector is not rounded to the activation dtype
before the products, unlike the unfused rms_norm: a difference well inside bf16 noise), so a
sparse MLP is router GEMV (norm prologue), top-k, gate/up (norm prologue), down (+ residual): four
launches, not five. Routing inside the gate/up prologue as well (every program picking its
token's k experts from the logits, one writing them for the down kernel) was measured and
dropped: the top-k then delays every program's first weight load, and the Qwen3-30B-A3B step went
from 2.88 to 3.17 ms on an H200.

Layout: w13 [E, 2*I, H] (rows [0, I) gate, [I, 2I) up), w2 [E, H, I], both row-major per expert.
Gate and up are rounded to x's dtype before the gated activation, as the unfused torch path stores them.

FP8 experts (W8A8; layers/quant/fp8_moe.py holds them, layers/quant/fp8_moe_ref.py is the
reference whose arithmetic these follow): E4M3 codes with float32 scales per row of each expert
matrix, or per (BN, BK) block. The input of each product is quantized in one launch before it
(x per token, or per token and BK group; the gated intermediate per (token, slot) pair likewise),
so both paths stay two launches plus two quantizations. The grouped path multiplies codes on the
FP8 tensor cores: per-row scales multiply the accumulator after the K loop (the products summed
in the MMA's own accumulator over all of K, as torch._scaled_mm's fast accumulation), block
scales each BK-wide K step's partial sum (the K tile is BK, as in fp8_block_gemm.py). The small-batch path
streams one byte per weight and multiplies in fp32 as the float path does: codes times codes with
the row scales applied to the sums, or, with blocks, dequantized weight times fake-quantized
input, the scales loaded per row and group (a gate/up K tile is whole groups, a down tile lies in
one). The routed norm prologue stays float-only: with FP8 experts the caller norms x.

The gated activation over [gate | up] is the launches' ACTIVATION constexpr (`Activation`), one epilogue
(`_gated_activation`) for both paths and every weight format: SiLU-and-mul (0, the default: those launches
take no activation argument and compile as they always have), gpt-oss's clamped SwiGLU (1) and Gemma 4's
GELU-tanh-and-mul (2; as transformers' gelu_pytorch_tanh, written x * sigmoid(2 z) for 0.5 x (1 + tanh z),
which needs no tanh and saturates cleanly at either end). FP8 experts take GELU-tanh too (the epilogue reads
the scaled sums); MXFP4 ones take SiLU or gpt-oss's activation.

Non-gated experts (Nemotron-H's, Nemotron 3 Nano / Super: down(relu(up x)^2), no gate projection) are
ACTIVATION 3 (RELU2) with the gate/up launches' GATED constexpr off: w13 holds the up rows only ([E, I, H]),
the K loops read one weight tile a step instead of two, and the epilogue squares the rounded, rectified sums
(`_relu2`). Float or FP8 experts (ModelOpt's FP8 Nemotron 3 releases: w13_scale [E, I], per row or per block row
of the up rows alone); the up sums take their scales as the gated launches' gate sums do, and relu^2 follows. The
gated families' launches keep GATED on and compile as before.

gpt-oss's experts (layers/fused_moe.py SwigluOai; float or MXFP4): a bias per output row of each expert
matrix is added to the fp32 sums before the rounding that the activation reads (gate/up) or before the
routing weight (down), and ACTIVATION 1 replaces SiLU-and-mul by the clamped SwiGLU, in both paths.
Without them the launches take no extra arguments and compile as before.

MXFP4 experts (gpt-oss's checkpoints; layers/quant/mxfp4_moe.py holds them, layers/quant/mxfp4.py
describes the format): weight-only, w13 [E, 2I, H / 2] and w2 [E, H, I / 2] uint8, two E2M1 codes a
byte (the even column in the low nibble), with a uint8 E8M0 scale per 32 columns of each row
(w13_scale [E, 2I, H / 32], w2_scale [E, H, I / 32]). The activations stay in their dtype; the weights
are dequantized in the K loops:

- small-batch path: each K tile is read as int32 words of 8 codes; `_e2m1_word_pair` moves two codes'
  sign, exponent and mantissa bits into the two fp16 halves of a word at once, which makes each code's
  value times 2**-14 exactly (the subnormal 0.5 included); the token's columns times those values are
  summed per 32-column group in fp32 and each group's sum is multiplied once by 2**(scale - 113), built
  from the bits of an fp32 exponent (`_e8m0_factor`);
- grouped path: bf16 activations through tl.dot_scaled (Triton upcasts the e2m1 tile to bf16 for the
  MMA: exact, a 2-bit mantissa times a power of two); fp32 and fp16 activations against the tile
  dequantized by hand (`_load_mxfp4`), the even and odd columns as two half-K dots.

Biases and the clamped SwiGLU apply as with float experts. The reference is the dequantized weights in
the torch loop.

LoRA on the experts (lora/moe.py) needs each pair's gate and up rows before the activation, to add the adapter's
delta there: `expert_gate_up_rows` runs the grouped gate/up kernel over all 2I rows of w13 with GATED off (the raw
rows, rounded as the gated launch rounds them), and `expert_down_rows` the grouped down kernel without the final
sum. Both are separate entry points over the same kernels: `fused_moe`'s launches are unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ferrox.kernels.fp8_block_gemm import FP8_DTYPE, quantize_fp8_groups_triton
from ferrox.kernels.gemv import _input_tile, _paired_row_sums
from ferrox.kernels.moe_align import align_pairs
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.row_quant import quantize_activations_triton


class Activation(enum.IntEnum):
    """The experts' activation: the kernels' ACTIVATION constexpr. Gated over [gate | up] rows, except RELU2."""

    SILU = 0  # silu(gate) * up: the SwiGLU families
    SWIGLU_OAI = 1  # gpt-oss's clamped SwiGLU (its alpha and limit: fused_moe's swiglu_oai)
    GELU_TANH = 2  # gelu_tanh(gate) * up: Gemma 4 (transformers' gelu_pytorch_tanh)
    RELU2 = 3  # relu(up)^2, non-gated (w13 holds the up rows only): Nemotron-H's experts

    @property
    def gated(self) -> bool:
        """w13 holds [gate | up] rows (2I), else the up rows alone (I)."""
        return self != Activation.RELU2


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """(token, slot) pairs grouped by expert, each expert's run padded to block_m rows."""

    pair_ids: torch.Tensor  # [max_rows] int32: pair (token * k + slot) of each sorted row; pads hold num_pairs
    block_expert: torch.Tensor  # [max_rows // block_m] int32: the expert of each block, -1 past the end
    num_rows: torch.Tensor  # [1] int64: rows in use (a multiple of block_m)
    block_m: int


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """Sort the pairs of topk_ids [T, k] by expert on the device, no host sync: three launches
    (moe_align.py). A pair's row = its expert's padded start + its rank among that expert's pairs
    (token order kept inside an expert)."""
    pair_ids, block_expert, num_rows = align_pairs(topk_ids, num_experts, block_m)
    return ExpertBlocks(pair_ids, block_expert, num_rows, block_m)


# num_pairs (tokens x k) changes every step: specialising it on "== 1" / "% 16 == 0" would compile a
# new variant for the first step of each class (worker/warmup.py); it only bounds a mask.
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    out_ptr,
    a_ptr,
    w_ptr,
    pair_ids_ptr,
    block_expert_ptr,
    num_rows_ptr,
    route_w_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    A_ROW_DIV: tl.constexpr,  # pair -> row of a: the token (k) for gate/up, the pair itself (1) for down
    GATED: tl.constexpr,  # w rows [0, N) gate, [N, 2N) up: out = act(gate) * up (ACTIVATION); off: RELU2 or none
    ROUTED: tl.constexpr,  # out *= the pair's routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    # FP8 (module docstring): a and w hold E4M3 codes. a_scale: float32 per row of a, or with
    # BLOCK_SCALES per row and BK group; w_scale: per row of each expert's w, or per BN x BK
    # block. The groups of both are unit-stride.
    a_scale_ptr=None,
    w_scale_ptr=None,
    stride_as=0,
    stride_wse=0,
    stride_wsn=0,
    FP8: tl.constexpr = False,
    BLOCK_SCALES: tl.constexpr = False,  # BLOCK_K divides BK: a K tile lies in one group
    BN: tl.constexpr = 1,  # the weight block's rows
    BK: tl.constexpr = 1,  # the weight block's columns, the activations' group
    # gpt-oss (module docstring): a bias per output row of each expert ([E, 2N] with GATED, else
    # [E, N]). ACTIVATION: an `Activation` (SWIGLU_OAI with ALPHA and LIMIT).
    bias_ptr=None,
    stride_be=0,
    HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = 0,
    ALPHA: tl.constexpr = 0.0,
    LIMIT: tl.constexpr = 0.0,
    # MXFP4 (module docstring): w packed bytes [E, N, K / 2] (strides in bytes), w_scale uint8 [E, N,
    # K / 32]; K a multiple of 32 and BLOCK_K of 64. a stays in its dtype (no a_scale).
    MXFP4: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    # Blocks past the padded total (the grid is an upper bound), or of no expert.
    if (pid_m * BLOCK_M >= tl.load(num_rows_ptr)) | (expert < 0):
        return
    pairs = tl.load(pair_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = a_ptr + (pairs // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    if MXFP4:
        mx_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse + cols.to(tl.int64)[None, :] * stride_wsn
    if FP8:
        a_scales = a_scale_ptr + (pairs // A_ROW_DIV).to(tl.int64) * stride_as
        w_scales = w_scale_ptr + expert.to(tl.int64) * stride_wse
        if BLOCK_SCALES:
            # The block row of each output column (a tile may span several blocks, or part of one).
            w_scales_up = w_scales + ((N + cols) // BN) * stride_wsn
            w_scales += (cols // BN) * stride_wsn
        else:
            w_scales_up = w_scales + (N + cols) * stride_wsn
            w_scales += cols * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        acc, acc_up = _mxfp4_gemm_k_loop(acc, acc_up, a_rows, row_ok, w_cols, mx_scales, col_ok, N, K, stride_wn,
                                         stride_wsn, GATED, BLOCK_M, BLOCK_N, BLOCK_K,
                                         DOT_PRECISION)
    else:
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]: w^T tile
            if BLOCK_SCALES:
                # Each group's partial sum on its own, times its two scales, added in fp32 (as
                # fp8_block_gemm.py: the FP8 MMA's narrow accumulator spans one group at most).
                a_s = tl.load(a_scales + k0 // BK, mask=row_ok, other=0.0)[:, None]
                acc += tl.dot(a, w) * a_s * tl.load(w_scales + k0 // BK, mask=col_ok, other=0.0)[None, :]
                if GATED:
                    w_up = tl.load(w_cols + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                    w_s_up = tl.load(w_scales_up + k0 // BK, mask=col_ok, other=0.0)[None, :]
                    acc_up += tl.dot(a, w_up) * a_s * w_s_up
            elif FP8:
                # Row scales are constant over K: applied once, after the loop. The codes' products
                # sum in the FP8 MMA's own accumulator over all of K (fast accumulation, as the per-row
                # FP8 linears' torch._scaled_mm, fp8_linear.py); `acc += tl.dot(a, w)` would add each
                # tile's result in fp32 registers instead, waiting on every MMA (fp8_block_gemm.py).
                acc = tl.dot(a, w, acc)
                if GATED:
                    w_up = tl.load(w_cols + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                    acc_up = tl.dot(a, w_up, acc_up)
            else:
                acc += tl.dot(a, w, input_precision=DOT_PRECISION)
                if GATED:
                    w_up = tl.load(w_cols + N * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                    acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    if FP8:
        if not BLOCK_SCALES:
            a_s = tl.load(a_scales, mask=row_ok, other=0.0)[:, None]
            acc = acc * a_s * tl.load(w_scales, mask=col_ok, other=0.0)[None, :]
            if GATED:
                acc_up = acc_up * a_s * tl.load(w_scales_up, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        bias_row = bias_ptr + expert.to(tl.int64) * stride_be
        acc += tl.load(bias_row + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(bias_row + N + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc = _gated_activation(gate, up, ACTIVATION, ALPHA, LIMIT)
    elif ACTIVATION == 3:  # RELU2 (non-gated up rows), on the sums rounded as the unfused up projection stores them
        acc = _relu2(acc.to(out_ptr.dtype.element_ty).to(tl.float32))
    if ROUTED:
        acc = acc * tl.load(route_w_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv_gate_up_kernel(
    out_ptr,
    x_ptr,
    w_ptr,
    topk_ids_ptr,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_o,
    norm_w_ptr,  # NORM: the RMSNorm weight [K]; x holds the un-normed rows
    eps,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,  # launched with programmatic dependent launch (pdl.py)
    # FP8 (module docstring): x and w hold E4M3 codes (no NORM). a_scale: x's, float32 per token,
    # or with BLOCK_SCALES per token and BK group; w_scale: per row of each expert's w13, or per
    # BN x BK block. The groups of both are unit-stride.
    a_scale_ptr=None,
    w_scale_ptr=None,
    stride_as=0,
    stride_wse=0,
    stride_wsn=0,
    FP8: tl.constexpr = False,
    BLOCK_SCALES: tl.constexpr = False,  # BLOCK_K is a multiple of BK
    BN: tl.constexpr = 1,
    BK: tl.constexpr = 1,
    bias_ptr=None,  # gpt-oss: as the grouped kernel's (bias [E, 2N]); ACTIVATION likewise (`Activation`)
    stride_be=0,
    HAS_BIAS: tl.constexpr = False,
    ACTIVATION: tl.constexpr = 0,
    ALPHA: tl.constexpr = 0.0,
    LIMIT: tl.constexpr = 0.0,
    MXFP4: tl.constexpr = False,  # as the grouped kernel's (no NORM; BLOCK_K a multiple of 32)
    GATED: tl.constexpr = True,  # off: w13 holds the up rows only, out = relu(up)^2 (ACTIVATION RELU2; float or FP8)
):
    """Program (pair, n-block): act(gate) * up (ACTIVATION) of BLOCK_N columns for one (token, slot) pair;
    relu(up)^2 without GATED.

    NORM: x = rms_norm(h) in one pass, as kernels/gemv.py: the norm weight multiplies each x
    tile, the sum of squares of h is accumulated beside the products, and rstd scales the row
    sums."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)  # (which expert's weights to read is the router's output)
    pair = tl.program_id(0)
    token = pair // TOP_K
    expert = tl.load(topk_ids_ptr + pair).to(tl.int64)
    x_row = x_ptr + token.to(tl.int64) * stride_x
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    w_rows = w_ptr + expert * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    if MXFP4:
        s_rows = w_scale_ptr + expert * stride_wse + rows.to(tl.int64)[:, None] * stride_wsn
        gate, up = _mxfp4_gate_up(x_row, w_rows, s_rows, rmask, N, K, stride_wn, stride_wsn, BLOCK_N, BLOCK_K)
    elif BLOCK_SCALES:
        gate, up = _block_scaled_gate_up(x_row, a_scale_ptr + token.to(tl.int64) * stride_as, w_rows,
                                         w_scale_ptr + expert * stride_wse, rows, rmask, N, K, stride_wn,
                                         stride_wsn, BN, BK, BLOCK_N, BLOCK_K, GATED)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            x, h = _input_tile(x_row, norm_w_ptr, ks, kmask, NORM)
            wmask = rmask[:, None] & kmask[None, :]
            # Each expert row is read once per step: stream it past the cache.
            w = tl.load(w_rows + ks[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            if GATED:
                w_up = tl.load(w_rows + N * stride_wn + ks[None, :], mask=wmask, other=0.0,
                               eviction_policy="evict_first")
                acc_up += w_up.to(tl.float32) * x[None, :]
            if NORM:
                sq += h * h
        gate, up = _paired_row_sums(acc, acc_up, sq, K, eps, NORM)
        if FP8:  # row scales are constant over K: applied to the sums of code products
            x_s = tl.load(a_scale_ptr + token.to(tl.int64) * stride_as)
            w_scales = w_scale_ptr + expert * stride_wse + rows * stride_wsn
            gate *= x_s * tl.load(w_scales, mask=rmask, other=0.0)
            if GATED:  # (non-gated: no up half; w_scale has N rows)
                up *= x_s * tl.load(w_scales + N * stride_wsn, mask=rmask, other=0.0)
    if HAS_BIAS:
        bias_row = bias_ptr + expert * stride_be
        gate += tl.load(bias_row + rows, mask=rmask, other=0.0).to(tl.float32)
        up += tl.load(bias_row + N + rows, mask=rmask, other=0.0).to(tl.float32)
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    if GATED:
        up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = _gated_activation(gate, up, ACTIVATION, ALPHA, LIMIT)
    else:  # (the up rows' sums, in `gate`)
        y = _relu2(gate)
    tl.store(out_ptr + pair.to(tl.int64) * stride_o + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """The gated activation epilogue of both paths (`Activation`), gate and up in fp32."""
    if ACTIVATION == 1:
        y = _swiglu_oai(gate, up, ALPHA, LIMIT)
    elif ACTIVATION == 2:
        y = _gelu_tanh(gate) * up
    else:
        y = gate / (1.0 + tl.exp(-gate)) * up
    return y


@triton.jit
def _relu2(x):
    """relu(x)^2 (transformers' ReLUSquaredActivation, vLLM's "relu2"), in fp32."""
    x = tl.maximum(x, 0.0)
    return x * x


@triton.jit
def _gelu_tanh(x):
    """0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) as x * sigmoid(2 z): the same value, one exp and no
    tanh; exp(-2z) overflowing to inf for very negative x gives -0 (as gelu does), not a NaN."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x / (1.0 + tl.exp(-2.0 * z))


@triton.jit
def _swiglu_oai(gate, up, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """gpt-oss's expert activation (layers/fused_moe.swiglu_oai_torch): gate clamped above at LIMIT,
    up to [-LIMIT, LIMIT], then gate * sigmoid(ALPHA * gate) * (up + 1)."""
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate / (1.0 + tl.exp(-ALPHA * gate)) * (up + 1.0)


@triton.jit
def _e2m1_pairs(packed):
    """Packed bytes (two E2M1 codes each, the even column's in the low nibble) -> (even columns, odd
    columns) in fp32, each code's value times 2**-14 (`_e8m0_factor` makes up the 2**14)."""
    b = packed.to(tl.int32)
    # The fp16 bits of code * 2**-14: the sign to bit 15, the two exponent bits and the mantissa bit
    # to bits 11-9. Exponent 0 lands on the fp16 subnormals, so 0.5 (code 1) comes out exact too.
    even = (((b & 0x08) << 12) | ((b & 0x07) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
    odd = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)
    return even.to(tl.float32), odd.to(tl.float32)


@triton.jit
def _e8m0_factor(scale):
    """E8M0 scales -> 2**(scale - 127) * 2**14 in fp32, written as an exponent field (finite for
    scales up to 240; `_e2m1_pairs` made the codes 2**14 smaller)."""
    return ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_mxfp4(byte_ptrs, scale_ptrs, mask, scale_mask, EVICT: tl.constexpr):
    """A tile of MXFP4 weights in fp32: `byte_ptrs` address packed bytes, `scale_ptrs` their groups'
    E8M0 scales in a shape that broadcasts against them (a size-1 axis over each group's 16 bytes:
    one scale load per group, not per weight). Returns (even columns, odd columns), each of the
    bytes' shape."""
    even, odd = _e2m1_pairs(tl.load(byte_ptrs, mask=mask, other=0, eviction_policy=EVICT))
    factor = _e8m0_factor(tl.load(scale_ptrs, mask=scale_mask, other=0))
    return even * factor, odd * factor


@triton.jit
def _mxfp4_gemm_k_loop(acc, acc_up, a_rows, row_ok, w_cols, s_cols, col_ok, N, K, stride_wn, stride_wsn,
                       GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """The grouped GEMM's K loop over MXFP4 weights. w_cols / s_cols: the tile's columns' first packed
    byte and first scale ([1, BLOCK_N]).

    bf16 activations: tl.dot_scaled, Triton's microscaling dot (on Hopper it upcasts the e2m1 tile to
    bf16 in registers and runs the bf16 MMA: the same products). Built by hand, the dequantized tile
    went through shared memory in 33 barrier-separated rounds a K step (sm_90 SASS), against 3.
    fp32 and fp16 activations (float32 models, tests; dot_scaled's fp16 operand is not on every
    target): each K tile's even and odd columns of a against the weight tile's two halves dequantized
    by `_load_mxfp4` and rounded to a's dtype (exact), two half-K dots."""
    groups_in_tile = tl.arange(0, BLOCK_K // 32)
    s_rows = tl.trans(s_cols)  # [BLOCK_N, 1]
    for k0 in range(0, K, BLOCK_K):
        groups = k0 // 32 + groups_in_tile
        g_ok = groups * 32 < K
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
        s_mask = col_ok[:, None] & g_ok[None, :]
        if a.dtype == tl.bfloat16:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            w_mask = (kb < K // 2)[:, None] & col_ok[None, :]
            w = tl.load(w_cols + kb[:, None], mask=w_mask, other=0)  # [BLOCK_K / 2, BLOCK_N] packed along K
            scale = tl.load(s_rows + groups[None, :], mask=s_mask, other=0)  # [BLOCK_N, BLOCK_K / 32]
            acc = tl.dot_scaled(a, None, "bf16", w, scale, "e2m1", acc)
            if GATED:
                w = tl.load(w_cols + N * stride_wn + kb[:, None], mask=w_mask, other=0)
                scale = tl.load(s_rows + N * stride_wsn + groups[None, :], mask=s_mask, other=0)
                acc_up = tl.dot_scaled(a, None, "bf16", w, scale, "e2m1", acc_up)
        else:
            a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
            # The weight tile is built N-major, [BLOCK_N, BLOCK_K / 2] (each row's bytes contiguous, as
            # a float [N, K] tile is loaded), and transposed for the dot.
            byte = (groups[:, None] * 16 + tl.arange(0, 16)[None, :])[None, :, :]  # [1, G, 16]
            w_rows = tl.trans(w_cols)[:, :, None] + byte
            w_mask = s_mask[:, :, None]
            scale = (s_rows + groups[None, :])[:, :, None]  # [BLOCK_N, G, 1]
            even, odd = _load_mxfp4(w_rows, scale, w_mask, w_mask, "")
            even, odd = even.to(a.dtype), odd.to(a.dtype)
            acc = tl.dot(a_even, tl.trans(tl.reshape(even, (BLOCK_N, BLOCK_K // 2))), acc,
                         input_precision=DOT_PRECISION)
            acc = tl.dot(a_odd, tl.trans(tl.reshape(odd, (BLOCK_N, BLOCK_K // 2))), acc,
                         input_precision=DOT_PRECISION)
            if GATED:
                even, odd = _load_mxfp4(w_rows + N * stride_wn, scale + N * stride_wsn, w_mask, w_mask, "")
                even, odd = even.to(a.dtype), odd.to(a.dtype)
                acc_up = tl.dot(a_even, tl.trans(tl.reshape(even, (BLOCK_N, BLOCK_K // 2))), acc_up,
                                input_precision=DOT_PRECISION)
                acc_up = tl.dot(a_odd, tl.trans(tl.reshape(odd, (BLOCK_N, BLOCK_K // 2))), acc_up,
                                input_precision=DOT_PRECISION)
    return acc, acc_up


@triton.jit
def _e2m1_word_pair(words, N: tl.constexpr):
    """Columns N and N + 4 of int32 words of 8 packed codes each (nibble n of a word is its column n)
    in fp32, each code's value times 2**-14 (`_e8m0_factor` makes up the 2**14). Both codes are moved
    into the fp16 layout at once, one to each half of the word (the sign to bit 15 of its half, the
    exponent and mantissa bits to bits 11-9; exponent 0 is the fp16 subnormal, so 0.5 is exact): two
    shifts and two masks for two weights, where a byte at a time costs twice that."""
    if N == 3:
        magnitude = (words >> 3) & 0x0E000E00
    else:
        magnitude = (words << (9 - 4 * N)) & 0x0E000E00
    bits = magnitude | ((words << (12 - 4 * N)) & -2147450880)  # (0x80008000: the halves' sign bits)
    low = bits.to(tl.uint16).to(tl.float16, bitcast=True)
    high = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return low.to(tl.float32), high.to(tl.float32)


@triton.jit
def _mxfp4_gate_up(x_row, w_rows, s_rows, rmask, N, K, stride_wn, stride_wsn, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """The gate and up row sums of one pair with MXFP4 weights. A K tile is [BLOCK_K / 32 groups, 4]
    int32 words of each row (8 codes a word); the token's columns times the codes are summed per group
    in fp32, and each group's sum takes its scale (one multiply a group, not a weight). w_rows /
    s_rows: each gate row's first packed byte and first scale ([BLOCK_N, 1]; rows start on 16 bytes)."""
    groups_in_tile = tl.arange(0, BLOCK_K // 32)
    word_in_group = tl.arange(0, 4)
    gate_words = w_rows.to(tl.pointer_type(tl.int32))[:, :, None]
    up_words = (w_rows + N * stride_wn).to(tl.pointer_type(tl.int32))[:, :, None]
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // 32], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        groups = k0 // 32 + groups_in_tile
        g_ok = groups * 32 < K
        word = (groups[:, None] * 4 + word_in_group[None, :])[None, :, :]  # [1, G, 4]
        w_mask = rmask[:, None, None] & g_ok[None, :, None]
        # Each expert row is read once per step: stream it past the cache.
        gate = tl.load(gate_words + word, mask=w_mask, other=0, eviction_policy="evict_first")
        up = tl.load(up_words + word, mask=w_mask, other=0, eviction_policy="evict_first")
        x_cols = x_row + groups[:, None] * 32 + word_in_group[None, :] * 8  # [G, 4]: each word's first column
        part = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        part_up = tl.zeros([BLOCK_N, BLOCK_K // 32, 4], dtype=tl.float32)
        for n in tl.static_range(4):
            x_low = tl.load(x_cols + n, mask=g_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            x_high = tl.load(x_cols + n + 4, mask=g_ok[:, None], other=0.0).to(tl.float32)[None, :, :]
            low, high = _e2m1_word_pair(gate, n)
            part += low * x_low
            part += high * x_high  # (two fused multiply-adds)
            low, high = _e2m1_word_pair(up, n)
            part_up += low * x_low
            part_up += high * x_high  # (two fused multiply-adds)
        s_mask = rmask[:, None] & g_ok[None, :]
        acc += tl.sum(part, axis=2) * _e8m0_factor(tl.load(s_rows + groups[None, :], mask=s_mask, other=0))
        acc_up += tl.sum(part_up, axis=2) * _e8m0_factor(tl.load(s_rows + N * stride_wsn + groups[None, :],
                                                                 mask=s_mask, other=0))
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _mxfp4_down_slots(x_rows, smask, w_tile, s_tile, rmask, K, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The down kernel's per-slot row sums [BLOCK_N, BLOCK_S] with MXFP4 weights: as _mxfp4_gate_up,
    every slot at once. x_rows [BLOCK_S, 1]: each pair's row; w_tile / s_tile [BLOCK_N, BLOCK_S, 1]:
    each row's first packed byte and first scale in each slot's expert."""
    groups_in_tile = tl.arange(0, BLOCK_K // 32)
    word_in_group = tl.arange(0, 4)
    w_words = w_tile.to(tl.pointer_type(tl.int32))[:, :, :, None]
    acc = tl.zeros([BLOCK_N, BLOCK_S, BLOCK_K // 32], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        groups = k0 // 32 + groups_in_tile
        g_ok = groups * 32 < K
        word = (groups[:, None] * 4 + word_in_group[None, :])[None, None, :, :]  # [1, 1, G, 4]
        s_mask = (rmask[:, None] & smask[None, :])[:, :, None] & g_ok[None, None, :]
        # Each expert row is read once per step: stream it past the cache.
        w = tl.load(w_words + word, mask=s_mask[:, :, :, None], other=0, eviction_policy="evict_first")
        x_cols = x_rows[:, :, None] + (groups[:, None] * 32 + word_in_group[None, :] * 8)[None, :, :]  # [S, G, 4]
        x_mask = smask[:, None, None] & g_ok[None, :, None]
        part = tl.zeros([BLOCK_N, BLOCK_S, BLOCK_K // 32, 4], dtype=tl.float32)
        for n in tl.static_range(4):
            x_low = tl.load(x_cols + n, mask=x_mask, other=0.0).to(tl.float32)[None, :, :, :]
            x_high = tl.load(x_cols + n + 4, mask=x_mask, other=0.0).to(tl.float32)[None, :, :, :]
            low, high = _e2m1_word_pair(w, n)
            part += low * x_low
            part += high * x_high  # (two fused multiply-adds)
        acc += tl.sum(part, axis=3) * _e8m0_factor(tl.load(s_tile + groups[None, None, :], mask=s_mask, other=0))
    return tl.sum(acc, axis=2)


@triton.jit
def _block_scaled_gate_up(x_row, a_scales, w_rows, w_scales, rows, rmask, N, K, stride_wn, stride_wsn,
                          BN: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GATED: tl.constexpr = True):
    """The gate and up row sums of one pair with block-wise FP8 (x codes at a scale per BK group,
    w codes at a scale per BN x BK block): a K tile is [BLOCK_K // BK groups, BK], so a scale is
    loaded per row and group, not per weight, and each weight costs a multiply by its block's
    scale beside the fused multiply-add. The products are the reference's, dequantized weight
    times fake-quantized input (layers/quant/fp8_moe_ref.py), each rounded as it rounds them. GATED off:
    w13 holds the up rows alone, summed as the gate rows are (the second sum stays zero)."""
    groups = tl.arange(0, BLOCK_K // BK)
    tile = groups[:, None] * BK + tl.arange(0, BK)[None, :]
    w_tile = w_rows[:, :, None]
    gate_scales = w_scales + (rows // BN).to(tl.int64)[:, None] * stride_wsn
    up_scales = w_scales + ((N + rows) // BN).to(tl.int64)[:, None] * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_K // BK, BK], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K // BK, BK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tile
        kmask = ks < K
        g = k0 // BK + groups
        gmask = g * BK < K
        x = tl.load(x_row + ks, mask=kmask, other=0.0).to(tl.float32)
        x = x * tl.load(a_scales + g, mask=gmask, other=0.0)[:, None]
        smask = rmask[:, None] & gmask[None, :]
        wmask = rmask[:, None, None] & kmask[None, :, :]
        # Each expert row is read once per step: stream it past the cache.
        w = tl.load(w_tile + ks[None, :, :], mask=wmask, other=0.0, eviction_policy="evict_first")
        w_s = tl.load(gate_scales + g[None, :], mask=smask, other=0.0)
        acc += w.to(tl.float32) * w_s[:, :, None] * x[None, :, :]
        if GATED:
            w_up = tl.load(w_tile + N * stride_wn + ks[None, :, :], mask=wmask, other=0.0,
                           eviction_policy="evict_first")
            w_s_up = tl.load(up_scales + g[None, :], mask=smask, other=0.0)
            acc_up += w_up.to(tl.float32) * w_s_up[:, :, None] * x[None, :, :]
    return tl.sum(tl.sum(acc, axis=2), axis=1), tl.sum(tl.sum(acc_up, axis=2), axis=1)


@triton.jit
def _gemv_down_kernel(
    out_ptr,
    inter_ptr,
    w_ptr,
    topk_ids_ptr,
    route_w_ptr,
    N,
    K,
    stride_i,
    stride_we,
    stride_wn,
    stride_o,
    res_ptr,
    stride_r,
    TOP_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_S: tl.constexpr,  # TOP_K rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
    # FP8 (module docstring): inter and w hold E4M3 codes. a_scale: inter's, float32 per pair, or
    # with BLOCK_SCALES per pair and BK group; w_scale: per row of each expert's w2, or per BN x BK
    # block. The groups of both are unit-stride.
    a_scale_ptr=None,
    w_scale_ptr=None,
    stride_as=0,
    stride_wse=0,
    stride_wsn=0,
    FP8: tl.constexpr = False,
    BLOCK_SCALES: tl.constexpr = False,  # BLOCK_K divides BK: a K tile lies in one group
    BN: tl.constexpr = 1,
    BK: tl.constexpr = 1,
    bias_ptr=None,  # gpt-oss: a bias [E, N] per expert, added to each slot's product before its weight
    stride_be=0,
    HAS_BIAS: tl.constexpr = False,
    MXFP4: tl.constexpr = False,  # as the grouped kernel's (BLOCK_K a multiple of 32)
):
    """Program (token, n-block): sum over the token's k slots of weight * (w2[e] @ inter[pair]),
    plus the token's residual row with HAS_RESIDUAL (the one-token decode path's h + mlp(h)).

    All k slots stream in one [BLOCK_N, slots, BLOCK_K] tile per step of K rather than one slot
    after another: Qwen3-30B-A3B's experts are short (K = 768), and a loop over its 8 slots
    waited on each slot's loads in turn (12.4 -> 8.4 us a layer on an H200)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    slots = tl.arange(0, BLOCK_S)
    smask = slots < TOP_K
    pairs = token * TOP_K + slots
    experts = tl.load(topk_ids_ptr + pairs, mask=smask, other=0).to(tl.int64)
    route_w = tl.load(route_w_ptr + pairs, mask=smask, other=0.0).to(tl.float32)
    w_tile = w_ptr + experts[None, :, None] * stride_we + rows.to(tl.int64)[:, None, None] * stride_wn
    x_rows = inter_ptr + pairs.to(tl.int64)[:, None] * stride_i
    if FP8:
        a_scales = a_scale_ptr + pairs.to(tl.int64) * stride_as  # [BLOCK_S]
        # [BLOCK_N, BLOCK_S]: each row's scale (or its block row's) in each slot's expert
        w_scales = w_scale_ptr + experts[None, :] * stride_wse + (rows // BN).to(tl.int64)[:, None] * stride_wsn
        scale_mask = rmask[:, None] & smask[None, :]
    if MXFP4:
        s_tile = w_scale_ptr + experts[None, :, None] * stride_wse + rows.to(tl.int64)[:, None, None] * stride_wsn
        per_slot = _mxfp4_down_slots(x_rows, smask, w_tile, s_tile, rmask, K, BLOCK_N, BLOCK_S, BLOCK_K)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_S, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            kmask = ks < K
            x = tl.load(x_rows + ks[None, :], mask=smask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            # Each expert row is read once per step: stream it past the cache.
            w = tl.load(w_tile + ks[None, None, :],
                        mask=rmask[:, None, None] & smask[None, :, None] & kmask[None, None, :], other=0.0,
                        eviction_policy="evict_first")
            if BLOCK_SCALES:  # the tile's group: dequantized weight times fake-quantized input
                x = x * tl.load(a_scales + k0 // BK, mask=smask, other=0.0)[:, None]
                w_s = tl.load(w_scales + k0 // BK, mask=scale_mask, other=0.0)
                acc += w.to(tl.float32) * w_s[:, :, None] * x[None, :, :]
            else:
                acc += w.to(tl.float32) * x[None, :, :]
        per_slot = tl.sum(acc, axis=2)
    if FP8:
        if not BLOCK_SCALES:  # row scales are constant over K: applied to the sums of code products
            x_s = tl.load(a_scales, mask=smask, other=0.0)
            per_slot = per_slot * x_s[None, :] * tl.load(w_scales, mask=scale_mask, other=0.0)
    if HAS_BIAS:
        per_slot += tl.load(bias_ptr + experts[None, :] * stride_be + rows.to(tl.int64)[:, None],
                            mask=rmask[:, None] & smask[None, :], other=0.0).to(tl.float32)
    # Each slot's product rounded to the activation dtype, as the grouped path stores it.
    per_slot = per_slot.to(out_ptr.dtype.element_ty).to(tl.float32)
    y = tl.sum(per_slot * route_w[None, :], axis=1)
    if HAS_RESIDUAL:
        # The experts' sum rounded as the unfused layer stores it, then the add (rounded once more).
        y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
        y += tl.load(res_ptr + token.to(tl.int64) * stride_r + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * stride_o + rows, y.to(out_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _route_top_k_kernel(
    weights_ptr,
    ids_ptr,
    logits_ptr,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,  # TOP_K rounded up to a power of two (a block's length)
    USE_PDL: tl.constexpr,
):
    """Program per token: softmax over the experts' logits, the k largest (ties: the lower expert
    id), their probabilities (renormalised to sum 1 with RENORMALIZE)."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < num_experts
    logits = tl.load(logits_ptr + token * stride_l + e, mask=emask, other=-float("inf")).to(tl.float32)
    top = tl.max(logits, axis=0)
    p = tl.where(emask, tl.exp(logits - top), 0.0)
    p = p / tl.sum(p, axis=0)
    remaining = tl.where(emask, p, -1.0)  # probabilities are >= 0: -1 marks taken / padding
    ks = tl.arange(0, BLOCK_TOP_K)
    chosen_p = tl.zeros([BLOCK_TOP_K], dtype=tl.float32)
    chosen_id = tl.zeros([BLOCK_TOP_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, e, BLOCK_E), axis=0)
        chosen_p = tl.where(ks == j, best, chosen_p)
        chosen_id = tl.where(ks == j, best_id.to(tl.int64), chosen_id)
        remaining = tl.where(e == best_id, -1.0, remaining)
    if RENORMALIZE:
        chosen_p = chosen_p / tl.sum(chosen_p, axis=0)
    tl.store(weights_ptr + token * TOP_K + ks, chosen_p, mask=ks < TOP_K)
    tl.store(ids_ptr + token * TOP_K + ks, chosen_id, mask=ks < TOP_K)


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/fused_moe.select_experts in one launch (the torch version is ~6: softmax, topk's
    two kernels, the renormalisation): (weights float32 [T, k], expert ids int64 [T, k])."""
    tokens, experts = router_logits.shape
    if not 0 < top_k <= experts:
        raise ValueError(f"route_top_k: top_k {top_k} must be in 1..{experts} (the number of experts)")
    if router_logits.stride(-1) != 1:
        raise ValueError("route_top_k: router_logits must have a contiguous last axis")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        # One warp: the k rounds of max / argmin reductions stay in shuffles (no shared-memory barriers).
        _route_top_k_kernel[(tokens,)](weights, ids, router_logits, experts, router_logits.stride(0), TOP_K=top_k,
                                       RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(experts),
                                       BLOCK_TOP_K=triton.next_power_of_2(top_k), num_warps=1,
                                       **pdl_launch(router_logits.device))
    return weights, ids


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _by_load(num_pairs: int, num_experts: int, tiles: tuple[GemmConfig, GemmConfig, GemmConfig]) -> GemmConfig:
    """Rows per block follow the mean load per expert: small blocks waste less padding when each
    expert sees few tokens, large ones reuse each weight tile over more rows. tiles: for up to 16
    rows an expert, up to 64, and more."""
    per_expert = num_pairs / num_experts
    return tiles[0] if per_expert <= 16 else tiles[1] if per_expert <= 64 else tiles[2]


# 16-bit experts, from `benches/bench_moe_gemm.py` on an H100 (us a layer, the earlier tiles -> these):
# Qwen3-30B-A3B 256 tokens (16 rows an expert) 481 -> 461, 2048 tokens 814 -> 734, 8192 tokens
# 2300 -> 1992; Mixtral-8x7B 256 tokens (64 rows) 1230 -> 1065, 2048 tokens 3886 -> 3047, 8192 tokens
# 16349 -> 12438 (-24%).
_SWEPT_TILES = (GemmConfig(32, 64, 64, 4, 3), GemmConfig(64, 128, 64, 4, 3), GemmConfig(128, 128, 64, 8, 3))
# The tiles before that sweep, kept where they were not measured against it: FP8 experts (their K tile
# and stages then follow the weight blocks, _fp8_gemm_config) and MXFP4's light loads.
_UNSWEPT_TILES = (GemmConfig(16, 64, 64, 4, 3), GemmConfig(32, 64, 64, 4, 3), GemmConfig(64, 128, 64, 8, 3))
# MXFP4 experts, from `benches/bench_mxfp4.py --gemm-sweep` on an H100 (1024 tokens, us a gpt-oss layer,
# the float experts' tiles -> these): gpt-oss-20b (128 rows an expert) 1472 -> 1177 with 128 x 64 tiles,
# gpt-oss-120b (32 rows) 2459 -> 2133 with 64 x 64, both at 4 warps. Hopper's dot_scaled widens each
# e2m1 weight tile to bf16 in registers on its way to the MMA: column tiles of 64 halve that work a step
# against 128, and more rows reuse each widened tile.
_MXFP4_TILES = (_UNSWEPT_TILES[0], GemmConfig(64, 64, 64, 4, 3), GemmConfig(128, 64, 64, 4, 4))


def choose_gemm_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """The grouped GEMM's tile for 16-bit experts."""
    return _by_load(num_pairs, num_experts, _SWEPT_TILES)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    """Small-batch path: rows per program and K tile of the gate/up kernel, rows per program and
    K tile of the down kernel (whose tile spans all k slots), warps."""

    gate_up_rows: int
    gate_up_block_k: int
    down_rows: int
    down_block_k: int
    num_warps: int


def choose_gemv_config(hidden: int, inter: int, top_k: int, *, num_tokens: int = 1, fp8: bool = False,
                       block: tuple[int, int] | None = None, mxfp4: bool = False) -> GemvConfig:
    """From a sweep on an H200 (out of the gate/up rows 2-16, K tiles 512-2048, 4 or 8 warps, and
    the down kernel's rows 1-8 and K tiles 128-2048; benches/RESULTS.md): gate/up streams best in
    2-row programs over K tiles of 512 (3.1 TB/s on Qwen3-30B-A3B's short experts, 4.3 on
    Mixtral's); the down tile holds all slots, so its rows shrink as k grows, and its K tile is
    a power of two dividing the expert size (no masked lanes): 128 for 8 slots of Qwen3-30B-A3B's
    768 (8.4 us against 12.4 for the per-slot loop), 2048 for Mixtral's 2 of 14336 (4.2 TB/s).

    FP8 experts (fp8, with `block` their weight blocks) stream one byte a weight, so a program
    holds more rows for the same bytes in flight: per-row scales, gate/up programs of 4 rows; blocks
    (whose gate/up tile also carries a scale per row and group), down programs of twice the rows.
    Swept on an H200 at Qwen3-30B-A3B's shapes, one token, 48 layers in a CUDA graph (RESULTS.md,
    Dec 3): 21.8 -> 19.8 us a layer per row, 25.6 -> 23.5 us with 128 x 128 blocks (bf16: 23.5).

    Float experts of many-expert models (k >= 8: Qwen3-MoE's short experts) take K tiles of 1024,
    one 16-byte vector of the token per thread of 4 warps, so the token's tile is in the weight
    tile's layout as loaded (a 512 tile went through shared memory: two barriers an iteration in the
    SASS, benches/sass_loop.py); 4 rows a program for one token, 1 for more. Measured in the engine
    on an H200 (Qwen3-30B-A3B, ABAB, thirty-sixth session): batch-1 step 2.459 -> 2.446 ms, batch 4
    5.527 -> 5.460, batch 8 5.542 -> 5.475 (4 x 1024 at batch 4: 5.75; 2 x 1024: 2.49 / 5.92).
    Mixtral's shape (k = 2, long experts) keeps 2 x 512: not measured with the wider tiles.

    MXFP4 experts (half a byte a weight; gpt-oss's experts are 2880 wide, so a last K tile is masked):
    gate/up programs of 4 rows x 512 columns, down programs of 8 rows x 256 columns of each of up to 4
    slots: the fastest of the 16 pairs benches/bench_mxfp4.py --sweep timed on an H100 (gpt-oss-20b, one
    token: 52 us a layer against 68 for 4 x 1024 / 4 x 512, the tiles with the fewest SASS instructions a
    weight; more, shorter programs keep more of the packed bytes in flight)."""
    if mxfp4:
        return GemvConfig(4, min(512, max(32, triton.next_power_of_2(hidden))), 8 if top_k <= 4 else 4,
                          min(256, max(32, triton.next_power_of_2(inter))), 4)
    slots = triton.next_power_of_2(top_k)
    down_rows = 1 if slots >= 4 else 2
    down_block_k = min(inter & -inter, 128 if slots >= 8 else 2048)
    gate_up_rows = 4 if fp8 and block is None else 2
    gate_up_block_k = min(512, triton.next_power_of_2(hidden))
    if fp8 and block is not None:
        down_rows *= 2
    if not fp8 and top_k >= 8:
        gate_up_rows = 4 if num_tokens == 1 else 1
        gate_up_block_k = min(1024, triton.next_power_of_2(hidden))
    return GemvConfig(gate_up_rows, gate_up_block_k, down_rows, down_block_k, 4)


def use_small_batch_path(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Matrix-vector products per pair while the pairs are few against the experts: a pair then
    rarely shares its expert with another, so reading per pair costs little over reading each
    selected expert once, and the sort's launches are saved (Qwen3-30B-A3B: up to 8 tokens,
    Mixtral: up to 2)."""
    return num_tokens * top_k <= max(top_k, num_experts // 2)


def _quantize_fp8(a: torch.Tensor, w_scale: torch.Tensor, block: tuple[int, int] | None
                  ) -> tuple[torch.Tensor, dict[str, Any]]:
    """a [M, K] in E4M3 codes, per row (block None) or per row and BK group, as the reference
    quantizes it (layers/quant/fp8_moe_ref.py); and the launch arguments of the product that reads
    it with the weight scales w_scale."""
    codes, scale = quantize_activations_triton(a) if block is None else quantize_fp8_groups_triton(a, block[1])
    bn, bk = block if block is not None else (1, 1)
    args = dict(a_scale_ptr=scale, w_scale_ptr=w_scale, stride_as=scale.stride(0), stride_wse=w_scale.stride(0),
                stride_wsn=w_scale.stride(1), FP8=True, BLOCK_SCALES=block is not None, BN=bn, BK=bk)
    return codes, args


# Shared memory of the FP8 grouped GEMM's pipelined tiles, (block_m + 2 block_n) * block_k bytes a
# stage (a, gate and up): K tiles of wide weight blocks get fewer stages (fp8_block_gemm.py likewise).
_FP8_STAGE_BYTES = 160 * 1024


def _fp8_gemm_config(cfg: GemmConfig, block: tuple[int, int] | None) -> GemmConfig:
    """The grouped GEMM's tile for FP8 experts: the K tile is the weight block's BK (each group's
    partial sum takes its own scales), or at least 32 per row (an FP8 MMA's K)."""
    block_k = block[1] if block is not None else max(cfg.block_k, 32)
    stages = max(1, min(cfg.num_stages, _FP8_STAGE_BYTES // ((cfg.block_m + 2 * cfg.block_n) * block_k)))
    return dataclasses.replace(cfg, block_k=block_k, num_stages=stages)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 tests must not silently drop to tf32 on the GPU.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
           block: tuple[int, int] | None = None, *, gated: bool = True) -> None:
    mxfp4 = w13.dtype == torch.uint8  # two E2M1 codes a byte along K
    pack = 2 if mxfp4 else 1
    e, two_i, h = w13.shape
    h *= pack
    if x.dim() != 2 or x.shape[1] != h or x.stride(-1) != 1:
        raise ValueError(f"x must be [tokens, {h}] with a contiguous last axis, got {tuple(x.shape)}")
    if not gated:
        if w2.shape != (e, h, two_i):
            raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not describe non-gated experts "
                             "[E, I, H] / [E, H, I]")
    elif w2.shape != (e, h, two_i // 2 // pack) or two_i % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not describe [E, 2I, H] / [E, H, I]"
                         + (" (MXFP4: [E, 2I, H / 2] / [E, H, I / 2] packed bytes)" if mxfp4 else ""))
    if not (w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_moe needs contiguous expert weights")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must be "
                         f"[{x.shape[0]}, k]")
    if mxfp4 or w2.dtype == torch.uint8:
        _check_mxfp4(x, w13, w2, w13_scale, w2_scale, block)
    elif w13_scale is not None or w2_scale is not None or block is not None:
        _check_fp8(x, w13, w2, w13_scale, w2_scale, block, gated=gated)
    elif FP8_DTYPE in (w13.dtype, w2.dtype):
        raise ValueError("float8_e4m3fn expert weights need w13_scale and w2_scale")


def _check_mxfp4(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                 w2_scale: torch.Tensor | None, block: tuple[int, int] | None) -> None:
    if w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"MXFP4 experts need both w13 and w2 packed in uint8, got {w13.dtype} and {w2.dtype}")
    if block is not None:
        raise ValueError("block is for FP8 experts; MXFP4 scales are per 32 columns of each row")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32 with MXFP4 experts, got {x.dtype}")
    e, two_i, h = w13.shape[0], w13.shape[1], x.shape[1]
    inter = two_i // 2
    if h % 32 or inter % 32:
        raise ValueError(f"MXFP4 experts: hidden {h} and intermediate {inter} sizes must be multiples of 32 "
                         "(a scale per 32 columns)")
    if w13.data_ptr() % 16 or w2.data_ptr() % 16:
        raise ValueError("MXFP4 experts must start on 16 bytes (the one-token kernels read them as int32 words)")
    for name, scale, shape in (("w13_scale", w13_scale, (e, two_i, h // 32)), ("w2_scale", w2_scale, (e, h, inter // 32))):
        if scale is None or scale.dtype != torch.uint8 or tuple(scale.shape) != shape or not scale.is_contiguous():
            got = "none" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
            raise ValueError(f"MXFP4 experts need {name} uint8 {list(shape)}, contiguous (E8M0 exponents), got {got}")


def _check_fp8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
               w2_scale: torch.Tensor | None, block: tuple[int, int] | None, *, gated: bool = True) -> None:
    if w13_scale is None or w2_scale is None:
        raise ValueError(f"FP8 experts need both w13_scale and w2_scale (got only "
                         f"{'w13_scale' if w13_scale is not None else 'w2_scale' if w2_scale is not None else 'block'})")
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be float8_e4m3fn when scales are given, got {w.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32 with FP8 experts, got {x.dtype}")
    e, two_i, h = w13.shape  # (two_i: w13's rows, I alone for non-gated experts)
    inter = two_i // 2 if gated else two_i
    shapes: dict[str, tuple[int, ...]]
    if block is None:
        shapes = {"w13_scale": (e, two_i), "w2_scale": (e, h)}
    else:
        if not (isinstance(block, tuple | list) and len(block) == 2
                and all(isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)):
            raise ValueError(f"block must be (BN, BK), powers of two >= 16, got {block!r}")
        bn, bk = block
        if bk < 32:
            raise ValueError(f"block: BK {bk} is below the FP8 MMA's K of 32 (the grouped GEMM's K tile is BK)")
        if inter % bn:
            raise ValueError(f"block: the experts' intermediate size {inter} must be a multiple of BN {bn} "
                             "(the gate and up halves of w13 then share no block row)")
        shapes = {"w13_scale": (e, two_i // bn, triton.cdiv(h, bk)),
                  "w2_scale": (e, triton.cdiv(h, bn), triton.cdiv(inter, bk))}
    for (name, shape), scale in zip(shapes.items(), (w13_scale, w2_scale), strict=True):
        if scale.dtype != torch.float32 or tuple(scale.shape) != shape or scale.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 {list(shape)} with a unit last stride, got {scale.dtype} "
                             f"{tuple(scale.shape)}")


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, small_batch: bool | None = None,
              config: GemmConfig | None = None, gemv_config: GemvConfig | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              eps: float = 1e-6, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block: tuple[int, int] | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_oai: tuple[float, float] | None = None,
              activation: Activation = Activation.SILU) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for every token: [T, H] in x's dtype.

    small_batch: force (True) or forbid (False) the matrix-vector path; by default
    `use_small_batch_path` decides from the shapes. residual [T, H]: added to the result (the sum
    rounded to x's dtype first, as an unfused add would see it). norm_weight (matrix-vector path
    only): the experts read rms_norm(x) * norm_weight, normed in the gate/up kernel's prologue.

    FP8 experts (module docstring): w13 and w2 float8_e4m3fn with float32 w13_scale and w2_scale,
    per row ([E, 2I], [E, H]) with block None, or per (BN, BK) block ([E, 2I / BN, ceil(H / BK)],
    [E, ceil(H / BN), ceil(I / BK)]; I a multiple of BN, BK >= 32). No norm_weight: the caller norms.

    MXFP4 experts (module docstring): w13 uint8 [E, 2I, H / 2] and w2 uint8 [E, H, I / 2] packed codes
    with uint8 E8M0 w13_scale [E, 2I, H / 32] and w2_scale [E, H, I / 32]; x in its dtype. No
    norm_weight.

    gpt-oss's experts: w13_bias [E, 2I] (gate rows, then up rows, as w13) and w2_bias [E, H] added to
    each product; swiglu_oai (alpha, limit) in place of SiLU-and-mul (layers/fused_moe.py
    swiglu_oai_torch), which is activation SWIGLU_OAI. Float or MXFP4 experts.

    activation: the gated activation (`Activation`; module docstring). GELU_TANH (Gemma 4's experts,
    layers/fused_moe.py gelu_tanh_and_mul_torch) with float or FP8 experts. RELU2 (Nemotron-H's non-gated
    experts): w13 [E, I, H] holds the up rows only (FP8: w13_scale [E, I], or per block row of them); float or
    FP8 experts, no biases."""
    activation = Activation(activation)
    gated = activation.gated
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, block, gated=gated)
    if not gated and (w13.dtype == torch.uint8 or w13_bias is not None or w2_bias is not None
                      or swiglu_oai is not None):
        raise ValueError("RELU2 (non-gated) experts are taken float or FP8, without biases or swiglu_oai")
    mxfp4 = w13.dtype == torch.uint8
    fp8 = w13_scale is not None and not mxfp4
    gate_up_opts, down_opts = _gpt_oss_options(w13, w2, w13_bias, w2_bias, swiglu_oai, x.shape[1])
    if (gate_up_opts or down_opts) and fp8:
        raise ValueError("expert biases and swiglu_oai are taken with float or MXFP4 experts only")
    if activation == Activation.SWIGLU_OAI and swiglu_oai is None:
        raise ValueError("activation SWIGLU_OAI needs swiglu_oai=(alpha, limit)")
    if swiglu_oai is not None and activation not in (Activation.SILU, Activation.SWIGLU_OAI):
        raise ValueError(f"swiglu_oai is gpt-oss's activation: not taken with activation {activation.name}")
    if activation == Activation.GELU_TANH:
        if mxfp4:
            raise ValueError("GELU_TANH experts are taken float or FP8, not MXFP4 (no such checkpoint)")
        gate_up_opts = dict(gate_up_opts, ACTIVATION=int(Activation.GELU_TANH))
    if not gated:  # Nemotron-H's relu(up)^2 (GATED off: given to each gate/up launch below)
        gate_up_opts = dict(gate_up_opts, ACTIVATION=int(Activation.RELU2))
    if (fp8 or mxfp4) and norm_weight is not None:
        raise ValueError("norm_weight is not taken with FP8 or MXFP4 experts (w13_scale): norm x first")
    if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{x.shape[0]}, {x.shape[1]}] with a contiguous last axis, got "
                         f"{tuple(residual.shape)}")
    if norm_weight is not None and norm_weight.shape != (w13.shape[2],):
        raise ValueError(f"norm weight must be [{w13.shape[2]}], got {tuple(norm_weight.shape)}")
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape[0], w13.shape[1], x.shape[1]
    inter = two_i // 2 if gated else two_i
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    ids = topk_ids.contiguous()
    route_w = topk_weights.to(torch.float32).contiguous()
    num_pairs = num_tokens * top_k
    if small_batch is None:
        small_batch = use_small_batch_path(num_tokens, top_k, num_experts)
    if norm_weight is not None and not small_batch:
        raise ValueError("norm_weight is taken by the matrix-vector path only (small_batch=True)")
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    # With FP8 experts each product's input goes through FP8 first (one launch each), and the
    # launches take the scales; float experts launch as they always have (no FP8 arguments).
    x_in, x_fp8 = _product_input(x, w13_scale, block, fp8=fp8, mxfp4=mxfp4)
    if small_batch:
        gv = gemv_config or choose_gemv_config(hidden, inter, top_k, num_tokens=num_tokens, fp8=fp8, block=block,
                                               mxfp4=mxfp4)
        gate_up_k, down_k = gv.gate_up_block_k, gv.down_block_k
        if block is not None:  # gate/up tiles span whole groups, a down tile lies in one
            gate_up_k, down_k = max(gate_up_k, block[1]), min(down_k, block[1])
        if mxfp4:  # K tiles of whole 32-column groups
            gate_up_k, down_k = max(gate_up_k, 32), max(down_k, 32)
        _gemv_gate_up_kernel[(num_pairs, triton.cdiv(inter, gv.gate_up_rows))](
            act, x_in, w13, ids, inter, hidden, x_in.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
            norm_weight if norm_weight is not None else x, eps, TOP_K=top_k, NORM=norm_weight is not None,
            BLOCK_N=gv.gate_up_rows, BLOCK_K=gate_up_k, num_warps=gv.num_warps, **pdl_launch(x.device), **x_fp8,
            **gate_up_opts, **({} if gated else {"GATED": False}),
        )
        act_in, act_fp8 = _product_input(act, w2_scale, block, fp8=fp8, mxfp4=mxfp4)
        _gemv_down_kernel[(num_tokens, triton.cdiv(hidden, gv.down_rows))](
            out, act_in, w2, ids, route_w, hidden, inter, act_in.stride(0), w2.stride(0), w2.stride(1),
            out.stride(0), residual if residual is not None else out,
            residual.stride(0) if residual is not None else 0, TOP_K=top_k, HAS_RESIDUAL=residual is not None,
            BLOCK_S=triton.next_power_of_2(top_k), BLOCK_N=gv.down_rows, BLOCK_K=down_k, num_warps=gv.num_warps,
            **pdl_launch(x.device), **act_fp8, **down_opts,
        )
        return out

    if config is not None:
        cfg = config
    else:
        cfg = _by_load(num_pairs, num_experts, _MXFP4_TILES if mxfp4 else _UNSWEPT_TILES if fp8 else _SWEPT_TILES)
    if fp8:
        cfg = _fp8_gemm_config(cfg, block)
    elif mxfp4:  # K tiles of whole 32-column groups (each half a dot's K of 16 or more)
        cfg = dataclasses.replace(cfg, block_k=max(cfg.block_k, 32))
    blocks = align_by_expert(ids, num_experts, cfg.block_m)
    num_blocks = blocks.block_expert.shape[0]
    precision = _dot_precision(x.dtype)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n))](
        act, x_in, w13, blocks.pair_ids, blocks.block_expert, blocks.num_rows, route_w, inter, hidden, num_pairs,
        x_in.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        A_ROW_DIV=top_k, GATED=gated, ROUTED=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **x_fp8,
        **gate_up_opts,
    )
    act_in, act_fp8 = _product_input(act, w2_scale, block, fp8=fp8, mxfp4=mxfp4)
    routed = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(num_blocks, triton.cdiv(hidden, cfg.block_n))](
        routed, act_in, w2, blocks.pair_ids, blocks.block_expert, blocks.num_rows, route_w, hidden, inter,
        num_pairs, act_in.stride(0), w2.stride(0), w2.stride(1), routed.stride(0),
        A_ROW_DIV=1, GATED=False, ROUTED=True, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **act_fp8, **down_opts,
    )
    # The k weighted rows of a token: one reduction (fp32 accumulation inside torch's sum).
    torch.sum(routed.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out if residual is None else out + residual


def expert_gate_up_rows(x: torch.Tensor, w13: torch.Tensor, blocks: ExpertBlocks, top_k: int, config: GemmConfig, *,
                        w13_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each (token, slot) pair's gate and up rows before the activation: [T*k, 2I] in x's dtype (pair p = token *
    k + slot; gate columns, then up), as the grouped gate/up launch computes and rounds them. For LoRA on the
    experts (lora/moe.py), which adds each pair's adapter delta to these rows and applies the activation itself:
    the same launch over all 2I rows of w13 with GATED off (no activation, no routing weight), so `fused_moe`'s
    own launches are untouched. Float experts: gated (w13 [E, 2I, H]) or not (Nemotron-H's ReLU^2: w13 [E, I, H],
    the up rows alone, returned as they are); w13_bias [E, 2I] (gpt-oss's) added."""
    num_pairs, hidden = x.shape[0] * top_k, x.shape[1]
    rows = w13.shape[1]
    if x.dim() != 2 or x.stride(-1) != 1 or w13.shape[2] != hidden or not w13.is_contiguous() or w13.dtype != x.dtype:
        raise ValueError(f"expert_gate_up_rows: x [T, {w13.shape[2]}] (contiguous last axis) and contiguous float w13 "
                         f"of x's dtype expected, got x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}")
    out = torch.empty(num_pairs, rows, dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out
    bias: dict[str, Any] = {}
    if w13_bias is not None:
        bias = dict(bias_ptr=w13_bias, stride_be=w13_bias.stride(0), HAS_BIAS=True)
    _grouped_gemm_kernel[(blocks.block_expert.shape[0], triton.cdiv(rows, config.block_n))](
        out, x, w13, blocks.pair_ids, blocks.block_expert, blocks.num_rows, x, rows, hidden, num_pairs, x.stride(0),
        w13.stride(0), w13.stride(1), out.stride(0), A_ROW_DIV=top_k, GATED=False, ROUTED=False,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages, **bias,
    )
    return out


def expert_down_rows(act: torch.Tensor, w2: torch.Tensor, blocks: ExpertBlocks, route_w: torch.Tensor,
                     config: GemmConfig, *, w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's down product times its routing weight, [T*k, H] in act's dtype (not yet summed over a token's k
    pairs), as `fused_moe`'s grouped down launch computes it: the LoRA path's second product (lora/moe.py adds the
    down deltas to these rows, then sums). act [T*k, I] (the activated rows), route_w float32 [T*k]; float experts
    (w2 [E, H, I]), w2_bias [E, H] added before the weight."""
    num_pairs, inter = act.shape
    hidden = w2.shape[1]
    if act.stride(-1) != 1 or w2.shape[2] != inter or not w2.is_contiguous() or w2.dtype != act.dtype \
            or route_w.dtype != torch.float32 or route_w.shape != (num_pairs,):
        raise ValueError(f"expert_down_rows: act [P, {w2.shape[2]}] (contiguous last axis), contiguous float w2 of its "
                         f"dtype and float32 route_w [P] expected, got act {tuple(act.shape)}, w2 {tuple(w2.shape)}, "
                         f"route_w {tuple(route_w.shape)} {route_w.dtype}")
    out = torch.empty(num_pairs, hidden, dtype=act.dtype, device=act.device)
    if num_pairs == 0:
        return out
    bias: dict[str, Any] = {}
    if w2_bias is not None:
        bias = dict(bias_ptr=w2_bias, stride_be=w2_bias.stride(0), HAS_BIAS=True)
    _grouped_gemm_kernel[(blocks.block_expert.shape[0], triton.cdiv(hidden, config.block_n))](
        out, act, w2, blocks.pair_ids, blocks.block_expert, blocks.num_rows, route_w, hidden, inter, num_pairs,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0), A_ROW_DIV=1, GATED=False, ROUTED=True,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION=_dot_precision(act.dtype), num_warps=config.num_warps, num_stages=config.num_stages, **bias,
    )
    return out


def _product_input(a: torch.Tensor, w_scale: torch.Tensor | None, block: tuple[int, int] | None, *, fp8: bool,
                   mxfp4: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    """A product's input and its launch's weight-format arguments: FP8 experts quantize `a` (one
    launch) and pass both scales; MXFP4 experts take `a` as it is and pass the E8M0 scales w_scale
    [E, N, K / 32]; float experts pass nothing, launching (and compiling) as they always have."""
    if fp8:
        assert w_scale is not None  # (_check_fp8)
        return _quantize_fp8(a, w_scale, block)
    if mxfp4:
        assert w_scale is not None  # (_check_mxfp4)
        return a, dict(w_scale_ptr=w_scale, stride_wse=w_scale.stride(0), stride_wsn=w_scale.stride(1), MXFP4=True)
    return a, {}


def _gpt_oss_options(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None,
                     w2_bias: torch.Tensor | None, swiglu_oai: tuple[float, float] | None, hidden: int
                     ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gate/up and down launches' extra arguments for expert biases and gpt-oss's activation;
    empty without them, so the other families launch (and compile) exactly as before."""
    gate_up: dict[str, Any] = {}
    down: dict[str, Any] = {}
    for name, bias, shape, opts in (("w13_bias", w13_bias, (w13.shape[0], w13.shape[1]), gate_up),
                                    ("w2_bias", w2_bias, (w2.shape[0], hidden), down)):
        if bias is None:
            continue
        if tuple(bias.shape) != shape or bias.stride(-1) != 1:
            raise ValueError(f"{name} must be {list(shape)} with a unit last stride, got {tuple(bias.shape)}")
        opts.update(bias_ptr=bias, stride_be=bias.stride(0), HAS_BIAS=True)
    if swiglu_oai is not None:
        alpha, limit = swiglu_oai
        gate_up.update(ACTIVATION=int(Activation.SWIGLU_OAI), ALPHA=float(alpha), LIMIT=float(limit))
    return gate_up, down


def fused_moe_from_logits(h: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                          top_k: int, renormalize: bool, norm_weight: torch.Tensor | None = None,
                          eps: float = 1e-6, residual: torch.Tensor | None = None,
                          gemv_config: GemvConfig | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The small-batch path routed from the router's logits, in three launches:

        x = rms_norm(h, norm_weight, eps)  (h itself without norm_weight)
        weights, ids = route_top_k(router_logits, top_k, renormalize)
        out = fused_moe(x, w13, w2, weights, ids, small_batch=True, residual=residual)

    The norm runs in the gate/up kernel's prologue. Unlike rms_norm, the normed vector is not
    rounded to h's dtype before the products (as gemv's norm prologue: a difference well inside
    bf16 noise). Returns (out [T, H], weights float32 [T, k], ids int64 [T, k])."""
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts or num_experts != w13.shape[0]:
        raise ValueError(f"router_logits {tuple(router_logits.shape)} and top_k {top_k} do not fit "
                         f"{w13.shape[0]} experts (top_k in 1..E)")
    if router_logits.stride(-1) != 1 or h.shape[0] != tokens:
        raise ValueError(f"router_logits must be [{h.shape[0]}, E] with a contiguous last axis")
    weights, ids = route_top_k(router_logits, top_k, renormalize)
    out = fused_moe(h, w13, w2, weights, ids, small_batch=True, gemv_config=gemv_config, residual=residual,
                    norm_weight=norm_weight, eps=eps)
    return out, weights, ids
