"""FP8 weights in the kernels: the one-token GEMVs (kernels/gemv.py) with float8 E4M3 weights and
per-row scales, the activation quantizer of layers/quant/fp8.py, the fused decode path of a tiny
Llama quantized to fp8, and (GPU) the W8A8 runner at Llama-3.1-8B's shapes. References are plain
torch on the dequantized weight, with an fp8 quantizer written here."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.gemv import GemvConfig, gemv, qkv_rope_gemv
from ferrox.kernels.rotary import neox_cos_sin_cache
from ferrox.kernels.row_quant import quantize_activations_triton
from ferrox.layers.quant.fp8 import Fp8Config
from ferrox.layers.quant.fp8_linear import Fp8Linear
from ferrox.layers.quant.method import use_quant_config
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.models.registry import get_model_class

from tests.kernels.kernel_refs import relative_error, rms_norm_ref, rotary_neox_ref, silu_and_mul_ref
from tests.kernels.test_fused_decode import _config, assert_fused_path_matches

FP8 = torch.float8_e4m3fn
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def quantize_rows_ref(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows with their float32 scales: each row's absmax -> 448, or the given per-tensor scale."""
    wf = w.float()
    if scale is None:
        scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 448.0
    else:
        scale = scale.float().reshape(1).expand(w.shape[0])
    return (wf / scale[:, None]).clamp(-448, 448).to(FP8), scale.contiguous()


