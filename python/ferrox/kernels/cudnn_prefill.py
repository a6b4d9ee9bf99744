"""Long prefill chunks through cuDNN's fused attention on Hopper, with the Triton kernels as fallback.

Why: on an H200 cuDNN's flash-attention kernels (reached through torch's
`aten._scaled_dot_product_cudnn_attention`) run an 8192-token chunk after 114,688 cached tokens at
~590-620 TFLOP/s where kernels/prefill_attention.py runs ~430 (benches/RESULTS.md, issue 17). cuDNN
has no paged KV and torch's binding only aligns the causal diagonal top-left, so a request's chunk
is attended in two parts and merged, as split-KV decoding merges its partials:

- the chunk over its own K/V (this step's k/v rows, contiguous already): causal, square, so the
  top-left diagonal is the right one;
- the chunk over its cached context, gathered from the paged cache into one contiguous K/V
  (~0.3 ms at 114k tokens, ~1% of that call): no mask, every cached position is visible;
- `merge_attention_parts`: out = (o1 * e^lse1 + o2 * e^lse2) / (e^lse1 + e^lse2), one Triton launch.

Graph builds. cuDNN builds an execution plan per distinct shape (70-90 ms each on the H200), which
for chunked prefill would be one per chunk. torch's TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (read once
per process, at its first cuDNN attention call) rounds the sequence lengths of its plan key up to
powers of two for batch-major contiguous ("BSHD") operands, so a server reaches a bounded set of
plans and the engine's warm-up builds them all before ready (`warm_up_plans`). It is set here,
when the engine enables this path, unless the user set it; with it set to 0 this path stays off.
The plan cache is per thread: warm-up and the steps run on the engine core's thread.

Exact-shape plans for the context part of whole chunks. A bucketed plan runs cuDNN's ragged path,
~6% slower than a plan built for the exact lengths (583 vs 611-622 TFLOP/s after 114,688 tokens on
the H200, benches/RESULTS.md). A long prompt prefilled alone is cut into chunks of exactly the
token budget T, so its chunks see contexts T, 2T, ...: max_model_len / T shapes, few enough to
build before ready. For those the query of the context call goes in head-major ([1, H, T, D]
contiguous): torch buckets only when every operand is batch-major, so the call gets its exact
plan, the one the warm-up built (`exact_contexts`); 122k-token TTFT 10.08 -> 9.78 s on the H200.
The causal part over the chunk itself keeps its bucket: ~3% faster alone as an exact plan, not
measurably faster end to end, and one plan fewer. Any other chunk (the prompt's last, one beside
decodes, a prefix-cache hit off the grid) takes its buckets.

FP8 caches. cuDNN's bf16 attention cannot read E4M3 bytes, so with an FP8 cache both parts read
the cache: the chunk's own rows (already written this step) and its context are gathered together
as bytes and widened to the model's dtype -- exact, every E4M3 value is a bf16 and an fp16 value --,
k_scale joins the softmax scale and v_scale multiplies the merged output, as in the Triton kernels,
so a chunk sees the same numbers whichever kernel attends it. Without this path a long prompt over an
FP8 cache took the Triton prefill kernel (122k-token TTFT 15.0 s against ~9.8 s for a 16-bit cache
on the H200, benches/RESULTS.md).

Used by attention/triton_backend.py for prefill requests whose chunk and cached context are both
0 or at least CUDNN_MIN_LEN tokens long, on sm90 GPUs with a bf16/fp16 or FP8 (E4M3) cache and
head_dim <= 128; FERROX_CUDNN_PREFILL=0 turns it off. Where cuDNN raises (a shape it has no plan
for), the backend logs it and keeps the Triton kernels from then on, that step included. The GPU
tests compare this path with the Triton prefill kernel (tests/kernels/test_cudnn_prefill.py); the
merge kernel and the fallback also run under the interpreter.
"""

from __future__ import annotations

import logging
import math
import os

import torch
import triton
import triton.language as tl

from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE

logger = logging.getLogger(__name__)

# Chunks (and cached contexts) shorter than this stay on the Triton kernels: each cuDNN call costs
# ~0.1 ms of host time and each length bucket a plan, and at 1-2k tokens the two are on par.
CUDNN_MIN_LEN = 1024
# More exact shapes than this (a small token budget under a long max_model_len) would cost more
# start-up than they save (40-90 ms a plan): then every chunk takes its bucket.
MAX_EXACT_PLANS = 32
_AVOID_RECOMPILE = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
_ENABLE = "FERROX_CUDNN_PREFILL"


