"""Long prefill chunks through FlashAttention-3 on Hopper (the `fa3-fwd` wheel), ahead of cuDNN.

Why: FlashAttention-3's forward kernel (warp-specialised, TMA loads, wgmma, softmax overlapped with
the next tile's matmuls) runs a long chunk at ~650-710 TFLOP/s on an H100 where cuDNN 9.19 through
torch runs ~570-620 (benches/RESULTS.md, issue 17): 1.03-1.28x at 8192-token chunks, more at
shorter ones. The kernel comes built (`fa3-fwd`, a forward-only build of the upstream Hopper code
against torch's stable C ABI, so one wheel serves every torch from 2.10 on); ferrox compiles
nothing for it, so it adds nothing to start-up and nothing can compile after ready.

One call per request's chunk. The wheel is built without paged KV, so the request's cached context
and the chunk's own rows (written to the cache this step, before attention) are gathered from the
cache into one contiguous K/V (one index_select over whole blocks, kernels/cudnn_prefill.py's;
~1-4% of the call at 8k-token chunks), and FlashAttention-3's causal mask, which aligns the
diagonal bottom-right (query row i sees keys 0 .. context + i), does the rest: no second call and
no merge, as cuDNN through torch needs (top-left only).

FP8 caches: the gather moves bytes and widens them to the model's dtype (exact), k_scale joins the
softmax scale and v_scale multiplies the output, as on the cuDNN path.

Used by attention/triton_backend.py for prefill chunks of at least FA3_MIN_LEN tokens (any cached
context), on sm90 GPUs, bf16 (fp16 where the wheel has it) with a cache of that dtype or FP8,
head_dim <= 256 and a multiple of 8, no sliding window, sinks, attention chunks or score cap.
FERROX_FA3_PREFILL=0 turns it off (cuDNN, then the Triton kernels, take such chunks); without the
wheel, or with a torch whose ABI it cannot load, the engine logs why once and keeps cuDNN. The GPU
tests compare it with the Triton prefill kernel and the float32 reference
(tests/kernels/test_fa3_prefill.py); on CPU the path runs with the kernel call replaced by a
float64 softmax.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

from ferrox.kernels.cudnn_prefill import CUDNN_MIN_LEN, gather_blocks, gather_widened
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE

logger = logging.getLogger(__name__)

# Shorter chunks keep the Triton prefill kernel, which reads the paged cache in place: a short
# chunk over a long context would spend more on the gather than on attention. The cut is cuDNN's,
# so the KV budget's scratch reserve (cudnn_prefill.scratch_bytes) covers both paths.
FA3_MIN_LEN = CUDNN_MIN_LEN
_ENABLE = "FERROX_FA3_PREFILL"


@functools.cache
def _ops() -> Any:
    """torch.ops.fa3_fwd, or None (logged once) when the wheel is missing or cannot load here."""
    try:
        import fa3_fwd._C  # noqa: F401  (registers torch.ops.fa3_fwd)
    except ImportError:
        logger.info("fa3-fwd is not installed: long prefill chunks attend through cuDNN")
        return None
    except (OSError, RuntimeError) as exc:  # a torch whose libraries or ABI the wheel does not match
        logger.warning("fa3-fwd failed to load (%s): long prefill chunks attend through cuDNN", exc)
        return None
    return torch.ops.fa3_fwd


@functools.cache
def _wheel_dtypes() -> tuple[torch.dtype, ...]:
    try:
        from fa3_fwd_config import CONFIG  # written by the wheel's build: which variants it holds
        flags = CONFIG.get("build_flags", {})
    except ImportError:
        flags = {}
    return (torch.bfloat16,) if flags.get("FLASHATTENTION_DISABLE_FP16") else (torch.bfloat16, torch.float16)


def fa3_prefill_supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether this device and model dtype can take the path (an sm90 GPU with the wheel loaded)."""
    if device.type != "cuda" or os.environ.get(_ENABLE, "1") == "0":
        return False
    if head_dim > 256 or head_dim % 8 or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    return _ops() is not None and dtype in _wheel_dtypes()


def fa3_prefill_applies(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """The rule the attention backend and the KV budget (worker/model_setup.py) both follow."""
    return kv_dtype in (dtype, FP8_KV_DTYPE) and fa3_prefill_supported(device, dtype, head_dim)


def takes_fa3_path(query_len: int, context_len: int) -> bool:
    return query_len >= FA3_MIN_LEN


def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention-3 forward: q [1, T, H, D], k [1, S, Hkv, D], v [1, S, Hkv, Dv] (Dv = D, or 128 with
    D = 192: DeepSeek's latent attention expanded, kernels/mla_prefill.py); causal aligns the diagonal
    bottom-right (S >= T). Returns (out [1, T, H, Dv], written into `out` when given, and the softmax's
    log-sum-exp [1, H, T] in float32). One split: a long chunk fills the GPU with query tiles alone (the
    default, 0, lets a heuristic split the keys too and merge)."""
    res = _ops().fwd(q, k, v, out=out, softmax_scale=scale, is_causal=causal, num_splits=1)
    return res[0], res[1]


def fa3_prefill_request(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor,
                        context_len: int, scale: float, kv_scales: tuple[float, float] | None = None) -> None:
    """One request's chunk: q [T, H, D] (any row stride), block_ids its first ceil((context_len + T) /
    block_size) blocks (the chunk's own rows are in the cache already); writes out [T, H, D]. An FP8
    cache passes kv_scales, its (k_scale, v_scale) as host numbers."""
    length = context_len + q.shape[0]
    if kv_scales is None:
        kv = gather_blocks(kv_cache, block_ids)[:, :length]
    else:
        kv = gather_widened(kv_cache, block_ids, length, q.dtype)
        scale *= kv_scales[0]
    target = out if out.is_contiguous() else torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.stride(-1) != 1:
        q = q.contiguous()
    _fwd(q.unsqueeze(0), kv[0].unsqueeze(0), kv[1].unsqueeze(0), scale, True, target.unsqueeze(0))
    if kv_scales is not None and kv_scales[1] != 1.0:
        target.mul_(kv_scales[1])
    if target is not out:
        out.copy_(target)


def warm_up(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
            max_query_len: int) -> int:
    """Load the kernels a long chunk can reach (CUDA loads a module's kernels at their first launch):
    the shortest and longest chunk, fresh and after a context, so the heuristics' variants (GQA
    packing, tile schedulers) are resident before ready. Returns the number of calls made."""
    if max_query_len < FA3_MIN_LEN:
        return 0
    calls = 0
    q_all = torch.zeros(max_query_len, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(2, 1, 2 * max_query_len, num_kv_heads, head_dim, dtype=dtype, device=device)
    for t in sorted({FA3_MIN_LEN, max_query_len}):
        for s in (t, 2 * t):
            q = q_all[:t].unsqueeze(0)
            _fwd(q, kv[0, :, :s], kv[1, :, :s], head_dim ** -0.5, True, torch.empty_like(q))
            calls += 1
    torch.cuda.synchronize(device)
    return calls
