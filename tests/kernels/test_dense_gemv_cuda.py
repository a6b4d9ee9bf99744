"""The tensor-core decode product for weights as they load (kernels/dense_gemv_cuda.py, cuda/dense_gemv.cu)
against float64 references: bf16 / fp16 weights against the activations, E4M3 weights against the token's
fp8 codes (W8A8, the quantizer written here), every compiled config at edge shapes (1-8 tokens, rows
that end inside a tile, a K range per warp that is empty or short), the fusions, and the routing of
gemv.gemv / w8a8_dot_gemv through it. On the CPU: the module compiles for Hopper and the kernel refuses
what it cannot take."""

from __future__ import annotations

import itertools

import pytest
import torch
from ferrox.kernels import dense_gemv_cuda, nvrtc
from ferrox.kernels.dense_gemv_cuda import CONFIGS, DenseGemvConfig, dense_mma_product, supported

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, silu_and_mul_ref
from tests.kernels.test_fp8_gemv import FP8, quantize_rows_ref


@pytest.mark.skipif(nvrtc.bindings() is None, reason="cuda-bindings (NVRTC) not installed")
@pytest.mark.parametrize("act,fp8,block", [("Bf16", True, False), ("F16", False, False), ("Bf16", True, True)],
                         ids=["bf16-e4m3", "f16", "bf16-e4m3-block"])
def test_module_compiles_for_hopper(tmp_path, monkeypatch, act, fp8, block):
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    source = dense_gemv_cuda._base_source()
    assert source is not None
    cubin = nvrtc.compile_cubin(dense_gemv_cuda.module_source(act, fp8, source, CONFIGS, block), "sm_90", (),
                                "dense_gemv.cu")
    assert cubin[:4] == b"\x7fELF"
    for cfg in CONFIGS:
        for fuse in dense_gemv_cuda._fusions(fp8, block):
            assert dense_gemv_cuda.kernel_name(act, fp8, cfg, fuse).encode() in cubin


def test_refuses_what_it_cannot_take():
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not supported(torch.zeros(1, 64, dtype=torch.bfloat16), w)  # the CPU
    # A stage must divide a row's bytes: four 64-byte units do not divide 96 bf16 (192 bytes) -> one.
    assert dense_gemv_cuda.choose_config(8000, 192).chunks == 1
    assert dense_gemv_cuda.choose_config(8000, 8192).chunks == 4  # a 16-bit LM head
    assert dense_gemv_cuda.choose_config(8000, 8192, fp8=True).chunks == 2
    assert dense_gemv_cuda.choose_config(384, 8192) == dense_gemv_cuda.CONFIGS[1]  # a 16-bit qkv
    assert dense_gemv_cuda.few_token_product(torch.zeros(4, 64, dtype=torch.bfloat16), w) is None  # the CPU
    # Block scales: groups of 128 inputs only, BN a multiple of 16 (checked before the device is).
    codes = torch.zeros(32, 256, dtype=torch.float8_e4m3fn)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    for block, scales in (((128, 64), torch.ones(1, 4)), ((8, 128), torch.ones(4, 2)), ((128, 128), torch.ones(1, 3))):
        assert not supported(x, codes, weight_scale=scales, block=block)


def test_batch_rows_by_weight_kind(monkeypatch):
    monkeypatch.delenv("FERROX_DENSE_MMA_ROWS", raising=False)
    assert (dense_gemv_cuda.batch_rows(False), dense_gemv_cuda.batch_rows(True)) == (8, 8)
    monkeypatch.setenv("FERROX_DENSE_MMA_ROWS", "1")  # the A/B switch: batches to cuBLAS
    assert (dense_gemv_cuda.batch_rows(False), dense_gemv_cuda.batch_rows(True)) == (1, 1)
    monkeypatch.setenv("FERROX_DENSE_MMA_ROWS", "32")  # never past one MMA's columns
    assert dense_gemv_cuda.batch_rows(True) == 8
    monkeypatch.setenv("FERROX_DENSE_MMA_ROWS", "eight")
    with pytest.raises(ValueError, match="FERROX_DENSE_MMA_ROWS"):
        dense_gemv_cuda.batch_rows(False)