def cudnn_prefill_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this device and cache can take the cuDNN path (measured on sm90 only)."""
    if device.type != "cuda" or os.environ.get(_ENABLE, "1") == "0":
        return False
    if dtype not in (torch.bfloat16, torch.float16) or head_dim > 128 or head_dim % 8:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < 90000:
        return False
    return hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")


def cudnn_prefill_applies(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether an engine of this model dtype and KV cache dtype takes the path: the one rule both the
    attention backend and the KV budget (worker/model_setup.py) follow. A cache of the model's dtype
    or an FP8 one (widened as it is gathered); not when the user set TORCH_CUDNN_SDPA_AVOID_RECOMPILE=0."""
    return (kv_dtype in (dtype, FP8_KV_DTYPE) and os.environ.get(_AVOID_RECOMPILE) != "0"
            and cudnn_prefill_supported(device, dtype, head_dim))


def enable_bucketed_plans() -> bool:
    """Ask torch for power-of-two plan buckets (see the module doc); False if the user said no."""
    if os.environ.get(_AVOID_RECOMPILE) == "0":
        logger.info("%s=0: long prefill chunks stay on the Triton kernel", _AVOID_RECOMPILE)
        return False
    os.environ.setdefault(_AVOID_RECOMPILE, "1")
    return True


def takes_cudnn_path(query_len: int, context_len: int) -> bool:
    return query_len >= CUDNN_MIN_LEN and (context_len == 0 or context_len >= CUDNN_MIN_LEN)


