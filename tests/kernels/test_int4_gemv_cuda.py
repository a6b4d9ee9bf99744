"""The tensor-core int4 product for 5-16 tokens (cuda/int4_gemv.cu via kernels/int4_gemv_cuda.py).

CPU: the weight layout puts every code where PTX's mma.m16n8k16 fragment layout wants it, and NVRTC
compiles the module for sm_90 (no GPU needed: a broken .cu fails here, not on the device). GPU: every
launch config against x @ W.T with W dequantized in float64, at shapes that stress the edges (rows not
a multiple of 16, one group, groups of 32 / 64 / 256, a ragged split of K over the warps, 2-16 tokens,
every scale dtype, bias), at Llama-3.1-8B shapes through int4_linear, and int4 layers carrying the layout.
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
    """Unpack pack_mma's words by the fragment rule (the .cu header) and find every code again."""
    n, k = 40, 192  # rows padded to 48
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    words = cu.pack_mma(codes).to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (3, k // 64, 32, 4)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    rebuilt = torch.full((48, k), -1, dtype=torch.int64)
    for step in range(k // 16):
        word = words[:, step // 4, :, step % 4]  # [tiles, lanes]
        for j, (dr, dc) in enumerate(cu._NIBBLE_AT):
            rows = torch.arange(3)[:, None] * 16 + (g + dr)[None, :]
            rebuilt[rows, (16 * step + 2 * t + dc)[None, :].expand(3, 32)] = (word >> (4 * j)) & 0xF
    assert torch.equal(rebuilt[:n], codes.to(torch.int64))
    assert (rebuilt[n:] == 0).all()
    with pytest.raises(ValueError, match="divisible by 64"):
        cu.pack_mma(torch.zeros(16, 96, dtype=torch.uint8))


def test_layout_support():
    assert cu.layout_supported(4096, 4096, 128) and cu.layout_supported(4096, 14336, 64)
    assert cu.layout_supported(16, 256, 32) and cu.layout_supported(16, 320 * 2, 640)  # one group
    assert not cu.layout_supported(16, 256, 16)
    assert not cu.layout_supported(16, 96, 32)  # K not a multiple of 64
    assert not cu.layout_supported(16, 384, 96)  # warps split K by whole groups of 64-multiples
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
    b = torch.randn(n, device=device).to(dtype) if bias else None
    assert cu.supported(x, w.mma, w.scales, b)
    out = cu.int4_mma_product(x, w.mma, w.scales, w.zeros, w.group_size, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    assert relative_error(out, _ref(x, ref_w, b)) < TOLERANCE[dtype], (n, k, group, m, bias, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_config_at_the_edges(cuda_device, seed, dtype):
    _needs_kernel()
    for config in cu.CONFIGS:
        _case(cuda_device, dtype, 40, 192, 64, 5, bias=True, config=config)  # rows padded to 48
        _case(cuda_device, dtype, 40, 256, 128, 2, bias=True, config=config)
        _case(cuda_device, dtype, 64, 512, 32, 8, bias=False, config=config)
        _case(cuda_device, dtype, 72, 640, -1, 9, bias=False, config=config, scale_dtype=torch.bfloat16)  # one group
        _case(cuda_device, dtype, 96, 2048, 256, 16, bias=True, config=config, scale_dtype=torch.float32)
        _case(cuda_device, dtype, 16, 4160, 64, 12, bias=False, config=config)  # 65 k tiles over the warps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_llama_8b_shapes_through_int4_linear(cuda_device, seed, dtype, monkeypatch):
    """int4_linear hands 2-16 token products to the kernel (counted: a silent fallback fails) and keeps
    1 and 17 on the Triton kernels."""
    _needs_kernel()
    calls: list[int] = []
    original = cu.int4_mma_product
    monkeypatch.setattr(cu, "int4_mma_product", lambda *a, **kw: calls.append(a[0].shape[0]) or original(*a, **kw))
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        w, ref_w = _weight(n, k, 128, cuda_device, mma=True)
        for m in (1, 2, 5, 8, 16, 17):
            x = torch.randn(m, k, device=cuda_device).to(dtype)
            assert relative_error(km.int4_linear(x, w), _ref(x, ref_w, None)) < TOLERANCE[dtype], (n, k, m)
    assert calls == [2, 5, 8, 16] * 4


@pytest.mark.gpu
def test_int4_layers_carry_the_layout(cuda_device, seed, monkeypatch):
    """An int4 layer built on the GPU packs the layout, and its 2-16 token products take the kernel and
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
