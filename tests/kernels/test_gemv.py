"""Fused one-token matrix-vector kernels (kernels/gemv.py) against plain torch: residual add,
RMSNorm, bias, SiLU-and-mul, the qkv variant's rotary + KV-cache write, and (kernels/qk_norm_rope.py) Qwen3's
per-head q/k norms before that rotary and write."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.gemv import GemvConfig, gemv, qkv_rope_gemv
from ferrox.kernels.qk_norm_rope import qk_norm_rope_cache
from ferrox.kernels.rotary import neox_cos_sin_cache

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, rotary_neox_ref, silu_and_mul_ref

TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _linear_ref(x, weight, bias):
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


def _gemv_case(device, dtype, n, k, *, norm, residual, bias, silu, config=None):
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(1, n_out, dtype=dtype, device=device) if residual else None
    out = gemv(x, w, b, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res, config=config)

    ref = _linear_ref(rms_norm_ref(x, g, 1e-5) if norm else x, w, b)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res  # the projection rounded, then the add (as the unfused ops do)
    assert out.shape == (1, n_out) and out.dtype == dtype
    assert not out.isnan().any()
    assert relative_error(out, ref.to(dtype)) < TOLERANCE[dtype]


def _qkv_case(device, dtype, *, hq, hkv, d, k, bias, slot, block_size=4, num_blocks=5, config=None):
    heads = hq + 2 * hkv
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w = (torch.randn(heads * d, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(heads * d, device=device).to(dtype) if bias else None
    cos_sin = neox_cos_sin_cache(d, 64, 10000.0, device=device)
    pos = torch.randint(0, 64, (1,), device=device)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    slots = torch.tensor([slot], dtype=torch.int64, device=device)

    q = qkv_rope_gemv(x, w, b, norm_weight=g, eps=1e-6, rope_row=cos_sin[pos[0]], slot_mapping=slots,
                      kv_cache=cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, config=config)
    qkv = _linear_ref(rms_norm_ref(x, g, 1e-6), w, b).to(dtype).view(1, heads, d)
    ref_q = rotary_neox_ref(pos, qkv[:, :hq], cos_sin)
    ref_k = rotary_neox_ref(pos, qkv[:, hq:hq + hkv], cos_sin)
    assert q.shape == (1, hq, d)
    assert relative_error(q, ref_q) < TOLERANCE[dtype]
    written = _written_slot(cache, slot, block_size, hkv * d)
    if written is not None:
        assert relative_error(written[0], ref_k[0]) < TOLERANCE[dtype]
        assert relative_error(written[1], qkv[0, hq + hkv:]) < TOLERANCE[dtype]


def _written_slot(cache: torch.Tensor, slot: int, block_size: int, per_plane: int) -> torch.Tensor | None:
    """The (k, v) rows a one-token kernel wrote into a NaN-filled cache at `slot`, after checking
    that it wrote that slot and nothing else (None for padding, slot -1, which writes nothing)."""
    written = ~cache.isnan()
    if slot < 0:
        assert not written.any()
        return None
    blk, off = divmod(slot, block_size)
    assert written[:, blk, off].all() and written.sum() == 2 * per_plane
    return cache[:, blk, off]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gemv_variants_tiny(kernel_device, seed, dtype):
    # K not a multiple of the K tile, N not a multiple of the row block.
    cfg = GemvConfig(block_n=4, block_k=32, num_warps=4)
    _gemv_case(kernel_device, dtype, 37, 100, norm=False, residual=False, bias=False, silu=False, config=cfg)
    _gemv_case(kernel_device, dtype, 37, 100, norm=True, residual=True, bias=True, silu=False, config=cfg)
    _gemv_case(kernel_device, dtype, 2 * 21, 64, norm=True, residual=False, bias=False, silu=True, config=cfg)
    _gemv_case(kernel_device, dtype, 2 * 21, 64, norm=False, residual=True, bias=True, silu=True, config=cfg)
    _gemv_case(kernel_device, dtype, 2 * 21, 64, norm=True, residual=False, bias=True, silu=True)
    _gemv_case(kernel_device, dtype, 48, 96, norm=False, residual=True, bias=False, silu=False)
    _gemv_case(kernel_device, dtype, 5, 40, norm=True, residual=False, bias=False, silu=False,
               config=GemvConfig(block_n=1, block_k=16, num_warps=4))  # one row per program


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qkv_rope_gemv_tiny(kernel_device, seed, dtype):
    _qkv_case(kernel_device, dtype, hq=4, hkv=2, d=16, k=48, bias=False, slot=13)
    _qkv_case(kernel_device, dtype, hq=3, hkv=1, d=24, k=40, bias=True, slot=0)  # half=12
    _qkv_case(kernel_device, dtype, hq=2, hkv=2, d=8, k=32, bias=False, slot=-1,
              config=GemvConfig(block_n=2, block_k=16, num_warps=4))  # one pair per program


def test_gemv_rejects_bad_shapes(kernel_device):
    w = torch.randn(8, 16, device=kernel_device)
    with pytest.raises(ValueError, match="x must be a contiguous"):
        gemv(torch.randn(2, 16, device=kernel_device), w)
    with pytest.raises(ValueError, match="even number of rows"):
        gemv(torch.randn(1, 16, device=kernel_device), torch.randn(7, 16, device=kernel_device), silu_mul=True)
    with pytest.raises(ValueError, match="qkv weight has"):
        qkv_rope_gemv(torch.randn(1, 16, device=kernel_device), w, None, norm_weight=None, eps=1e-6,
                      rope_row=torch.zeros(4, device=kernel_device), slot_mapping=torch.zeros(1, dtype=torch.int64),
                      kv_cache=torch.zeros(2, 1, 1, 1, 4, device=kernel_device), num_q_heads=2, num_kv_heads=1,
                      head_dim=4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemv_llama8b_shapes(cuda_device, seed, dtype):
    _gemv_case(cuda_device, dtype, 4096, 4096, norm=False, residual=False, bias=False, silu=False)  # o_proj
    _gemv_case(cuda_device, dtype, 2 * 14336, 4096, norm=True, residual=False, bias=False, silu=True)  # gate_up
    _gemv_case(cuda_device, dtype, 4096, 14336, norm=False, residual=False, bias=False, silu=False)  # down
    _gemv_case(cuda_device, dtype, 128256, 4096, norm=False, residual=False, bias=False, silu=False)  # lm_head
    _gemv_case(cuda_device, dtype, 4096, 14336, norm=False, residual=True, bias=False, silu=False)  # down + res
    _qkv_case(cuda_device, dtype, hq=32, hkv=8, d=128, k=4096, bias=False, slot=12345,
              block_size=16, num_blocks=1024)
    _qkv_case(cuda_device, dtype, hq=28, hkv=4, d=128, k=3584, bias=True, slot=77,
              block_size=16, num_blocks=8)  # Qwen2-7B: bias, K not a power of two


def _qk_norm_case(device, dtype, *, hq, hkv, d, slot, block_size=4, num_blocks=5, cache_dtype=None, kv_scale=None):
    """qkv -> per-head q/k RMSNorm -> rotary -> KV write. Returns (q, cache, reference q/k/v)."""
    heads = hq + 2 * hkv
    qkv = (3 * torch.randn(1, heads * d, device=device)).to(dtype)  # not unit RMS: the norm matters
    gq = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
    gk = (1 + 0.1 * torch.randn(d, device=device)).to(dtype)
    cos_sin = neox_cos_sin_cache(d, 64, 10000.0, device=device)
    pos = torch.randint(0, 64, (1,), device=device)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=cache_dtype or dtype, device=device)
    slots = torch.tensor([slot], dtype=torch.int64, device=device)
    q = qk_norm_rope_cache(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=1e-6, rope_row=cos_sin[pos[0]],
                           slot_mapping=slots, kv_cache=cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                           kv_scale=kv_scale)
    heads_view = qkv.view(heads, d)
    ref_q = rotary_neox_ref(pos, rms_norm_ref(heads_view[:hq], gq, 1e-6)[None], cos_sin)
    ref_k = rotary_neox_ref(pos, rms_norm_ref(heads_view[hq:hq + hkv], gk, 1e-6)[None], cos_sin)
    return q, cache, ref_q, ref_k[0], heads_view[hq + hkv:]


@pytest.mark.parametrize("slot", [13, -1], ids=["slot", "padding"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_qk_norm_rope_cache_tiny(kernel_device, seed, dtype, slot):
    hq, hkv, d, block_size = 4, 2, 16, 4
    q, cache, ref_q, ref_k, ref_v = _qk_norm_case(kernel_device, dtype, hq=hq, hkv=hkv, d=d, slot=slot,
                                                  block_size=block_size)
    assert q.shape == (1, hq, d) and q.dtype == dtype
    assert relative_error(q, ref_q) < TOLERANCE[dtype]
    written = _written_slot(cache, slot, block_size, hkv * d)
    if written is not None:
        assert relative_error(written[0], ref_k) < TOLERANCE[dtype]
        assert torch.equal(written[1], ref_v)  # v unchanged


def test_qk_norm_rope_cache_fp8(kernel_device, seed):
    """An FP8 cache stores quantize(what a float32 cache stores), k and v with their own scales
    (small ones: some values saturate); q does not depend on the cache."""
    hq, hkv, d, slot, block_size = 4, 2, 16, 6, 4
    torch.manual_seed(seed)
    q32, cache32, ref_q, ref_k, ref_v = _qk_norm_case(kernel_device, torch.float32, hq=hq, hkv=hkv, d=d, slot=slot)
    scales = torch.tensor([0.002, 0.02], device=kernel_device)
    torch.manual_seed(seed)
    q8, cache8, *_ = _qk_norm_case(kernel_device, torch.float32, hq=hq, hkv=hkv, d=d, slot=slot,
                                   cache_dtype=torch.float8_e4m3fn, kv_scale=scales)
    assert torch.equal(q8, q32)
    blk, off = divmod(slot, block_size)
    got = cache8[:, blk, off]
    want = torch.stack([(cache32[i, blk, off] / scales[i]).clamp(-448, 448) for i in range(2)])
    assert torch.equal(got.view(torch.uint8), want.to(torch.float8_e4m3fn).view(torch.uint8))
    assert (got.float().abs() == 448).any(), "the test meant some values to saturate"
    dequant = got.float() * scales[:, None, None]
    unsaturated = got.float().abs() < 448
    for i, ref in enumerate((ref_k, ref_v)):
        assert relative_error(dequant[i][unsaturated[i]], ref[unsaturated[i]]) < 0.07
    assert cache8.float().isnan().sum() == cache8.numel() - 2 * hkv * d  # nothing else written


def test_qk_norm_rope_cache_rejects_bad_shapes(kernel_device):
    hq, hkv, d = 2, 1, 8
    args = dict(q_norm_weight=torch.ones(d, device=kernel_device), k_norm_weight=torch.ones(d, device=kernel_device),
                eps=1e-6, rope_row=torch.zeros(d, device=kernel_device),
                slot_mapping=torch.zeros(1, dtype=torch.int64, device=kernel_device),
                kv_cache=torch.zeros(2, 1, 1, hkv, d, device=kernel_device), num_q_heads=hq, num_kv_heads=hkv,
                head_dim=d)
    with pytest.raises(ValueError, match=r"qkv must be a contiguous \[1, 32\]"):
        qk_norm_rope_cache(torch.zeros(1, 31, device=kernel_device), **args)
    with pytest.raises(ValueError, match=r"k_norm_weight must be a contiguous float \[8\]"):
        qk_norm_rope_cache(torch.zeros(1, 32, device=kernel_device), **(args | {"k_norm_weight": torch.ones(4)}))
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        qk_norm_rope_cache(torch.zeros(1, 48, device=kernel_device), **(args | {"head_dim": 12}))