def _fp8_weight(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 row scales, the dequantized float64 weight) with rows of unequal size."""
    w = torch.randn(n, k, device=device) / k ** 0.5 * (1 + torch.rand(n, 1, device=device) * 4)
    q, s = quantize_rows_ref(w)
    return q, s, q.double() * s.double()[:, None]


def gemv_inputs(device, dtype, n, k, *, norm, residual, bias, silu):
    """(x, norm weight, fp8 weight, row scales, dequantized weight, bias, residual, n_out) for one
    token; the optional ones None when off."""
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype) if norm else None
    w, s, w_ref = _fp8_weight(n, k, device)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    n_out = n // 2 if silu else n
    res = torch.randn(1, n_out, dtype=dtype, device=device) if residual else None
    return x, g, w, s, w_ref, b, res, n_out


def _gemv_case(device, dtype, n, k, *, norm, residual, bias, silu, config=None):
    x, g, w, s, w_ref, b, res, n_out = gemv_inputs(device, dtype, n, k, norm=norm, residual=residual, bias=bias,
                                                  silu=silu)
    out = gemv(x, w, b, norm_weight=g, eps=1e-5, silu_mul=silu, residual=res, weight_scale=s, config=config)

    xin = rms_norm_ref(x, g, 1e-5) if norm else x
    ref = xin.double() @ w_ref.t() + (b.double() if b is not None else 0)
    if silu:
        ref = silu_and_mul_ref(ref.to(dtype))
    if res is not None:
        ref = ref.to(dtype) + res
    assert out.shape == (1, n_out) and out.dtype == dtype and not out.isnan().any()
    assert relative_error(out, ref.to(dtype)) < TOLERANCE[dtype]


def _qkv_case(device, dtype, *, hq, hkv, d, k, bias, slot, block_size=4, num_blocks=5, config=None):
    heads = hq + 2 * hkv
    x = torch.randn(1, k, dtype=dtype, device=device)
    g = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    w, s, w_ref = _fp8_weight(heads * d, k, device)
    b = torch.randn(heads * d, device=device).to(dtype) if bias else None
    cos_sin = neox_cos_sin_cache(d, 64, 10000.0, device=device)
    pos = torch.randint(0, 64, (1,), device=device)
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    slots = torch.tensor([slot], dtype=torch.int64, device=device)
    q = qkv_rope_gemv(x, w, b, norm_weight=g, eps=1e-6, rope_row=cos_sin[pos[0]], slot_mapping=slots,
                      kv_cache=cache, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, weight_scale=s, config=config)
    qkv = rms_norm_ref(x, g, 1e-6).double() @ w_ref.t() + (b.double() if b is not None else 0)
    qkv = qkv.to(dtype).view(1, heads, d)
    assert relative_error(q, rotary_neox_ref(pos, qkv[:, :hq], cos_sin)) < TOLERANCE[dtype]
    blk, off = divmod(slot, block_size)
    assert relative_error(cache[0, blk, off], rotary_neox_ref(pos, qkv[:, hq:hq + hkv], cos_sin)[0]) < TOLERANCE[dtype]
    assert relative_error(cache[1, blk, off], qkv[0, hq + hkv:]) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_gemv_variants_tiny(kernel_device, seed, dtype):
    cfg = GemvConfig(block_n=4, block_k=32, num_warps=4)
    _gemv_case(kernel_device, dtype, 37, 100, norm=False, residual=False, bias=False, silu=False, config=cfg)
    _gemv_case(kernel_device, dtype, 37, 100, norm=True, residual=True, bias=True, silu=False, config=cfg)
    _gemv_case(kernel_device, dtype, 2 * 21, 64, norm=True, residual=False, bias=False, silu=True, config=cfg)
    _gemv_case(kernel_device, dtype, 2 * 21, 64, norm=False, residual=True, bias=True, silu=True, config=cfg)
    _gemv_case(kernel_device, dtype, 48, 96, norm=False, residual=True, bias=False, silu=False)  # fp8 config
    _gemv_case(kernel_device, dtype, 5, 40, norm=True, residual=False, bias=False, silu=False,
               config=GemvConfig(block_n=1, block_k=16, num_warps=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_qkv_rope_gemv_tiny(kernel_device, seed, dtype):
    _qkv_case(kernel_device, dtype, hq=4, hkv=2, d=16, k=48, bias=False, slot=13)
    _qkv_case(kernel_device, dtype, hq=3, hkv=1, d=24, k=40, bias=True, slot=0,
              config=GemvConfig(block_n=2, block_k=16, num_warps=4))


def test_fp8_gemv_needs_its_scales(kernel_device):
    w = torch.zeros(8, 16, device=kernel_device).to(FP8)
    x = torch.randn(1, 16, device=kernel_device)
    with pytest.raises(ValueError, match="needs its per-row weight_scale"):
        gemv(x, w)
    with pytest.raises(ValueError, match="weight_scale must be contiguous float32"):
        gemv(x, w, weight_scale=torch.ones(4, device=kernel_device))


def _check_quantized(q, scale, ref_q, ref_scale):
    """Scales equal to float32 rounding; the fp8 codes equal (but a float32 division may land a
    value on the other side of a rounding tie)."""
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert (q.float() != ref_q.float()).float().mean() < 1e-4


def _representable_rows(rows: int, k: int, device) -> torch.Tensor:
    """Rows of fp8 codes (each row's largest exactly 448) times powers of two: quantizing them is
    exact, so the test does not depend on how the float32 -> fp8 cast rounds. (The interpreter's
    numpy emulation of that cast drops the carry when rounding reaches the next power of two --
    125.9 -> 64 -- and mis-rounds subnormals; the GPU's cvt instruction rounds to nearest even.)"""
    codes = (torch.randn(rows, k, device=device) * 60).clamp(-448, 448).to(FP8).float()
    codes[torch.arange(rows), torch.randint(0, k, (rows,))] = 448.0
    return codes * (2.0 ** torch.randint(-12, 6, (rows, 1), device=device).float())


@pytest.mark.parametrize("k", [100, 4096 + 3])  # one K tile; several, the last one partial
def test_quantize_activations_kernel(kernel_device, seed, k):
    x = _representable_rows(6, k, kernel_device)
    x[3] = 0  # an all-zero row (CUDA-graph padding) stays zero, with a finite scale
    q, scale = quantize_activations_triton(x)
    ref_q, ref_scale = quantize_rows_ref(x)
    assert q.dtype == FP8 and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(scale, ref_scale[:, None])
    assert (q[3].float() == 0).all() and 0 < scale[3, 0] < 1e-12
    assert torch.equal(q.float() * scale, x)  # exact: x's values are representable at their row's scale

    # The smallest row scale for all: the other rows scale up by powers of two (still exact) and
    # saturate at +-448 instead of overflowing to NaN.
    static = scale[scale > 1e-12].min().reshape(1)
    q, scale = quantize_activations_triton(x, static)
    ref_q, _ = quantize_rows_ref(x, static)
    assert torch.equal(q.float(), ref_q.float()) and torch.equal(scale, static.expand(6, 1))
    assert not q.float().isnan().any()


def _fp8_models(device):
    """A tiny Llama quantized online to fp8 on the torch kernel set (general path) and the same
    float weights on the Triton set (the fused one-token path)."""
    spec = spec_from_hf_config(_config("LlamaForCausalLM"), "test config")
    cls = get_model_class(["LlamaForCausalLM"])
    with use_quant_config(Fp8Config.online()):
        ref = cls(spec, torch.float32, device, kernels="torch")
        fused = cls(spec, torch.float32, device, kernels="triton")
    init_dummy_weights(ref, seed=3)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10.0)
    fused.load_state_dict(ref.state_dict())
    for model in (ref, fused):
        model.finalize_weights()
        model.eval()
    return ref, fused


def test_fused_one_token_path_runs_fp8_layers(kernel_device, monkeypatch):
    ref, fused = _fp8_models(kernel_device)
    qkv = fused.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.dtype == torch.float32
    assert_fused_path_matches(ref, fused, kernel_device, monkeypatch)


# ---- GPU, real shapes ---------------------------------------------------------------------------
@pytest.mark.gpu
def test_fp8_gemv_llama8b_shapes(cuda_device, seed):
    dtype = torch.bfloat16
    _gemv_case(cuda_device, dtype, 4096, 4096, norm=False, residual=True, bias=False, silu=False)  # o_proj
    _gemv_case(cuda_device, dtype, 2 * 14336, 4096, norm=True, residual=False, bias=False, silu=True)  # gate_up
    _gemv_case(cuda_device, dtype, 4096, 14336, norm=False, residual=True, bias=False, silu=False)  # down
    _qkv_case(cuda_device, dtype, hq=32, hkv=8, d=128, k=4096, bias=False, slot=12345, block_size=16,
              num_blocks=1024)
    _qkv_case(cuda_device, dtype, hq=28, hkv=4, d=128, k=3584, bias=True, slot=77, block_size=16, num_blocks=8)


@pytest.mark.gpu
@pytest.mark.parametrize("activations", ["dynamic-token", "static", "dynamic-tensor", "weight-only"])
def test_fp8_linear_on_cuda(cuda_device, seed, activations):
    """The runner at 8B's down_proj shape: the tensor-core split-K product at one row (the CUDA-core
    GEMV for weight-only), cuBLASLt W8A8 above (bias fused), against the activations quantized here
    and the dequantized weight."""
    n, k = 4096, 14336
    w, s, w_ref = _fp8_weight(n, k, cuda_device)
    static = torch.tensor([0.01], device=cuda_device) if activations == "static" else None
    layer = Fp8Linear(w, s, activations=activations, input_scale=static)
    bias = torch.randn(n, device=cuda_device, dtype=torch.bfloat16)
    for rows in (1, 2, 4, 5, 33, 512):  # (2-4: dense_gemv_cuda's few-token product)
        x = torch.randn(rows, k, device=cuda_device, dtype=torch.bfloat16)
        xin = x.double()
        if activations != "weight-only":  # W8A8 at every row count (one row: w8a8_dot_gemv.py)
            scale = static
            if activations == "dynamic-tensor":
                scale = (x.float().abs().amax() / 448).reshape(1)
            xq, xs = quantize_rows_ref(x, scale)
            xin = xq.double() * xs.double()[:, None]
        for b in (None, bias):
            ref = xin @ w_ref.t() + (b.double() if b is not None else 0)
            out = layer(x, b)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
            assert relative_error(out, ref) < 1e-2, (rows, b is not None)


@pytest.mark.gpu
def test_quantize_activations_kernel_wide_rows(cuda_device, seed):
    x = torch.randn(300, 14336, device=cuda_device, dtype=torch.bfloat16)
    x[7] *= 1000
    q, scale = quantize_activations_triton(x)
    ref_q, ref_scale = quantize_rows_ref(x)
    _check_quantized(q, scale, ref_q, ref_scale[:, None])