def exact_contexts(chunk: int, max_model_len: int) -> list[int]:
    """The cached-context lengths whose exact-shape plans the warm-up builds for chunks of exactly
    `chunk` tokens (the token budget): chunk, 2 * chunk, ... while the chunk still fits the model.
    Empty when chunks that long never take this path, or when there would be too many plans."""
    if chunk < CUDNN_MIN_LEN:
        return []
    contexts = [j * chunk for j in range(1, max_model_len // chunk)]
    return contexts if len(contexts) <= MAX_EXACT_PLANS else []


def takes_exact_plan(query_len: int, context_len: int, exact_chunk: int) -> bool:
    """Whether this chunk's context part has an exact-shape plan (exact_chunk: the chunk length the
    warm-up built them for, 0 for none); contexts past the model never reach here."""
    return bool(exact_chunk) and query_len == exact_chunk and context_len > 0 and context_len % exact_chunk == 0


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] (contiguous) as cuDNN's [1, heads, tokens, D] batch-major view."""
    return x.unsqueeze(0).transpose(1, 2)


def _query(q: torch.Tensor, exact: bool) -> torch.Tensor:
    """q [T, H, D] (contiguous) as cuDNN's [1, H, T, D]: a batch-major view for a bucketed plan, a
    head-major copy for an exact-shape one (see the module doc; 64 MB for 8192 tokens x 32 heads)."""
    return q.transpose(0, 1).contiguous().unsqueeze(0) if exact else _bshd(q)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q [1, H, T, D] (`_query`), k/v [S, Hkv, D] contiguous -> (out [1, H, T, D], lse [H, T]); out's
    layout follows q's."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, _bshd(k), _bshd(v), None, True, 0.0, causal, False, scale=scale)
    lse = res[1]
    return res[0], lse.as_strided((q.shape[1], q.shape[2]), (lse.stride(1), lse.stride(2)))


@triton.jit
def _merge_kernel(out_ptr, a_ptr, lse_a_ptr, b_ptr, lse_b_ptr, num_tokens, out_scale,
                  stride_ot, stride_oh, stride_at, stride_ah, stride_bt, stride_bh,
                  stride_lah, stride_lat, stride_lbh, stride_lbt,
                  HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    tile, head = tl.program_id(0), tl.program_id(1)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, DIM_PAD)
    row_ok = rows < num_tokens
    mask = row_ok[:, None] & (cols[None, :] < HEAD_DIM)
    lse_a = tl.load(lse_a_ptr + head * stride_lah + rows * stride_lat, mask=row_ok, other=0.0)
    lse_b = tl.load(lse_b_ptr + head * stride_lbh + rows * stride_lbt, mask=row_ok, other=0.0)
    top = tl.maximum(lse_a, lse_b)
    wa = tl.exp(lse_a - top)
    wb = tl.exp(lse_b - top)
    a = tl.load(a_ptr + rows[:, None] * stride_at + head * stride_ah + cols[None, :], mask=mask, other=0.0)
    b = tl.load(b_ptr + rows[:, None] * stride_bt + head * stride_bh + cols[None, :], mask=mask, other=0.0)
    merged = (a.to(tl.float32) * wa[:, None] + b.to(tl.float32) * wb[:, None]) * (out_scale / (wa + wb))[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + cols[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=mask)


def merge_attention_parts(out: torch.Tensor, a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
                          lse_b: torch.Tensor, out_scale: float = 1.0) -> torch.Tensor:
    """out [T, H, D] = softmax-weighted union of two attention results over disjoint key sets:
    a, b [T, H, D] (any token/head strides, unit last stride), lse_a, lse_b float32 [H, T] (any
    strides: cuDNN's are head-major, or token-major on its ragged path; natural log of each part's
    softmax denominator, scores scaled), times out_scale (an FP8 cache's v_scale)."""
    num_tokens, num_heads, head_dim = out.shape
    for name, t in (("a", a), ("b", b)):
        if t.shape != out.shape or t.stride(-1) != 1:
            raise ValueError(f"{name} must be [{num_tokens}, {num_heads}, {head_dim}] with unit last stride, "
                             f"got {tuple(t.shape)} strides {t.stride()}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != (num_heads, num_tokens) or t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [{num_heads}, {num_tokens}], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if out.stride(-1) != 1:
        raise ValueError("out needs a unit last stride")
    block_t = 16
    _merge_kernel[(triton.cdiv(num_tokens, block_t), num_heads)](
        out, a, lse_a, b, lse_b, num_tokens, float(out_scale), out.stride(0), out.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1),
        HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_T=block_t, num_warps=4)
    return out


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The listed blocks of every plane (K and V; MLA's one latent plane), in order: [planes, len(block_ids) *
    block_size, Hkv, D], contiguous. One index_select over the cache seen as rows of whole blocks (plane by
    plane): 2.8x faster on the H200 than selecting along the block dimension of the 5-D cache (0.26 vs 0.72
    ms at 114k tokens)."""
    planes, num_blocks, _, num_kv_heads, head_dim = kv_cache.shape
    if kv_cache.is_contiguous():
        rows = torch.cat([block_ids + p * num_blocks for p in range(planes)])
        return kv_cache.view(planes * num_blocks, -1).index_select(0, rows).view(planes, -1, num_kv_heads, head_dim)
    return kv_cache.index_select(1, block_ids).flatten(1, 2)


def gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int):
    """A request's first context_len cached positions as contiguous K and V [context_len, Hkv, D]."""
    kv = gather_blocks(kv_cache, block_ids)
    return kv[0, :context_len], kv[1, :context_len]


def gather_widened(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 cache's first `length` positions of both planes widened to dtype: [2, length, Hkv, D],
    contiguous, still unscaled (the caller applies k_scale / v_scale). The blocks move as bytes (index
    kernels need not know the FP8 type), then one widening copy."""
    kv = gather_blocks(kv_cache.view(torch.uint8), block_ids)[:, :length]
    return kv.view(kv_cache.dtype).to(dtype, memory_format=torch.contiguous_format)


def cudnn_prefill_request(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          kv_cache: torch.Tensor, block_ids: torch.Tensor, context_len: int,
                          scale: float, exact: bool = False, kv_scales: tuple[float, float] | None = None) -> None:
    """One request's chunk: q [T, H, D], its own k/v [T, Hkv, D] (this step's rows), block_ids its
    first ceil(context_len / block_size) blocks (int, on the device); writes out [T, H, D]. exact:
    the warm-up built the exact plan of this chunk's context part (`takes_exact_plan`).

    An FP8 cache (kv_scales: its (k_scale, v_scale) as host numbers) is read for the own rows too, so
    block_ids must then cover the chunk as well: ceil((context_len + T) / block_size) blocks; k/v
    are not read."""
    q = q.contiguous()  # no copy unless a qkv split's view
    out_scale = 1.0
    if kv_scales is None:
        k, v = k.contiguous(), v.contiguous()
    else:
        kv = gather_widened(kv_cache, block_ids, context_len + q.shape[0], q.dtype)
        k, v = kv[0, context_len:], kv[1, context_len:]
        scale, out_scale = scale * kv_scales[0], kv_scales[1]
    own, own_lse = _attend(_query(q, False), k, v, True, scale)
    if context_len == 0:
        if out_scale == 1.0:
            out.copy_(own[0].transpose(0, 1))
        else:
            torch.mul(own[0].transpose(0, 1), out_scale, out=out)
        return
    if kv_scales is None:
        ck, cv = gather_context(kv_cache, block_ids, context_len)
    else:
        ck, cv = kv[0, :context_len], kv[1, :context_len]
    ctx, ctx_lse = _attend(_query(q, exact), ck, cv, False, scale)
    merge_attention_parts(out, own[0].transpose(0, 1), own_lse, ctx[0].transpose(0, 1), ctx_lse, out_scale)


def plan_buckets(max_query_len: int, max_model_len: int) -> tuple[list[int], list[int]]:
    """The power-of-two lengths whose plans the path can reach: chunk lengths from CUDNN_MIN_LEN up to
    the step's token budget, context lengths up to max_model_len."""
    def ladder(top: int) -> list[int]:
        if top < CUDNN_MIN_LEN:
            return []
        return [1 << e for e in range(int(math.log2(CUDNN_MIN_LEN)), (top - 1).bit_length() + 1)]

    chunks = ladder(min(max_query_len, max_model_len))
    contexts = ladder(max_model_len - CUDNN_MIN_LEN) if chunks else []
    return chunks, contexts


def warm_up_plans(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                  max_query_len: int, max_model_len: int) -> int:
    """Build every plan bucket this engine can reach (one call each, on this thread); returns how many."""
    chunks, contexts = plan_buckets(max_query_len, max_model_len)
    if not chunks:
        return 0
    scale = head_dim ** -0.5
    longest = max(max(chunks), max(contexts, default=0))
    q_all = torch.zeros(max(chunks), num_heads, head_dim, dtype=dtype, device=device)
    kv_all = torch.zeros(longest, num_kv_heads, head_dim, dtype=dtype, device=device)
    built = 0
    for t in chunks:
        q = _query(q_all[:t], False)
        _attend(q, kv_all[:t], kv_all[:t], True, scale)
        built += 1
        for s in contexts:
            # Bucket 2^j holds the lengths in (2^(j-1), 2^j]: reachable if the shortest chunk and
            # context of the two buckets fit in one request together.
            if max(t // 2 + 1, CUDNN_MIN_LEN) + max(s // 2 + 1, CUDNN_MIN_LEN) <= max_model_len:
                _attend(q, kv_all[:s], kv_all[:s], False, scale)
                built += 1
    torch.cuda.synchronize(device)
    return built


def warm_up_exact_plans(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                        head_dim: int, chunk: int, max_model_len: int) -> int:
    """Build the exact-shape plans of `exact_contexts(chunk, max_model_len)` with the operand layouts
    cudnn_prefill_request passes (the plan key holds every stride); returns how many."""
    contexts = exact_contexts(chunk, max_model_len)
    if not contexts:
        return 0
    scale = head_dim ** -0.5
    q_rows = torch.zeros(chunk, num_heads, head_dim, dtype=dtype, device=device)
    q = _query(q_rows, True)
    kv_all = torch.zeros(max(contexts), num_kv_heads, head_dim, dtype=dtype, device=device)
    for s in contexts:
        ctx, ctx_lse = _attend(q, kv_all[:s], kv_all[:s], False, scale)
    # The merge after an exact plan: that part's output and log-sum-exp come head-major, strides a
    # bucketed plan's never have (a Triton specialisation of its own: compiled here, not in the first
    # long prompt's latency, ~0.25 s on the H200).
    own, own_lse = _attend(_query(q_rows, False), kv_all[:chunk], kv_all[:chunk], True, scale)
    merge_attention_parts(torch.empty_like(q_rows), own[0].transpose(0, 1), own_lse, ctx[0].transpose(0, 1), ctx_lse)
    torch.cuda.synchronize(device)
    return len(contexts)


def scratch_bytes(num_heads: int, num_kv_heads: int, head_dim: int, element_size: int, max_query_len: int,
                  max_model_len: int, fp8_cache: bool = False) -> int:
    """The most device memory one layer's cuDNN prefill holds beyond the Triton path's, for the KV
    budget (worker/model_setup.py): the gathered context K/V, contiguous q/k/v copies, both parts'
    outputs and log-sum-exps, and a margin for cuDNN's workspace. An FP8 cache gathers the chunk's
    rows too, as bytes and then widened."""
    chunks, _ = plan_buckets(max_query_len, max_model_len)
    if not chunks:
        return 0
    t = min(max_query_len, max_model_len)
    row = head_dim * element_size
    if fp8_cache:
        gathered = 2 * max_model_len * num_kv_heads * head_dim * (element_size + 1)
    else:
        gathered = 2 * (max_model_len - CUDNN_MIN_LEN) * num_kv_heads * row
    # (num_heads twice: the contiguous q and its head-major copy for an exact-shape plan)
    return (gathered + t * (2 * num_heads + 2 * num_kv_heads) * row
            + 2 * t * num_heads * (row + 4) + (64 << 20))