def fresh_weights_landed() -> None:
    """Wait for the weights a test has just written. Under programmatic dependent launch the kernel requests
    its first weight stages before `griddepcontrol.wait` (an engine's weights were written at load, long
    before), so a weight written by the launch's predecessor in the stream -- a test's quantizer, say --
    could be read before it lands. The inputs are read after the wait and need no such care."""
    torch.cuda.synchronize()


@pytest.fixture
def mma_calls(monkeypatch) -> list:
    """The input shape of every dense_mma_product call from here on (the calls still made): which products
    the routing hands the kernel."""
    calls: list = []
    real = dense_gemv_cuda.dense_mma_product
    monkeypatch.setattr(dense_gemv_cuda, "dense_mma_product", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    return calls


def _weight16(n, k, dtype, device):
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    return w, w.double()


def _weight8(n, k, device):
    w = torch.randn(n, k, device=device) / k ** 0.5 * (1 + torch.rand(n, 1, device=device) * 4)
    q, s = quantize_rows_ref(w)
    return q, s, q.double() * s.double()[:, None]


def _codes_ref(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Each token row [M, K] (already normed and rounded) as the value of its fp8 code times its scale."""
    xf = x.float()
    s = (scale.float().expand(x.shape[0], 1) if scale is not None
         else xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0)
    return (xf / s).clamp(-448, 448).to(FP8).double() * s.double()


def _case(device, dtype, n, k, m, *, fp8, norm=False, silu=False, residual=False, bias=False, static=False,
          out_f32=False, config=None):
    x = torch.randn(m, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    if fp8:
        w, s, w_ref = _weight8(n, k, device)
    else:
        (w, w_ref), s = _weight16(n, k, dtype, device), None
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(m, n_out, dtype=dtype, device=device) if residual else None
    in_scale = torch.tensor([0.02], device=device) if static else None
    out_dtype = torch.float32 if out_f32 else None
    assert supported(x, w, weight_scale=s, bias=b, norm_weight=g, residual=res, silu_mul=silu, input_scale=in_scale,
                     out_dtype=out_dtype)
    fresh_weights_landed()
    out = dense_mma_product(x, w, b, weight_scale=s, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res,
                            input_scale=in_scale, out_dtype=out_dtype, config=config)

    xin = torch.cat([rms_norm_ref(x[i:i + 1], g, 1e-5) for i in range(m)]) if norm else x
    xin = _codes_ref(xin, in_scale) if fp8 else xin.double()
    ref = xin @ w_ref.t() + (b.double() if b is not None else 0)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res
    assert out.shape == (m, n_out) and out.dtype == (torch.float32 if out_f32 else dtype)
    assert not out.isnan().any()
    # (fp8: a code can round the other way where the reference's norm differs in its last bit)
    tol = (3e-2 if fp8 else 2e-2) if dtype == torch.bfloat16 else 1e-2 if fp8 else 4e-3
    err = relative_error(out.float(), ref.float())
    assert err < tol, (m, n, k, config, err)


SWEEP = (*CONFIGS, DenseGemvConfig(4, 1, 2), DenseGemvConfig(16, 1, 3), DenseGemvConfig(4, 4, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "w16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_every_config_at_the_edges(cuda_device, seed, fp8, dtype):
    eb = 1 if fp8 else 2
    for cfg in SWEEP:
        # K: one unit, a few (more warps than stages: empty ranges), a ragged split; rows inside a tile.
        for k_units in (cfg.chunks, 3 * cfg.chunks, 37 * cfg.chunks):
            k = k_units * 64 // eb
            for m in (1, 3, 8):
                _case(cuda_device, dtype, 40, k, m, fp8=fp8, config=cfg)
        _case(cuda_device, dtype, 1000, 4096, 1, fp8=fp8, bias=True, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False], ids=["e4m3", "w16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fusions(cuda_device, seed, fp8, dtype):
    for cfg in CONFIGS:
        for m in (1, 5):
            if fp8:  # (16-bit weights leave norm + SiLU to the Triton GEMV: FUSIONS_16)
                _case(cuda_device, dtype, 96, 1024, m, fp8=True, norm=True, silu=True, bias=True, config=cfg)
            _case(cuda_device, dtype, 80, 2048, m, fp8=fp8, residual=True, config=cfg)
            _case(cuda_device, dtype, 48, 512, m, fp8=fp8, norm=True, config=cfg)
            if fp8:
                _case(cuda_device, dtype, 64, 1024, m, fp8=True, static=True, residual=True, config=cfg)
            else:
                _case(cuda_device, dtype, 64, 1024, m, fp8=False, out_f32=True, config=cfg)
                _case(cuda_device, dtype, 64, 1024, m, fp8=False, norm=True, out_f32=True, config=cfg)


@pytest.mark.gpu
def test_llama_8b_shapes_route_through_the_kernel(cuda_device, seed, monkeypatch, mma_calls):
    """gemv.gemv and w8a8_dot_gemv at Llama-3.1-8B's one-token shapes take the kernel (counted: every FP8
    product, the 16-bit ones but gate_up) and agree with the Triton kernels they replace
    (FERROX_DENSE_MMA=0)."""
    from ferrox.kernels.gemv import gemv
    from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv

    calls = mma_calls
    dt = torch.bfloat16
    g = (1 + 0.1 * torch.randn(4096, device=cuda_device)).to(dt)
    for n, k, kw in [(28672, 4096, dict(silu_mul=True, norm=True)), (4096, 14336, dict(residual=True)),
                     (4096, 4096, dict(residual=True)), (6144, 4096, dict(norm=True)), (128256, 4096, dict(f32=True))]:
        x = torch.randn(1, k, dtype=dt, device=cuda_device)
        res = torch.randn(1, n, dtype=dt, device=cuda_device) if kw.get("residual") else None
        args = dict(norm_weight=g if kw.get("norm") else None, eps=1e-5, silu_mul=bool(kw.get("silu_mul")),
                    residual=res)
        w16 = (torch.randn(n, k, device=cuda_device) / k ** 0.5).to(dt)
        fresh_weights_landed()
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("FERROX_DENSE_MMA", switch)
            results.append(gemv(x, w16, out_dtype=torch.float32 if kw.get("f32") else None, **args))
        assert relative_error(results[0].float(), results[1].float()) < 1e-2
        if kw.get("f32"):
            continue
        w8, s = quantize_rows_ref(w16.float())
        fresh_weights_landed()
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("FERROX_DENSE_MMA", switch)
            results.append(w8a8_dot_gemv(x, w8, s, **args))
        assert relative_error(results[0].float(), results[1].float()) < 2e-2
        del w16, w8
    assert len(calls) == 8


@pytest.mark.gpu
def test_batches_of_few_rows_route_through_the_kernel(cuda_device, seed, monkeypatch, mma_calls):
    """Linear layers and the LM head hand batches of 2-8 rows to the kernel (counted; FP8 layers 2-4), not
    cuBLAS, and agree with F.linear; 1 and 9 rows, and inputs past the kernel's shared memory, stay on
    F.linear; FERROX_DENSE_MMA_ROWS=1 turns the routing off."""
    from ferrox.attention.decode_path import DecodePath
    from ferrox.layers.linear import Linear, RowParallelLinear

    calls = mma_calls
    dt = torch.bfloat16
    for cls, n, k, bias in ((Linear, 3072, 1024, True), (RowParallelLinear, 1024, 3072, False)):
        layer = cls(k, n, bias=bias, dtype=dt, device=cuda_device)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(n, k, device=cuda_device) / k ** 0.5)
            if bias:
                layer.bias.copy_(torch.randn(n, device=cuda_device))
        fresh_weights_landed()
        for lead in ((2,), (5,), (8,), (2, 3), (1,), (9,)):
            x = torch.randn(*lead, k, dtype=dt, device=cuda_device)
            calls.clear()
            out = layer(x)
            ref = torch.nn.functional.linear(x.double(), layer.weight.double(),
                                             layer.bias.double() if bias else None)
            assert out.shape == (*lead, n) and out.dtype == dt
            assert relative_error(out.float(), ref.float()) < 1e-2, (cls.__name__, lead)
            assert len(calls) == (1 if 2 <= x.numel() // k <= 8 else 0), (cls.__name__, lead)
    # Llama-3.1-8B's down_proj input: 5 bf16 rows of 14336 (143 KB) fit beside the rings, 6 do not.
    wide = Linear(14336, 64, bias=False, dtype=dt, device=cuda_device)
    with torch.no_grad():
        wide.weight.copy_(torch.randn(64, 14336, device=cuda_device) / 14336 ** 0.5)
    fresh_weights_landed()
    for rows, taken in ((5, 1), (6, 0)):
        calls.clear()
        x = torch.randn(rows, 14336, dtype=dt, device=cuda_device)
        out = wide(x)
        assert len(calls) == taken, rows
        assert relative_error(out.float(), (x.double() @ wide.weight.double().t()).float()) < 1e-2
    # The LM head: fp32 logits of 3 rows.
    w = (torch.randn(5000, 512, device=cuda_device) / 512 ** 0.5).to(dt)
    hidden = torch.randn(3, 512, dtype=dt, device=cuda_device)
    fresh_weights_landed()
    calls.clear()
    logits = DecodePath().logits(hidden, w)
    assert logits.dtype == torch.float32 and logits.shape == (3, 5000) and len(calls) == 1
    assert relative_error(logits, (hidden.double() @ w.double().t()).float()) < 1e-2
    # FP8 W8A8 layers: up to 8 rows (dense_gemv_cuda._BATCH_ROWS); test_fp8_gemv checks their values.
    from ferrox.layers.quant.fp8_linear import Fp8Linear

    w8, s8 = quantize_rows_ref(torch.randn(1024, 2048, device=cuda_device) / 2048 ** 0.5)
    fp8_layer = Fp8Linear(w8, s8, activations="dynamic-token")
    fresh_weights_landed()
    for m, taken in ((2, 1), (5, 1), (8, 1), (9, 0)):
        calls.clear()
        assert fp8_layer(torch.randn(m, 2048, dtype=dt, device=cuda_device)).shape == (m, 1024)
        assert len(calls) == taken, m
    monkeypatch.setenv("FERROX_DENSE_MMA_ROWS", "1")
    calls.clear()
    DecodePath().logits(hidden, w)
    layer(torch.randn(4, 3072, dtype=dt, device=cuda_device))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("cache_fp8", [False, True], ids=["cache16", "cache-e4m3"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qkv_rope_matches_the_triton_kernel(cuda_device, seed, monkeypatch, cache_fp8, dt):
    """qkv_rope_gemv of a W8A8 FP8 weight and of a 16-bit one (bf16 and fp16 activations) through the
    kernel's ROPE epilogue (q rotated out, k rotated and v into the paged cache at the slot, nothing for
    slot -1; a tile is 8 rotary pairs, both halves) against its Triton kernel: head dims 64, 80 (20 pairs: tiles of 8 that do not divide 16)
    and 128, GQA 2, 4 and 8; a 16-bit weight over an E4M3 cache keeps the Triton kernel."""
    from ferrox.kernels.gemv import qkv_rope_gemv

    taken: list = []
    real = dense_gemv_cuda.dense_qkv_rope
    monkeypatch.setattr(dense_gemv_cuda, "dense_qkv_rope", lambda *a, **kw: taken.append(1) or real(*a, **kw))
    for (hq, hkv, d, k), w8a8 in itertools.product(((8, 2, 64, 512), (4, 2, 80, 256), (32, 4, 128, 1024)),
                                                   (True, False)):
        rows = (hq + 2 * hkv) * d
        x = torch.randn(1, k, dtype=dt, device=cuda_device)
        g = (1 + 0.1 * torch.randn(k, device=cuda_device)).to(dt)
        if w8a8:
            w, s, _ = _weight8(rows, k, cuda_device)
        else:
            (w, _), s = _weight16(rows, k, dt, cuda_device), None
        b = torch.randn(rows, device=cuda_device).to(dt)
        rope = torch.randn(d, device=cuda_device)
        scales = torch.tensor([0.05, 0.03], device=cuda_device) if cache_fp8 else None
        fresh_weights_landed()
        for slot in (37, -1):
            outs = []
            taken.clear()
            for switch in ("1", "0"):
                monkeypatch.setenv("FERROX_DENSE_MMA", switch)
                cache = torch.zeros(2, 6, 8, hkv, d, device=cuda_device, dtype=FP8 if cache_fp8 else dt)
                q = qkv_rope_gemv(x, w, b, norm_weight=g, eps=1e-5, rope_row=rope,
                                  slot_mapping=torch.tensor([slot], device=cuda_device), kv_cache=cache,
                                  num_q_heads=hq, num_kv_heads=hkv, head_dim=d, weight_scale=s, kv_scale=scales,
                                  w8a8=w8a8)
                outs.append((q.float(), cache.float()))
            assert taken == ([1] if w8a8 or not cache_fp8 else []), (d, slot, w8a8)
            (q1, c1), (q0, c0) = outs
            assert relative_error(q1, q0) < 2e-2
            if slot < 0:
                assert not c1.any()
            else:
                written = c0[:, slot // 8, slot % 8]
                assert written.abs().sum() > 0 and relative_error(c1[:, slot // 8, slot % 8], written) < 3e-2
                c1[:, slot // 8, slot % 8] = 0
                assert not c1.any()  # nothing else written


def _block_case(device, dtype, n, k, m, *, bn=128, norm=False, silu=False, residual=False, bias=False,
                config=None):
    """A block-wise FP8 weight (128-input groups, bn-row blocks) against the float64 product of the
    dequantized weight and the input quantized per token and group (fp8_block_gemm's torch quantizer)."""
    from ferrox.kernels.fp8_block_gemm import dequantize_fp8_blocks, quantize_fp8_groups_torch
    from ferrox.layers.quant.fp8_block import quantize_fp8_blocks

    x = torch.randn(m, k, dtype=dtype, device=device)
    x[:, : k // 3] *= 8  # groups of very different scales
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    w = torch.randn(n, k, device=device) / k ** 0.5 * (1 + torch.rand(n, 1, device=device) * 4)
    codes, scales = quantize_fp8_blocks(w, (bn, 128))
    w_ref = dequantize_fp8_blocks(codes, scales, (bn, 128), torch.float64)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(m, n_out, dtype=dtype, device=device) if residual else None
    kw = dict(weight_scale=scales, bias=b, norm_weight=g, residual=res, silu_mul=silu, block=(bn, 128))
    assert supported(x, codes, **kw)
    fresh_weights_landed()
    out = dense_mma_product(x, codes, b, weight_scale=scales, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res,
                            block=(bn, 128), config=config)
    xin = torch.cat([rms_norm_ref(x[i:i + 1], g, 1e-5) for i in range(m)]) if norm else x
    q, s = quantize_fp8_groups_torch(xin.float(), 128)
    xin = q.double() * s.double().repeat_interleave(128, dim=1)
    ref = xin @ w_ref.t() + (b.double() if b is not None else 0)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res
    assert out.shape == (m, n_out) and out.dtype == dtype and not out.isnan().any()
    err = relative_error(out.float(), ref.float())
    assert err < (3e-2 if dtype == torch.bfloat16 else 1e-2), (m, n, k, bn, config, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_block_scales(cuda_device, seed, dtype):
    """Block-wise FP8 (128-input groups): every config at edge shapes (one group, rows ending inside a
    16-row tile and inside a block of rows, 64-row blocks), the fusions, 1-8 tokens."""
    for cfg in SWEEP:
        if 128 % (64 * cfg.chunks):
            continue
        for m in (1, 3, 8):
            _block_case(cuda_device, dtype, 40, 128, m, config=cfg)
            _block_case(cuda_device, dtype, 200, 128 * 5, m, bn=64, config=cfg)
        _block_case(cuda_device, dtype, 1000, 4096, 1, bias=True, config=cfg)
    for m in (1, 4):
        _block_case(cuda_device, dtype, 256, 1024, m, norm=True, silu=True, bias=True)
        _block_case(cuda_device, dtype, 272, 2048, m, residual=True)
        _block_case(cuda_device, dtype, 96, 512, m, norm=True)


@pytest.mark.gpu
def test_block_fp8_layers_route_through_the_kernel(cuda_device, seed, monkeypatch, mma_calls):
    """w8a8_dot_gemv(block=) and Fp8BlockLinear at 1-8 rows take the kernel (counted) and agree with the
    Triton one-token product and the block GEMM they replace (FERROX_DENSE_MMA=0); 9 rows stay on the GEMM."""
    from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv
    from ferrox.layers.quant.fp8_block import Fp8BlockLinear, quantize_fp8_blocks

    calls = mma_calls
    dt = torch.bfloat16
    g = (1 + 0.1 * torch.randn(4096, device=cuda_device)).to(dt)
    for n, k, kw in [(28672, 4096, dict(silu_mul=True, norm_weight=g)), (4096, 14336, dict(residual=True)),
                     (6144, 4096, dict(norm_weight=g))]:
        codes, scales = quantize_fp8_blocks(torch.randn(n, k, device=cuda_device) / k ** 0.5, (128, 128))
        x = torch.randn(1, k, dtype=dt, device=cuda_device)
        fresh_weights_landed()
        n_out = n // 2 if kw.get("silu_mul") else n
        args = dict(kw, residual=torch.randn(1, n_out, dtype=dt, device=cuda_device) if kw.get("residual") else None)
        results = []
        for switch in ("1", "0"):
            monkeypatch.setenv("FERROX_DENSE_MMA", switch)
            results.append(w8a8_dot_gemv(x, codes, scales, eps=1e-5, block=(128, 128), **args))
        assert relative_error(results[0].float(), results[1].float()) < 2e-2
    assert len(calls) == 3
    codes, scales = quantize_fp8_blocks(torch.randn(2048, 1024, device=cuda_device) / 32, (128, 128))
    layer = Fp8BlockLinear(codes, scales, (128, 128))
    bias = torch.randn(2048, device=cuda_device, dtype=dt)
    fresh_weights_landed()
    for rows, taken in ((1, 1), (2, 1), (5, 1), (8, 1), (9, 0)):
        x = torch.randn(rows, 1024, dtype=dt, device=cuda_device)
        results = []
        calls.clear()
        for switch in ("1", "0"):
            monkeypatch.setenv("FERROX_DENSE_MMA", switch)
            results.append(layer(x, bias))
        assert len(calls) == taken, rows
        assert results[0].shape == (rows, 2048)
        assert relative_error(results[0].float(), results[1].float()) < 2e-2, rows


@pytest.mark.gpu
@pytest.mark.parametrize("block", [False, True], ids=["per-token", "per-group"])
def test_fp8_codes_bit_exact(cuda_device, seed, block):
    """The prologue's codes are the torch quantizer's, bit for bit (its division is Markstein's, not `/`):
    an identity weight returns each input's code times its scale, against torch's division."""
    from ferrox.kernels.fp8_block_gemm import quantize_fp8_groups_torch

    k = 1024
    eye = torch.eye(k, device=cuda_device).to(FP8)
    fresh_weights_landed()
    for _ in range(4):
        x = (torch.randn(3, k, device=cuda_device) * 2.0 ** torch.randint(-12, 12, (3, k), device=cuda_device))
        x = x.to(torch.bfloat16)
        if block:
            out = dense_mma_product(x, eye, weight_scale=torch.ones(k // 128, k // 128, device=cuda_device),
                                    block=(128, 128))
            q, s = quantize_fp8_groups_torch(x.float(), 128)
            ref = (q.float() * s.repeat_interleave(128, dim=1)).to(torch.bfloat16)
        else:
            out = dense_mma_product(x, eye, weight_scale=torch.ones(k, device=cuda_device))
            s = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / torch.tensor(448.0, device=cuda_device)
            ref = ((x.float() / s).clamp(-448, 448).to(FP8).float() * s).to(torch.bfloat16)
        assert torch.equal(out, ref), (out != ref).sum().item()


@pytest.mark.gpu
def test_tokens_filling_shared_memory(cuda_device, seed):
    """Staged tokens past 100 KB beside the rings (one block an SM): 8 FP8 tokens and 5 bf16 ones of
    Llama-3.1-8B's down_proj input."""
    _case(cuda_device, torch.bfloat16, 512, 14336, 8, fp8=True, residual=True)
    _case(cuda_device, torch.bfloat16, 512, 14336, 5, fp8=False)


def test_launch_arguments_follow_the_kernel_signature(monkeypatch):
    """On the CPU, with the module and launcher stubbed: the arguments each launch passes sit where
    FERROX_DENSE_GEMV's signature takes them (one per _TYPES entry), the fusions name the kernel, and the
    shared memory covers the staged tokens and, for block-scaled FP8, their group scales."""
    launches = []

    class Module:
        def function(self, device, name):
            return name

    monkeypatch.setattr(dense_gemv_cuda, "_module", lambda act, fp8, configs, block: Module())
    monkeypatch.setattr(dense_gemv_cuda, "_grid", lambda fn, cfg, shared, tiles, device: (tiles,))
    monkeypatch.setattr(dense_gemv_cuda, "pdl_enabled", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    monkeypatch.setattr(nvrtc, "launch", lambda fn, grid, threads, args, types, stream, pdl, shared:
                        launches.append(dict(fn=fn, grid=grid, args=args, types=types, shared=shared)))
    x = torch.zeros(3, 1024, dtype=torch.bfloat16)
    g = torch.ones(1024, dtype=torch.bfloat16)
    codes = torch.zeros(512, 1024, dtype=torch.float8_e4m3fn)
    scales = torch.ones(4, 8)
    out = dense_mma_product(x, codes, weight_scale=scales, norm_weight=g, silu_mul=True, block=(128, 128))
    call = launches[-1]
    assert out.shape == (3, 256) and len(call["args"]) == len(call["types"])
    fuse = dense_gemv_cuda.BLOCK_SCALES | dense_gemv_cuda.NORM | dense_gemv_cuda.SILU_MUL
    assert call["fn"].endswith(f"_f{fuse}") and "e4m3" in call["fn"]
    args = call["args"]
    assert args[:3] == (out.data_ptr(), x.data_ptr(), codes.data_ptr()) and args[3] == scales.data_ptr()
    assert args[5:9] == (3, 256, 1024, 16) and args[12] == g.data_ptr()  # M, N, K, row tiles; the norm
    assert args[-2:] == (128, 8)  # block rows, the scales' row stride
    cfg = dense_gemv_cuda.choose_config(16, 1024, True)
    assert call["shared"] == dense_gemv_cuda._shared_bytes(cfg, 3 * 1024, True, 3 * 8 * 4)
    # Per-row scales: no block arguments, and the residual's pointer and stride in their places.
    res = torch.zeros(3, 512, dtype=torch.bfloat16)
    dense_mma_product(x, codes, weight_scale=torch.ones(512), residual=res)
    args = launches[-1]["args"]
    assert args[15:17] == (res.data_ptr(), 512) and args[-2:] == (0, 0)
    assert launches[-1]["fn"].endswith(f"_f{dense_gemv_cuda.RESIDUAL}")
    # qkv + rotary (4 q heads, 2 kv heads of 64): a tile of 8 rotary pairs each, 16 rows.
    qkv = torch.zeros(8 * 64, 1024, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16)
    q = dense_gemv_cuda.dense_qkv_rope(x[:1], qkv, None, weight_scale=torch.ones(512), norm_weight=g, eps=1e-5,
                                       rope_row=torch.zeros(64), slot_mapping=torch.zeros(1, dtype=torch.int64),
                                       kv_cache=cache, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                       kv_scale=torch.ones(2))
    call = launches[-1]
    assert q.shape == (1, 4, 64) and len(call["args"]) == len(call["types"])
    assert call["fn"].endswith(f"_f{dense_gemv_cuda.ROPE | dense_gemv_cuda.NORM}") and "e4m3" in call["fn"]
    assert call["args"][5:9] == (1, 512, 1024, 32) and call["args"][21:25] == (32, 4, 2, 16)
    cfg = dense_gemv_cuda.choose_config(32, 1024, True)
    assert call["grid"] == (32,) and call["shared"] == dense_gemv_cuda._shared_bytes(cfg, 1024, False)
