"""The tensor-core int4 decode product for 1-16 tokens (cuda/int4_gemv.cu via kernels/int4_gemv_cuda.py).

CPU: the stream puts every code where PTX's mma.m16n8k16 fragment layout and the MMA column order want
it, with each group's scales and zero points, and NVRTC compiles the module for sm_90 (no GPU needed: a
broken .cu fails here, not on the device). GPU: every launch config against x @ W.T with W dequantized
in float64, at shapes that stress the edges (rows not a multiple of 16, one group, groups of 64 / 128 /
256 / 1024, warps ending inside a group, a ragged split of K over the warps, 1-16 tokens, fp16 and bf16
scales, bias), the one-token fusions against the Triton GEMV's, Llama-3.1-8B shapes through int4_linear,
and int4 layers carrying the stream.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels import int4_gemv_cuda as cu
from ferrox.kernels import int4_matmul as km
from ferrox.kernels import nvrtc
from ferrox.layers.quant.int4_pack import Int4Shard, build_int4_linear

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_int4_matmul import TOLERANCE, _ref, _weight


def test_layout_places_each_code_at_its_fragment():
    """Unpack pack_mma's stream by the fragment rule and the MMA column order (the .cu header): every
    code comes back at its (row, k), and each group's metadata holds its rows' scale bits and zero."""
    n, k, group = 40, 384, 128  # rows padded to 48; 3 groups of 2 k tiles
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    scales = (0.01 + torch.rand(n, k // group, generator=gen)).half()
    zeros = torch.randint(0, 17, (n, k // group), dtype=torch.uint8, generator=gen)
    stream = cu.pack_mma(codes, scales, zeros, group).to(torch.int64) & 0xFFFFFFFF
    tiles, groups, tpg = 3, k // group, group // 64
    assert stream.shape == (tiles, groups, tpg * 128 + 16)
    words = stream[:, :, :tpg * 128].reshape(tiles, k // 64, 32, 4)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    column_k = cu.mma_column_k()
    assert sorted(column_k.flatten().tolist()) == list(range(64))
    # lane t's B fragments of a tile are its 16 consecutive activations: b0 of step s = k 16t + 4s + (0, 1)
    assert torch.equal(column_k[:, 2 * t].T, 16 * t[:, None] + 4 * torch.arange(4)[None, :])
    rebuilt = torch.full((48, k), -1, dtype=torch.int64)
    for step in range(k // 16):
        word = words[:, step // 4, :, step % 4]  # [tiles, lanes]
        for j, (dr, dc) in enumerate(cu._NIBBLE_AT):
            rows = torch.arange(tiles)[:, None] * 16 + (g + dr)[None, :]
            cols = 64 * (step // 4) + column_k[step % 4, 2 * t + dc]
            rebuilt[rows, cols[None, :].expand(tiles, 32)] = (word >> (4 * j)) & 0xF
    assert torch.equal(rebuilt[:n], codes.to(torch.int64))
    assert (rebuilt[n:] == 0).all()
    meta = stream[:, :, tpg * 128:].reshape(tiles, groups, 8, 2)  # [g][rows g, g + 8]
    rows = (torch.arange(tiles)[:, None, None] * 16 + torch.arange(8)[None, :, None]
            + 8 * torch.arange(2)[None, None, :])  # [tiles, g, h]
    for j in range(groups):
        m = meta[:, j]
        ok = rows < n
        assert torch.equal((m & 0xFF)[ok], zeros[rows[ok], j].to(torch.int64))
        assert torch.equal(m[ok] >> 16, scales[rows[ok], j].view(torch.int16).to(torch.int64) & 0xFFFF)
        assert (m[~ok] == 0).all()
    with pytest.raises(ValueError, match="divisible by 64"):
        cu.pack_mma(torch.zeros(16, 96, dtype=torch.uint8), scales[:16, :1], zeros[:16, :1], 96)
    with pytest.raises(ValueError, match="16-bit scales"):
        cu.pack_mma(codes, scales.float(), zeros, group)
    with pytest.raises(ValueError, match="zero points above 16"):
        cu.pack_mma(codes, scales, zeros + 17, group)


def test_layout_support():
    assert cu.layout_supported(4096, 4096, 128) and cu.layout_supported(4096, 14336, 64)
    assert cu.layout_supported(16, 320 * 2, 640)  # one group
    assert not cu.layout_supported(16, 256, 32)  # a group's metadata follows whole k tiles
    assert not cu.layout_supported(16, 96, 32)  # K not a multiple of 64
    assert not cu.layout_supported(16, 384, 96)
    assert not cu.layout_supported(16, 192, 128)  # a short last group


@pytest.mark.skipif(nvrtc.bindings() is None, reason="cuda-bindings (NVRTC) not installed")
def test_module_compiles_for_hopper(tmp_path, monkeypatch):
    """The whole module (every config, one and two token-column tiles) through NVRTC for sm_90, from an
    empty cache; each entry point is in the cubin, and a second build comes from the disk cache."""
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    source = cu.module_source("Bf16", "F16", cu._base_source())
    cubin = nvrtc.compile_cubin(source, "sm_90", (), "int4_gemv.cu")
    for column_tiles in (1, 2):
        for cfg in cu.CONFIGS:
            assert cu.kernel_name("Bf16", "F16", column_tiles, cfg).encode() in cubin
    for fuse in cu.FUSIONS:
        for cfg in cu.CONFIGS:
            assert cu.kernel_name("Bf16", "F16", 1, cfg, fuse).encode() in cubin
    assert len(list((tmp_path / "nvrtc").glob("*.cubin"))) == 1
    assert nvrtc.compile_cubin(source, "sm_90", (), "int4_gemv.cu") == cubin
    with pytest.raises(nvrtc.NvrtcError, match="could not compile"):
        nvrtc.compile_cubin("this is not CUDA", "sm_90", (), "broken.cu")


# ---- GPU ------------------------------------------------------------------------------------------
def _needs_kernel():
    if not cu.enabled():
        pytest.skip("the tensor-core int4 kernel cannot be built here (cuda-bindings, sources or the switch)")


def _case(device, dtype, n, k, group, m, *, bias, config, scale_dtype=torch.float16):
    w, ref_w = _weight(n, k, group, device, mma=True, scale_dtype=scale_dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    if m == 1:  # also through a row of a larger batch (strided, 16-byte aligned)
        x = torch.randn(3, k, device=device).to(dtype)[1:2]
    b = torch.randn(n, device=device).to(dtype) if bias else None
    assert cu.supported(x, w.mma, w.scales, b) or m < cu.MIN_TOKENS
    out = cu.int4_mma_product(x, w, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, _ref(x, ref_w, b)) < TOLERANCE[dtype], (n, k, group, m, bias, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_config_at_the_edges(cuda_device, seed, dtype):
    _needs_kernel()
    for config in cu.CONFIGS:
        _case(cuda_device, dtype, 40, 192, 64, 5, bias=True, config=config)  # rows padded to 48
        _case(cuda_device, dtype, 40, 256, 128, 1, bias=True, config=config)
        _case(cuda_device, dtype, 40, 256, 128, 2, bias=True, config=config)
        _case(cuda_device, dtype, 64, 512, 64, 8, bias=False, config=config)
        _case(cuda_device, dtype, 72, 640, -1, 9, bias=False, config=config, scale_dtype=torch.bfloat16)  # one group
        _case(cuda_device, dtype, 96, 2048, 256, 16, bias=True, config=config, scale_dtype=torch.bfloat16)
        _case(cuda_device, dtype, 16, 4160, 64, 12, bias=False, config=config)  # 65 k tiles over the warps
        _case(cuda_device, dtype, 48, 3 * 1024, 1024, 3, bias=False, config=config)  # warps end inside groups


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_llama_8b_shapes_through_int4_linear(cuda_device, seed, dtype, monkeypatch):
    """int4_linear hands 1-16 token products to the kernel (counted: a silent fallback fails) and keeps
    17 on the Triton kernels."""
    _needs_kernel()
    calls: list[int] = []
    original = cu.int4_mma_product
    monkeypatch.setattr(cu, "int4_mma_product", lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw))
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        w, ref_w = _weight(n, k, 128, cuda_device, mma=True)
        for m in (1, 2, 5, 8, 16, 17):
            x = torch.randn(m, k, device=cuda_device).to(dtype)
            assert relative_error(km.int4_linear(x, w), _ref(x, ref_w, None)) < TOLERANCE[dtype], (n, k, m)
    assert calls == [1, 2, 5, 8, 16] * 4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_one_token_fusions_match_the_triton_gemv(cuda_device, seed, dtype, monkeypatch):
    """int4_gemv's fused one-token products (norm; residual; norm + silu(gate) * up) take the kernel when
    the weight carries its stream, and agree with the Triton GEMV's fusions (config given: Triton) and
    with the unfused float64 reference."""
    _needs_kernel()
    calls: list[int] = []
    original = cu.int4_mma_product
    monkeypatch.setattr(cu, "int4_mma_product", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    k = 1024
    x = torch.randn(1, k, device=cuda_device).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=cuda_device)).to(dtype)
    normed = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.double())
    triton_cfg = km.choose_gemv_config(96, k)
    for group in (128, -1):
        w, ref_w = _weight(96, k, group, cuda_device, mma=True)
        b = torch.randn(96, device=cuda_device).to(dtype)
        # norm (qkv)
        y = km.int4_gemv(x, w, b, norm_weight=nw)
        ref = _ref(normed, ref_w, b)
        assert relative_error(y, ref) < TOLERANCE[dtype]
        assert relative_error(y, km.int4_gemv(x, w, b, triton_cfg, norm_weight=nw)) < TOLERANCE[dtype]
        # residual (o_proj, down)
        res = torch.randn(1, 96, device=cuda_device).to(dtype)
        y = km.int4_gemv(x, w, b, residual=res)
        assert relative_error(y, _ref(x, ref_w, b) + res.double()) < TOLERANCE[dtype]
        # norm + silu(gate) * up (gate_up: rows [gate | up], 48 each: three 16-row tiles of each)
        y = km.int4_gemv(x, w, b, norm_weight=nw, silu_mul=True)
        full = _ref(normed, ref_w, b)
        gate, up = full[:, :48], full[:, 48:]
        assert y.shape == (1, 48)
        assert relative_error(y, gate * torch.sigmoid(gate) * up) < 2 * TOLERANCE[dtype]
        tri = km.int4_gemv(x, w, b, triton_cfg, norm_weight=nw, silu_mul=True)
        assert relative_error(y, tri) < 2 * TOLERANCE[dtype]
        for config in cu.CONFIGS:  # every compiled config of each fusion, not only the chosen ones
            y = original(x, w, b, config, norm_weight=nw, silu_mul=True)
            assert relative_error(y, tri) < 2 * TOLERANCE[dtype], config
            y = original(x, w, b, config, norm_weight=nw)
            assert relative_error(y, ref) < TOLERANCE[dtype], config
            y = original(x, w, b, config, residual=res)
            assert relative_error(y, _ref(x, ref_w, b) + res.double()) < TOLERANCE[dtype], config
        assert not cu.supported(x, w.mma, w.scales, b, norm_weight=nw, residual=res)  # not a compiled fusion
    assert len(calls) == 6
    # a row count the gate / up tiling cannot split keeps the Triton kernel
    w, _ = _weight(80, k, 128, cuda_device, mma=True)
    km.int4_gemv(x, w, None, norm_weight=nw, silu_mul=True)
    assert len(calls) == 6


@pytest.mark.gpu
def test_int4_layers_carry_the_layout(cuda_device, seed, monkeypatch):
    """An int4 layer built on the GPU packs the stream, and its 1-16 token products take the kernel and
    match the Triton GEMM on the same weights; FERROX_INT4_MMA=0 packs nothing."""
    _needs_kernel()
    gen = torch.Generator().manual_seed(0)
    shard = Int4Shard(torch.randint(0, 16, (96, 256), dtype=torch.uint8, generator=gen).to(cuda_device),
                      (0.01 * torch.rand(2, 96, generator=gen)).half().to(cuda_device),
                      torch.randint(0, 16, (2, 96), dtype=torch.uint8, generator=gen).to(cuda_device))
    layer = build_int4_linear([shard], 128, dtype=torch.bfloat16, what="test")
    assert layer.mma is not None
    calls: list[int] = []
    original = cu.int4_mma_product
    monkeypatch.setattr(cu, "int4_mma_product", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    x = torch.randn(6, 256, device=cuda_device, dtype=torch.bfloat16)
    y = layer(x)
    assert calls == [1]
    assert relative_error(y, km.int4_gemm(x, layer.weights())) < TOLERANCE[torch.bfloat16]
    monkeypatch.setenv("FERROX_INT4_MMA", "0")
    assert build_int4_linear([shard], 128, dtype=torch.bfloat16, what="test").mma is None
