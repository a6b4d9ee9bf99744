"""int8 W8A8 one-token steps: the tensor-core product (kernels/w8a8_dot_gemv.py) and the qkv + rotary
+ KV-write kernel (gemv.py) with int8 weights quantize the token themselves, with the int8
quantizer's codes, and sum the products exactly in int32. So without a fused norm they equal the
batched path (the row quantizer, then the int8 GEMM) to the bit; with the RMSNorm prologue they are
checked against the reference quantizer (layers/quant/int8_linear.py's torch one) on the normed
input. A tiny Llama with int8 layers takes the fused one-token path and matches the general path.
Runs on CUDA, and on CPU in the Triton interpreter child; the real shapes on a GPU."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.gemv import qkv_rope_gemv
from ferrox.kernels.int8_gemm import int8_gemm
from ferrox.kernels.rotary import neox_cos_sin_cache
from ferrox.kernels.split_k import _COUNTERS
from ferrox.kernels.w8a8_dot_gemv import DotGemvConfig, w8a8_dot_gemv
from ferrox.layers.quant.compressed_tensors_int8 import CompressedTensorsInt8Config
from ferrox.layers.quant.int8_linear import (
    Int8Linear,
    quantize_int8_per_row,
    quantize_int8_torch,
    quantize_int8_triton,
)

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, rotary_neox_ref
from tests.kernels.test_fused_decode import assert_fused_path_matches, quantized_models

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _int8_weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [n, k], float32 row scales) from rows of unequal size."""
    w = torch.randn(n, k, device=device) / k ** 0.5 * (1 + torch.rand(n, 1, device=device) * 4)
    return quantize_int8_per_row(w)


def _epilogue_ref(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias, residual, silu: bool,
                  dtype: torch.dtype) -> torch.Tensor:
    """The kernels' epilogue in torch, in their order: float(int sums) * x_scale * w_scale (+ bias),
    then SiLU(gate) * up on the gate and up rounded to dtype, then the residual add on the product
    rounded to dtype."""
    y = acc.float() * x_scale.float().reshape(-1, 1) * w_scale[None, :]
    if bias is not None:
        y = y + bias.float()
    if silu:
        half = y.shape[1] // 2
        gate, up = y[:, :half].to(dtype).float(), y[:, half:].to(dtype).float()
        y = gate / (1.0 + torch.exp(-gate)) * up
    if residual is not None:
        y = y.to(dtype).float() + residual.float()
    return y.to(dtype)


