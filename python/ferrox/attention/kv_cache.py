"""The paged KV cache's storage: element type, allocation (one tensor per layer in the layout of
metadata.py), and the FP8 scales.

Under tensor parallelism (tp_size > 1) each rank caches only the KV heads its query heads read
(distributed/sharding.kv_head_range), so a block costs each rank 1/N of the bytes (or one head's
worth when ranks outnumber KV heads).

FP8 (kv_cache_dtype "fp8" / "fp8_e4m3", vLLM's meaning): keys and values are stored as
float8_e4m3fn, one byte each, with a per-layer float32 scale for K and one for V:

    stored = fp8(clamp(k / k_scale, -448, 448))        read = float(stored) * k_scale

The scales come from the checkpoint when it has them (`KVCacheScales.load`), else 1.0, unless
`calculate_kv_scales` measures them on the first step (kv_scale_calibration.py). Readers fold
k_scale into the softmax scale and v_scale into the output, so a dequantized K/V tile is never
multiplied element by element. The clamp makes every writer saturate the same way (a plain cast
of an out-of-range value is NaN in e4m3fn on some paths).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from ferrox.distributed.sharding import kv_head_range, local_num_kv_heads
from ferrox.kernels import fp8_unsupported_gpu
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE, FP8_KV_MAX
from ferrox.model_spec import ModelSpec

logger = logging.getLogger(__name__)

# kv_cache_dtype values (config.KV_CACHE_DTYPES) that mean an FP8 E4M3 cache.
_FP8_NAMES = ("fp8", "fp8_e4m3")
_SIXTEEN_BIT = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                           device: torch.device | str | None = None) -> torch.dtype:
    """The cache element type for EngineConfig.kv_cache_dtype: "auto" is the model's dtype. A
    device whose kernels cannot convert to FP8 E4M3 (CUDA before sm89) is refused by name.

    "bfloat16" / "float16" (vLLM's names for a 16-bit cache) must be the model's dtype: every attention
    kernel reads the cache in the dtype of its queries, so a cache of the other 16-bit type is refused,
    naming the --dtype that would give it."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _SIXTEEN_BIT:
        if _SIXTEEN_BIT[kv_cache_dtype] != model_dtype:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: the model runs in {str(model_dtype)[6:]} and "
                             "ferrox keeps the KV cache in the model's dtype (or FP8); use --dtype "
                             f"{kv_cache_dtype} or kv_cache_dtype 'auto'")
        return model_dtype
    if kv_cache_dtype not in _FP8_NAMES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is unknown (choose 'auto', 'bfloat16', 'float16', "
                         "'fp8' or 'fp8_e4m3')")
    old_gpu = fp8_unsupported_gpu(device) if device is not None else None
    if old_gpu is not None:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: FP8 E4M3 needs an sm89+ GPU (Ada, Hopper); "
                         f"this one is {old_gpu}")
    return FP8_KV_DTYPE


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int, tp_size: int = 1,
                   layer: int = 0) -> tuple[int, ...]:
    """[planes, blocks, block_size, KV heads, head_dim] of layer `layer`: planes 2 (K, V), or 1 for a model
    that reads its values from the key rows (spec.kv_planes: DeepSeek's latent cache). Heads and head_dim
    are the layer's own where the model's layers differ (spec.layer_kv_shapes: Gemma 4)."""
    if not spec.layer_kv_shapes:
        return (spec.kv_planes, num_blocks, block_size, local_num_kv_heads(spec, tp_size), spec.head_dim)
    heads, head_dim = spec.kv_shape_of(layer)
    # (0 heads: a layer without a KV cache, a hybrid model's linear-attention layer: an empty tensor)
    local = kv_head_range(heads, tp_size, 0)[1] if heads else 0
    return (spec.kv_planes, num_blocks, block_size, local, head_dim)


def kv_cache_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes one block costs across ALL layers (K and V) on one rank: divide free memory by this.
    dtype: the cache's element type (resolve_kv_cache_dtype), not necessarily the model's."""
    elem = torch.empty((), dtype=dtype).element_size()
    if spec.layer_kv_shapes:
        return sum(math.prod(kv_cache_shape(spec, 1, block_size, tp_size, i)) * elem for i in range(spec.num_layers))
    return spec.kv_planes * block_size * local_num_kv_heads(spec, tp_size) * spec.head_dim * elem * spec.num_layers


def allocate_kv_caches(
    spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str,
    tp_size: int = 1,
) -> list[torch.Tensor]:
    """Zero-filled, so that padded positions a backend gathers (and masks) never hold NaN/Inf:
    a masked score gets weight 0, but 0 * NaN would still poison the output. dtype: the cache's
    element type (FP8_KV_DTYPE for an FP8 cache)."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
    return [torch.zeros(kv_cache_shape(spec, num_blocks, block_size, tp_size, i), dtype=dtype, device=device)
            for i in range(spec.num_layers)]


