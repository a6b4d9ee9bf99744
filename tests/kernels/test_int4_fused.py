"""The int4 GEMV's fused one-token variants (kernels/int4_matmul.py: RMSNorm prologue, bias,
SiLU-and-mul, residual) against torch on the dequantized weight; the rotary + KV write without
norms that follows an int4 qkv projection (kernels/qk_norm_rope.py); and tiny models whose
projections are int4 runners through the fused one-token path (attention/fused_decode.py) against
the torch models on the dequantized weights. Tiny shapes on CPU under the Triton interpreter
(test_interpreter.py); Llama-3.1-8B shapes on a GPU, where tests/models/test_int4_checkpoints.py
also runs the engine on AWQ / GPTQ checkpoints against FERROX_FUSED_DECODE=0."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.fused_decode import FusedOneTokenDecode
from ferrox.kernels import int4_matmul as km
from ferrox.kernels.qk_norm_rope import qk_norm_rope_cache
from ferrox.kernels.rotary import neox_cos_sin_cache
from ferrox.layers.linear import Linear
from ferrox.layers.quant.int4_pack import Int4Linear, dequantize_codes

from tests.kernels import test_fused_decode
from tests.kernels.kernel_refs import relative_error, rms_norm_ref, rotary_neox_ref, silu_and_mul_ref
from tests.kernels.test_fused_decode import _count_calls, _models, _run
from tests.kernels.test_gemv import _written_slot
from tests.kernels.test_int4_matmul import TOLERANCE, _ref, _weight


def _fused_case(device, dtype, n, k, group, *, m=1, norm, bias, silu, residual, config=None, mma=False):
    w, ref_w = _weight(n, k, group, device, mma=mma)
    x = torch.randn(m, k, device=device).to(dtype)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(m, n_out, device=device).to(dtype) if residual else None
    out = km.int4_gemv(x, w, b, config, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res)

    ref = _ref(rms_norm_ref(x, g, 1e-5) if norm else x, ref_w, b)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res  # the projection rounded, then the add (as the unfused ops do)
    assert out.shape == (m, n_out) and out.dtype == dtype
    assert relative_error(out, ref.to(dtype)) < TOLERANCE[dtype], (n, k, group, m, norm, bias, silu, residual)


def test_fused_int4_gemv_tiny(kernel_device, seed):
    fp32, fp16 = torch.float32, torch.float16
    _fused_case(kernel_device, fp32, 24, 256, 32, norm=True, bias=True, silu=False, residual=True)
    _fused_case(kernel_device, fp16, 24, 256, 32, norm=True, bias=True, silu=False, residual=True)
    _fused_case(kernel_device, fp32, 2 * 12, 512, 128, norm=True, bias=False, silu=True, residual=False)
    # Gate rows not a multiple of the row block; one group per row.
    _fused_case(kernel_device, fp16, 2 * 10, 320, -1, norm=False, bias=True, silu=True, residual=True)
    _fused_case(kernel_device, fp32, 2 * 8, 256, 64, norm=True, bias=True, silu=True, residual=True,
                config=km.GemvConfig(block_n=2, num_warps=1))
    _fused_case(kernel_device, fp16, 2 * 8, 256, 64, norm=True, bias=False, silu=True, residual=True)
    _fused_case(kernel_device, fp16, 16, 96, 64, norm=True, bias=False, silu=False, residual=False)  # short group
    _fused_case(kernel_device, fp32, 8, 2560, 128, norm=True, bias=False, silu=False, residual=True,
                config=km.GemvConfig(block_n=8, num_warps=2))  # a K tile of 2048 and a tail: the norm spans both
    _fused_case(kernel_device, fp32, 16, 192, 64, m=2, norm=True, bias=False, silu=False, residual=True)


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [False, True], ids=["triton", "tensor-cores"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_int4_gemv_llama8b_shapes(cuda_device, seed, dtype, mma):
    """mma: the weights carry the tensor-core stream, so int4_gemv runs kernels/int4_gemv_cuda.py's kernel."""
    kw = dict(mma=mma)
    _fused_case(cuda_device, dtype, 6144, 4096, 128, norm=True, bias=False, silu=False, residual=False, **kw)  # qkv
    _fused_case(cuda_device, dtype, 4096, 4096, 128, norm=False, bias=False, silu=False, residual=True, **kw)  # o
    _fused_case(cuda_device, dtype, 28672, 4096, 128, norm=True, bias=False, silu=True, residual=False, **kw)  # gate_up
    _fused_case(cuda_device, dtype, 4096, 14336, 128, norm=False, bias=False, silu=False, residual=True, **kw)  # down
    _fused_case(cuda_device, dtype, 4608, 3584, 128, norm=True, bias=True, silu=False, residual=False, **kw)  # Qwen2


def test_fused_int4_gemv_rejects_bad_shapes(kernel_device):
    w, _ = _weight(16, 64, 32, kernel_device)
    x = torch.randn(1, 64, device=kernel_device)
    with pytest.raises(ValueError, match="norm weight"):
        km.int4_gemv(x, w, norm_weight=torch.ones(32, device=kernel_device))
    with pytest.raises(ValueError, match="residual"):
        km.int4_gemv(x, w, silu_mul=True, residual=torch.zeros(1, 16, device=kernel_device))
    w, _ = _weight(8, 64, 32, kernel_device)
    with pytest.raises(ValueError, match="even number of rows"):
        km.int4_gemv(x, km.Int4Weights(w.packed[:7], w.scales[:7], w.zeros[:7], 32, w.interleave), silu_mul=True)


