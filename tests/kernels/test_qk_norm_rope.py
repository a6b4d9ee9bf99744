"""Qwen3's per-head q/k RMSNorm + rotary for the many tokens of a step (kernels/qk_norm_rope.py
`qk_norm_rope`) against a float64 reference with RMSNorm's roundings (layers/ops.py rms_norm_torch),
bit for bit against the one-token kernel it shares its head math with, and through the layers'
Rope (KernelRope on the Triton set, CosSinRope on the torch set). Runs on CUDA, or on CPU in the
Triton interpreter child (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.qk_norm_rope import _qk_norm_rope_kernel, qk_norm_rope, qk_norm_rope_cache
from ferrox.kernels.rotary import neox_cos_sin_cache
from ferrox.layers.ops import CosSinRope, KernelRope, for_device
from ferrox.layers.rotary import RotaryEmbedding

from tests.kernels.kernel_refs import relative_error

# The reference rounds where the kernel does, so the two differ only where float32 and float64 land
# a value on either side of a rounding boundary: a few elements by one unit (none in most draws).
TOLERANCE = {torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 3e-3}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
EPS = 1e-6


def _inputs(device, dtype, *, tokens, hq, hkv, d, rows=50, pad=0):
    """qkv [tokens, (hq + 2 hkv) * d] (a view with row stride width + pad when pad > 0), norm
    weights, [cos | sin] rows for `rows` positions and a shuffled index into them."""
    width = (hq + 2 * hkv) * d
    # Not unit RMS (the norm matters), and the view starts 3 elements into its rows.
    buf = (3 * torch.randn(tokens, width + pad + 3, device=device)).to(dtype)
    qkv = buf[:, 3:3 + width] if pad else buf[:, 3:].contiguous()
    gq = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
    gk = (1 + 0.2 * torch.randn(d, device=device)).to(dtype)
    rope_rows = neox_cos_sin_cache(d, rows, 10000.0, device=device)
    rope_index = torch.randint(0, rows, (tokens,), device=device)
    return qkv, gq, gk, rope_rows, rope_index


def _reference(qkv, gq, gk, rope_rows, rope_index, hq, hkv, d):
    """q [T, hq, d], k [T, hkv, d]: RMSNorm as rms_norm_torch rounds it (the normed head to the
    activation dtype, times the weight in that dtype), float64 everywhere else, neox rotary, one
    final rounding."""
    t, dtype = qkv.shape[0], qkv.dtype
    heads = qkv[:, :(hq + hkv) * d].reshape(t, hq + hkv, d).double()
    normed = (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + EPS)).to(dtype)
    weights = torch.cat([gq.expand(hq, d), gk.expand(hkv, d)])
    x = (normed * weights).double()
    cos, sin = rope_rows[rope_index].double().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    lo, hi = x[..., :d // 2], x[..., d // 2:]
    out = torch.cat([lo * cos - hi * sin, hi * cos + lo * sin], dim=-1).to(dtype)
    return out[:, :hq], out[:, hq:]


@pytest.mark.parametrize(("tokens", "hq", "hkv", "d"), [(1, 4, 2, 64), (5, 4, 2, 16), (37, 3, 1, 16), (5, 2, 1, 128)],
                         ids=["t1-d64", "t5-d16", "t37-d16", "t5-d128"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_qk_norm_rope_matches_reference(kernel_device, seed, dtype, tokens, hq, hkv, d):
    qkv, gq, gk, rope_rows, rope_index = _inputs(kernel_device, dtype, tokens=tokens, hq=hq, hkv=hkv, d=d,
                                                 pad=0 if tokens == 1 else 40)
    before = qkv.clone()
    q, k = qk_norm_rope(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS, rope_rows=rope_rows,
                        rope_index=rope_index, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    ref_q, ref_k = _reference(qkv, gq, gk, rope_rows, rope_index, hq, hkv, d)
    assert q.shape == (tokens, hq, d) and k.shape == (tokens, hkv, d)
    assert q.dtype == dtype and k.dtype == dtype and q.is_contiguous() and k.is_contiguous()
    assert relative_error(q, ref_q) < TOLERANCE[dtype]
    assert relative_error(k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(qkv, before)  # q, k and v of qkv untouched


@pytest.mark.parametrize("d", [16, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_one_token_equals_the_decode_kernel(kernel_device, seed, dtype, d):
    """A prompt's token and a decoded token at the same position get the same q and k, bit for bit:
    both kernels run `_norm_rotate_head` (d 256 takes two warps in both)."""
    hq, hkv, slot, block_size = 4, 2, 6, 4
    qkv, gq, gk, rope_rows, rope_index = _inputs(kernel_device, dtype, tokens=1, hq=hq, hkv=hkv, d=d)
    q, k = qk_norm_rope(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS, rope_rows=rope_rows,
                        rope_index=rope_index, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    cache = torch.zeros(2, 3, block_size, hkv, d, dtype=dtype, device=kernel_device)
    q_one = qk_norm_rope_cache(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS,
                               rope_row=rope_rows[int(rope_index[0])],
                               slot_mapping=torch.tensor([slot], device=kernel_device), kv_cache=cache,
                               num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    assert torch.equal(q, q_one)
    assert torch.equal(k[0], cache[0, slot // block_size, slot % block_size])


def test_no_tokens(kernel_device):
    qkv, gq, gk, rope_rows, _ = _inputs(kernel_device, torch.float32, tokens=0, hq=2, hkv=1, d=8)
    q, k = qk_norm_rope(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS, rope_rows=rope_rows,
                        rope_index=torch.zeros(0, dtype=torch.int64, device=kernel_device), num_q_heads=2,
                        num_kv_heads=1, head_dim=8)
    assert q.shape == (0, 2, 8) and k.shape == (0, 1, 8)


def test_qk_norm_rope_rejects_bad_inputs(kernel_device):
    hq, hkv, d, t = 2, 1, 8, 3
    dev = kernel_device
    qkv = torch.zeros(t, 32, device=dev)
    args = dict(q_norm_weight=torch.ones(d, device=dev), k_norm_weight=torch.ones(d, device=dev), eps=EPS,
                rope_rows=torch.zeros(5, d, device=dev), rope_index=torch.zeros(t, dtype=torch.int64, device=dev),
                num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
    with pytest.raises(ValueError, match="qkv must be float32"):
        qk_norm_rope(qkv.int(), **args)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 32\]"):
        qk_norm_rope(torch.zeros(t, 31, device=dev), **args)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 32\]"):
        qk_norm_rope(torch.zeros(32, t, device=dev).t(), **args)  # heads not contiguous
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        qk_norm_rope(torch.zeros(t, 48, device=dev), **(args | {"head_dim": 12}))
    with pytest.raises(ValueError, match="at least one q and one kv head"):
        qk_norm_rope(torch.zeros(t, 16, device=dev), **(args | {"num_kv_heads": 0}))
    with pytest.raises(ValueError, match=r"k_norm_weight must be a contiguous float \[8\]"):
        qk_norm_rope(qkv, **(args | {"k_norm_weight": torch.ones(4, device=dev)}))
    with pytest.raises(ValueError, match=r"rope_rows must be float32 \[rows, 8\]"):
        qk_norm_rope(qkv, **(args | {"rope_rows": torch.zeros(5, d, dtype=torch.float16, device=dev)}))
    with pytest.raises(ValueError, match=r"rope_rows must be float32 \[rows, 8\]"):
        qk_norm_rope(qkv, **(args | {"rope_rows": torch.zeros(5, 2 * d, device=dev)}))
    with pytest.raises(ValueError, match=r"rope_index must be int32/int64 \[3\]"):
        qk_norm_rope(qkv, **(args | {"rope_index": torch.zeros(t + 1, dtype=torch.int64, device=dev)}))
    with pytest.raises(ValueError, match=r"rope_index must be int32/int64 \[3\]"):
        qk_norm_rope(qkv, **(args | {"rope_index": torch.zeros(t, device=dev)}))
    with pytest.raises(ValueError, match="rope_index is on meta"):
        qk_norm_rope(qkv, **(args | {"rope_index": torch.zeros(t, dtype=torch.int64, device="meta")}))


@pytest.mark.parametrize("head_dim", [32, 24], ids=["kernel", "fallback"])
def test_rope_norm_rotate_qk_on_both_op_sets(kernel_device, seed, head_dim):
    """The model's call (LlamaAttention, Qwen3): KernelRope runs the one kernel where it takes the
    head (a power-of-two head_dim), torch norms + its rotary otherwise; both agree with the torch
    set's CosSinRope (float32 tables and model both here, so only rounding differs), and neither
    changes qkv."""
    hq, hkv, tokens = 4, 2, 6
    triton_ops, torch_ops = for_device(kernel_device, "triton"), for_device(kernel_device, "torch")
    qkv = 3 * torch.randn(tokens, (hq + 2 * hkv) * head_dim, device=kernel_device)
    gq, gk = 1 + 0.2 * torch.randn(2, head_dim, device=kernel_device)
    positions = torch.tensor([0, 1, 2, 7, 300, 4], device=kernel_device)
    before = qkv.clone()

    reference = RotaryEmbedding(head_dim, 10000.0, None, kernel_device, torch_ops)(positions, torch.float32)
    assert isinstance(reference, CosSinRope)
    ref_q, ref_k = reference.norm_rotate_qk(qkv, hq, hkv, gq, gk, EPS)
    rope = RotaryEmbedding(head_dim, 10000.0, None, kernel_device, triton_ops)(positions, torch.float32)
    assert isinstance(rope, KernelRope)
    q, k = rope.norm_rotate_qk(qkv, hq, hkv, gq, gk, EPS)
    assert relative_error(q, ref_q) < 1e-5 and relative_error(k, ref_k) < 1e-5
    assert torch.equal(qkv, before)
    if head_dim == 32:
        want = qk_norm_rope(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS, rope_rows=rope.rows,
                            rope_index=rope.index, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim)
        assert torch.equal(q, want[0]) and torch.equal(k, want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_qk_norm_rope_qwen3_30b_shapes(cuda_device, seed, dtype):
    """Qwen3-30B-A3B's attention (32 q heads, 4 kv heads, head_dim 128) over a 2,000-token step;
    a new token count compiles nothing."""
    hq, hkv, d = 32, 4, 128
    compiled = []
    for tokens in (2000, 33):
        qkv, gq, gk, rope_rows, rope_index = _inputs(cuda_device, dtype, tokens=tokens, hq=hq, hkv=hkv, d=d,
                                                     rows=4096, pad=64)
        q, k = qk_norm_rope(qkv, q_norm_weight=gq, k_norm_weight=gk, eps=EPS, rope_rows=rope_rows,
                            rope_index=rope_index, num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        ref_q, ref_k = _reference(qkv, gq, gk, rope_rows, rope_index, hq, hkv, d)
        assert relative_error(q, ref_q) < TOLERANCE[dtype] and relative_error(k, ref_k) < TOLERANCE[dtype]
        caches = getattr(_qk_norm_rope_kernel, "device_caches", None)  # Triton's compiled variants
        if caches is not None:
            compiled.append(len(caches[torch.cuda.current_device()][0]))
    assert len(set(compiled)) <= 1, "a new token count compiled the kernel again"