def zero_kv_blocks(kv_caches: Sequence[torch.Tensor], block_ids: torch.Tensor) -> None:
    """Zero whole blocks (int64 ids on the caches' device) of every layer. Works on FP8 caches,
    for which torch has no index_fill_: byte 0 is +0.0 in every cache dtype."""
    for kv in kv_caches:
        target = kv.view(torch.uint8) if kv.element_size() == 1 else kv
        target.index_fill_(1, block_ids, 0)


def quantize_kv(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """x / scale as FP8 E4M3, saturated at +-448 (the write rule every FP8 cache writer follows)."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


# Checkpoint names of an attention layer's KV-cache scales, relative to the attention module
# (`model.layers.N.self_attn`), as vLLM reads them: llm-compressor / HF fp8 (k_scale, v_scale),
# ModelOpt (k_proj.k_scale, v_proj.v_scale), older compressed-tensors (k_proj/v_proj.output_scale)
# and the deprecated single kv_scale (both).
KV_SCALE_SUFFIXES: dict[str, str] = {
    "k_scale": "k",
    "v_scale": "v",
    "kv_scale": "kv",
    "k_proj.k_scale": "k",
    "v_proj.v_scale": "v",
    "k_proj.output_scale": "k",
    "v_proj.output_scale": "v",
}
# Scales of FP8 *attention* (quantized queries and probabilities): ferrox attends in the model's
# dtype, so these are read and unused, as vLLM's Triton backend does.
UNUSED_ATTENTION_SCALE_SUFFIXES = ("q_scale", "prob_scale", "q_proj.output_scale", "prob_output_scale")


def split_kv_scale_name(name: str) -> tuple[str, str] | None:
    """(attention module name, "k" | "v" | "kv" | "unused") when checkpoint tensor `name` is a KV
    cache (or FP8 attention) scale of a `self_attn` module, else None."""
    head, sep, tail = name.partition(".self_attn.")
    if not sep:
        return None
    module = f"{head}.self_attn"
    if tail in KV_SCALE_SUFFIXES:
        return module, KV_SCALE_SUFFIXES[tail]
    if tail in UNUSED_ATTENTION_SCALE_SUFFIXES:
        return module, "unused"
    return None


def warn_if_uncalibrated(model: nn.Module, kv_dtype: torch.dtype) -> None:
    """An FP8 cache whose scales all stayed 1.0 (the checkpoint has none) works, but keys or values
    beyond +-448 saturate and small ones lose precision; some models (seen: SmolLM2-135M in
    bfloat16) then drift. Say so once, as vLLM does."""
    if kv_dtype != FP8_KV_DTYPE:
        return
    scales = [m for m in model.modules() if isinstance(m, KVCacheScales)]
    if scales and all(m.k_scale == 1.0 and m.v_scale == 1.0 for m in scales):
        logger.warning("kv_cache_dtype fp8: the checkpoint has no k_scale/v_scale, so every layer uses 1.0; if "
                       "outputs degrade, use a checkpoint with calibrated KV scales (or kv_cache_dtype 'auto')")


class KVCacheScales(nn.Module):
    """One attention layer's K and V cache scales: `scales` is a float32 [2] = (k_scale, v_scale)
    buffer on the model's device, which kernels read by pointer (so CUDA graphs see the loaded
    values); `k_scale` / `v_scale` are the same numbers on the host, for the torch backend.

    A checkpoint that stores only one of the two (or the deprecated single kv_scale) uses it for
    both, as vLLM does. Scales are used only by an FP8 cache; with kv_cache_dtype "auto" they are
    loaded and ignored."""

    scales: torch.Tensor

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.register_buffer("scales", torch.ones(2, dtype=torch.float32, device=device), persistent=False)
        self.k_scale = 1.0
        self.v_scale = 1.0
        self._loaded: set[str] = set()
        # calculate_kv_scales (kv_scale_calibration.py): armed for the next K/V write, and done.
        self.calibrating = False
        self.calibrated = False

    def load(self, kind: str, tensor: torch.Tensor, name: str) -> None:
        """kind: "k", "v" or "kv" (both); name: the checkpoint tensor, for errors."""
        if tensor.numel() != 1:
            raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be one number (per-tensor), got "
                             f"shape {tuple(tensor.shape)}")
        value = float(tensor.reshape(()).float())
        if not value > 0.0 or value == float("inf"):
            raise ValueError(f"checkpoint tensor {name!r}: a KV cache scale must be positive and finite, got {value}")
        kinds = {"k": ("k",), "v": ("v",), "kv": ("k", "v")}[kind]
        for which in kinds:
            self.set_scale(which, value)
            self._loaded.add(which)
        # Only one of the two in the checkpoint: it stands for both until the other arrives.
        for other in ("k", "v"):
            if other not in self._loaded:
                self.set_scale(other, value)

    def set_scale(self, which: str, value: float) -> None:
        """which: "k" or "v"; the device tensor (read by the kernels, graphs included) and the host copy."""
        index = 0 if which == "k" else 1
        with torch.no_grad():
            self.scales[index] = value
        if which == "k":
            self.k_scale = value
        else:
            self.v_scale = value

    def extra_repr(self) -> str:
        return f"k_scale={self.k_scale}, v_scale={self.v_scale}"