@pytest.mark.parametrize("d,slot", [(16, 13), (24, 0), (8, -1)], ids=["d16", "d24-not-pow2", "padding"])
def test_rope_cache_without_norms(kernel_device, seed, d, slot):
    """The qkv row of an int4 layer: q and k rotated, k and v written, as qkv_rope_gemv would."""
    hq, hkv, block_size, dtype = 4, 2, 4, torch.float16
    heads = hq + 2 * hkv
    qkv = torch.randn(1, heads * d, device=kernel_device).to(dtype)
    cos_sin = neox_cos_sin_cache(d, 64, 10000.0, device=kernel_device)
    pos = torch.randint(0, 64, (1,), device=kernel_device)
    cache = torch.full((2, 5, block_size, hkv, d), float("nan"), dtype=dtype, device=kernel_device)
    q = qk_norm_rope_cache(qkv, q_norm_weight=None, k_norm_weight=None, eps=0.0, rope_row=cos_sin[pos[0]],
                           slot_mapping=torch.tensor([slot], device=kernel_device), kv_cache=cache,
                           num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    view = qkv.view(1, heads, d)
    assert relative_error(q, rotary_neox_ref(pos, view[:, :hq], cos_sin)) < TOLERANCE[dtype]
    written = _written_slot(cache, slot, block_size, hkv * d)
    if written is not None:
        assert relative_error(written[0], rotary_neox_ref(pos, view[:, hq:hq + hkv], cos_sin)[0]) < TOLERANCE[dtype]
        assert torch.equal(written[1], view[0, hq + hkv:])  # v unchanged
    args = dict(eps=0.0, rope_row=cos_sin[pos[0]], slot_mapping=torch.tensor([slot], device=kernel_device),
                kv_cache=cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    with pytest.raises(ValueError, match="both q and k norm weights, or neither"):
        qk_norm_rope_cache(qkv, q_norm_weight=torch.ones(d, dtype=dtype, device=kernel_device),
                           k_norm_weight=None, **args)


# ---- tiny models on int4 runners -----------------------------------------------------------------------
GROUP = 32


def _int4_models(arch: str, device: torch.device):
    """test_fused_decode's model pair (one small layer, every input width a multiple of 32), each decoder
    projection then replaced: the Triton model's by an int4 runner on the kernels (random codes,
    zero points 6..10, scales ~0.045: weights of std ~0.2, as the float models'), the torch
    reference's by the same weight dequantized."""
    ref, fused = _models(arch, device, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1)
    gen = torch.Generator().manual_seed(7)
    ref_modules = dict(ref.named_modules())
    for name, linear in ((n, m) for n, m in fused.named_modules() if isinstance(m, Linear)):
        n, k = linear.out_features, linear.in_features
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        scales = (0.03 + 0.03 * torch.rand(k // GROUP, n, generator=gen)).to(torch.float16)
        zeros = torch.randint(6, 11, (k // GROUP, n), generator=gen, dtype=torch.uint8)
        linear.quant = Int4Linear(codes.to(device), scales.to(device), zeros.to(device), GROUP, None,
                                  dtype=torch.float32, kernels=True)
        linear.weight.data = torch.empty(0, device=device)
        ref_modules[name].weight.data = dequantize_codes(codes, scales, zeros, GROUP).to(device)
    return ref, fused


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_int4_layers_take_the_fused_path(kernel_device, monkeypatch, arch):
    """A one-token prefill and a decode step, both on the fused path's int4 GEMVs (Qwen2: q/k/v
    biases; Qwen3: its q/k norms after the int4 qkv), against the torch model on the dequantized
    weights. (Few steps and one layer: the interpreter runs ~0.1 s per program; on a GPU the
    engine test in tests/models/test_int4_checkpoints.py compares with FERROX_FUSED_DECODE=0.)"""
    ref, fused = _int4_models(arch, kernel_device)
    assert isinstance(fused.model.decode_path, FusedOneTokenDecode)
    monkeypatch.setattr(test_fused_decode, "DECODE_TOKENS", [11])
    steps = _count_calls(monkeypatch, "forward")
    got = _run(fused, kernel_device, [7])
    assert len(steps) == 2
    expected = _run(ref, kernel_device, [7])
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_act_order_runners_are_refused(kernel_device):
    """An act-order runner never reaches the fused path (its layer keeps the general one:
    layers/quant/int4_pack.py); if handed one, the path says so instead of ignoring the order."""
    _, fused = _int4_models("LlamaForCausalLM", kernel_device)
    layer = fused.model.layers[0].self_attn.qkv_proj
    n, k = layer.out_features, layer.in_features
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=kernel_device)
    scales = torch.full((k // GROUP, n), 0.01, dtype=torch.float16, device=kernel_device)
    zeros = torch.full((k // GROUP, n), 8, dtype=torch.uint8, device=kernel_device)
    layer.quant = Int4Linear(codes, scales, zeros, GROUP, torch.randperm(k, device=kernel_device),
                             dtype=torch.float32, kernels=True)
    with pytest.raises(ValueError, match="fused one-token kernels cannot read"):
        _run(fused, kernel_device, [7])