def _dot_case(device, dtype, n, k, *, norm=False, residual=False, bias=False, silu=False, static=False,
              config=None):
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    w, s = _int8_weight(n, k, device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(1, n_out, dtype=dtype, device=device) if residual else None
    in_scale = torch.tensor([0.05], device=device) if static else None  # (|x| up to ~5 before clipping)
    out = w8a8_dot_gemv(x, w, s, b, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res, input_scale=in_scale,
                        config=config)
    assert out.shape == (1, n_out) and out.dtype == dtype and not out.isnan().any()

    xin = rms_norm_ref(x, g, 1e-5) if norm else x  # (rounded to the dtype, as the kernel)
    xq, x_scale = quantize_int8_torch(xin, in_scale)
    acc = xq.double() @ w.double().t()  # exact
    ref = _epilogue_ref(acc, x_scale, s, b, res, silu, dtype)
    if norm or silu:  # the norm's statistic and exp: a few ulps, which may move a code
        assert relative_error(out, ref) < TOLERANCE[dtype] * 10
    else:  # the same codes, exact sums, the same epilogue: the same bits
        assert torch.equal(out, ref)
    # Against the unquantized input: a bound for gross errors only.
    unquantized = xin.double() @ (w.double() * s.double()[:, None]).t()
    ones = torch.ones(n, device=device)
    assert relative_error(out, _epilogue_ref(unquantized, ones[:1], ones, b, res, silu, dtype)) < 0.1


SPLITS = [DotGemvConfig(16, 128, 1, 4), DotGemvConfig(16, 128, 4, 4), DotGemvConfig(32, 64, 3, 4, 2)]


@pytest.mark.parametrize("config", SPLITS, ids=["whole-k", "split4", "split3-uneven"])
def test_int8_dot_plain_and_split(kernel_device, seed, config):
    _dot_case(kernel_device, torch.float32, 48, 544, config=config)  # 544: the last K range is short
    _dot_case(kernel_device, torch.bfloat16, 32, 256, bias=True, residual=True, static=True, config=config)
    assert not _COUNTERS.get(kernel_device, 4).any()  # every launch leaves its counters at zero


@pytest.mark.parametrize("config", SPLITS[:2], ids=["whole-k", "split4"])
def test_int8_dot_fused_prologue_and_epilogues(kernel_device, seed, config):
    _dot_case(kernel_device, torch.float32, 64, 512, norm=True, silu=True, bias=True, config=config)
    _dot_case(kernel_device, torch.float32, 40, 512, norm=True, residual=True, config=config)


def test_int8_dot_equals_the_batched_path(kernel_device, seed):
    """One token through w8a8_dot_gemv and through the row quantizer + int8 GEMM (the path of two
    or more rows): bit-equal, per token and static, split or not."""
    k, n = 384, 48
    w, s = _int8_weight(n, k, kernel_device)
    b = torch.randn(n, device=kernel_device)
    x = torch.randn(1, k, device=kernel_device) * 3
    for static in (None, torch.tensor([0.03], device=kernel_device)):
        batched = int8_gemm(*quantize_int8_triton(x, static), w, s, b, torch.float32)
        for cfg in SPLITS[:2]:
            assert torch.equal(w8a8_dot_gemv(x, w, s, b, input_scale=static, config=cfg), batched)


def test_int8_dot_bad_input(kernel_device):
    w = torch.zeros(8, 64, dtype=torch.int8, device=kernel_device)
    with pytest.raises(ValueError, match="per-row weight_scale"):
        w8a8_dot_gemv(torch.zeros(1, 64, device=kernel_device), w, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float8_e4m3fn or int8"):
        w8a8_dot_gemv(torch.zeros(1, 64, device=kernel_device), w.to(torch.int16), torch.ones(8, device=kernel_device))


def _qkv_case(device, dtype, *, hq, hkv, d, k, bias, slot, static=False, block_size=4, num_blocks=5):
    heads = hq + 2 * hkv
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w, s = _int8_weight(heads * d, k, device)
    b = torch.randn(heads * d, device=device).to(dtype) if bias else None
    in_scale = torch.tensor([0.02], device=device) if static else None
    cos_sin = neox_cos_sin_cache(d, 64, 10000.0, device=device)
    pos = torch.randint(0, 64, (1,), device=device)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    q = qkv_rope_gemv(x, w, b, norm_weight=g, eps=1e-6, rope_row=cos_sin[pos[0]],
                      slot_mapping=torch.tensor([slot], dtype=torch.int64, device=device), kv_cache=cache,
                      num_q_heads=hq, num_kv_heads=hkv, head_dim=d, weight_scale=s, w8a8=True, input_scale=in_scale)
    xq, x_scale = quantize_int8_torch(rms_norm_ref(x, g, 1e-6), in_scale)
    qkv = _epilogue_ref(xq.double() @ w.double().t(), x_scale, s, b, None, False, dtype).view(1, heads, d)
    tol = TOLERANCE[dtype] * 10  # (the rotation's products; the norm's statistic may move a code)
    assert relative_error(q, rotary_neox_ref(pos, qkv[:, :hq], cos_sin)) < tol
    blk, off = divmod(slot, block_size)
    assert relative_error(cache[0, blk, off], rotary_neox_ref(pos, qkv[:, hq:hq + hkv], cos_sin)[0]) < tol
    assert relative_error(cache[1, blk, off], qkv[0, hq + hkv:]) < tol


def test_int8_qkv_rope_tiny(kernel_device, seed):
    _qkv_case(kernel_device, torch.float32, hq=4, hkv=2, d=16, k=48, bias=False, slot=13)
    _qkv_case(kernel_device, torch.float32, hq=3, hkv=1, d=24, k=40, bias=True, slot=0, static=True)


@pytest.mark.parametrize("activations", ["dynamic-token", "static"])
def test_fused_one_token_path_runs_int8_layers(kernel_device, monkeypatch, activations):
    """A tiny Llama with int8 W8A8 layers (dummy weights): the Triton set takes the fused one-token
    path (int8 weights in the layers' `weight`), the torch set the general one; same logits."""
    ref, fused = quantized_models(kernel_device, CompressedTensorsInt8Config(activations))
    qkv = fused.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.dtype == torch.float32
    assert_fused_path_matches(ref, fused, kernel_device, monkeypatch)


# ---- GPU, real shapes ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_int8_one_token_llama8b_shapes(cuda_device, seed):
    dtype = torch.bfloat16
    _dot_case(cuda_device, dtype, 4096, 4096, residual=True)  # o_proj
    _dot_case(cuda_device, dtype, 2 * 14336, 4096, norm=True, silu=True)  # gate_up
    _dot_case(cuda_device, dtype, 4096, 14336, residual=True)  # down
    _qkv_case(cuda_device, dtype, hq=32, hkv=8, d=128, k=4096, bias=False, slot=12345, block_size=16,
              num_blocks=1024)


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["dynamic-token", "dynamic-tensor", "static"])
def test_int8_linear_one_row_equals_its_batch_row(cuda_device, seed, activations):
    """The runner's one-row product (the tensor-core split-K kernel) gives the bits of the same row
    in a batch (row quantizer + int8 GEMM): a token decodes alike alone or batched (per-tensor
    dynamic scales excepted, which depend on the batch)."""
    n, k = 4096, 14336
    w, s = _int8_weight(n, k, cuda_device)
    static = torch.tensor([0.01], device=cuda_device) if activations == "static" else None
    layer = Int8Linear(w, s, activations=activations, input_scale=static)
    bias = torch.randn(n, device=cuda_device, dtype=torch.bfloat16)
    x = torch.randn(2, k, device=cuda_device, dtype=torch.bfloat16)
    if activations == "dynamic-tensor":
        x[1] = x[0]  # the tensor's absmax is the token's
    assert torch.equal(layer(x[:1], bias), layer(x, bias)[:1])
