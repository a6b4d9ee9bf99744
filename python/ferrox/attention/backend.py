"""The attention backend interface: the one seam between model code and attention kernels.

A backend does two things per layer call, in one `forward`:
  1. writes this step's k/v rows into the paged KV cache at `meta.slot_mapping`, and
  2. runs causal attention for every request in the batch over its cached KV (blocks from
     `meta.block_table`, length `meta.seq_lens`), whether the request is a prefill chunk (possibly
     with earlier context already cached) or a single decode token. GQA: H query heads share
     Hkv = H / group key/value heads.

Layout (see metadata.py): kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim], 0 = K, 1 = V.
An empty kv_cache (numel 0) means "no cache yet" (e.g. a profiling forward): attention then runs
over the step's own k/v, which requires every request to start at position 0.

An FP8 cache (kv_cache.dtype float8_e4m3fn, attention/kv_cache.py) stores k / k_scale and v / v_scale
with the layer's `kv_scales` (None: 1.0); a backend attends as if over the dequantized cache, also
for the rows it has in hand this step, so that a prompt gives the same output whether its prefix
came from the prefix cache or not. Caches of other dtypes ignore the scales.

`begin_forward(meta)` is called once per model forward before the first layer, so a backend can
turn the metadata into its own plan (index tensors, masks) once instead of once per layer.

`softcap` (Gemma 2's attn_logit_softcapping) caps the scaled scores before the softmax; a model
sets it on the backend it builds, and kernels without it step aside for the ones that have it.

`sinks` (gpt-oss's attention sinks) is per layer: a float32 [H] tensor of learned logits, one per
query head, that join each query's softmax denominator (exp(sink) takes probability mass but adds no
value: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j))). A layer passes its own to `forward`
/ `attend`; kernels without sinks (cuDNN prefill, the CUDA decode kernel) step aside for the ones
that have them (the torch backend and both Triton attention kernels).

`chunk` (Llama 4's chunked local attention) is per layer, like `window`: a query at position p sees only
the keys of its own chunk, (p // chunk) * chunk <= k <= p (0: no chunks). The torch backend masks it and
the Triton kernels take it as a lower bound on each query's keys; cuDNN prefill, the CUDA decode kernel
and the fused one-token path step aside for such layers. Blocks of chunks no query can see any more stay
allocated (the KV cache manager frees nothing early for them): only the attention is local.

`decode_path(layers, rope_rows)` is asked once when a model is built: the object that may run a
whole one-token step in fused kernels and that computes the logits (attention/decode_path.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from ferrox.attention.decode_path import DecodePath, OneTokenLayer
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.attention.metadata import AttentionMetadata
from ferrox.kernels import KERNEL_SETS, select_kernels


class AttentionBackend(ABC):
    name: str = "abstract"
    # Attention logit soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap) before
    # the softmax; 0 = none. Set once by the model that builds the backend (every layer shares it).
    softcap: float = 0.0
    # False where the model's layers differ in head_dim or KV heads (Gemma 4): the library prefill paths,
    # planned once for the first layer's shape, step aside for the Triton kernels, which take each layer's.
    uniform_heads: bool = True

    def begin_forward(self, meta: AttentionMetadata) -> None:  # noqa: B027 (optional hook)
        """Plan the step once per forward; backends without planning leave this empty."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] (or empty)
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVCacheScales | None = None,  # an FP8 cache's k/v scales (None: 1.0)
        *,
        window: int = 0,  # the layer's sliding window: keys p - window < k <= p for a query at p (0: all)
        sinks: torch.Tensor | None = None,  # the layer's attention sinks, float32 [H] (None: none)
        chunk: int = 0,  # the layer's attention chunk: keys (p // chunk) * chunk <= k <= p for a query at p (0: all)
    ) -> torch.Tensor:  # [T, H, D]
        ...

    # Backends that can attend over KV already in the cache (written by a fused projection
    # kernel, kernels/gemv.py) say so; the model then skips the separate KV write.
    supports_cached_kv = False

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               kv_scales: KVCacheScales | None = None, *, window: int = 0,
               sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
        """Attention only: this step's k/v are already at `meta.slot_mapping` in kv_cache."""
        raise NotImplementedError(f"the {self.name} attention backend has no attend-only path")

    def decode_path(self, layers: Sequence[OneTokenLayer] | None,
                    rope_rows: Callable[[torch.Tensor], torch.Tensor],
                    q_scale: Callable[[torch.Tensor], torch.Tensor] | None = None) -> DecodePath:
        """The decode path of a model built on this backend. layers: its decoder layers, or None when
        they do not fit a fused one-token path; rope_rows: positions -> float32 [cos | sin] rows;
        q_scale: positions -> float32 [T] factors multiplying each token's rotated queries (Ministral 3's
        llama_4 scaling: models/ministral3.py; None: 1). Backends without fused kernels return the
        general path (where the model's layers scale their queries themselves)."""
        return DecodePath()


def get_attention_backend(device: torch.device | str, name: str | None = None) -> AttentionBackend:
    """The backend for `device`: the Triton one on CUDA when Triton is installed, else the torch
    reference (`kernels.select_kernels` decides, as it does for the layers' ops).

    `name` ("torch" | "triton") forces a choice (tests use it to compare the two, and to run the
    Triton backend on CPU in the interpreter).
    """
    if name not in (None, *KERNEL_SETS):
        raise ValueError(f"attention backend {name!r} is unknown (choose 'torch' or 'triton')")
    if select_kernels(device, name) == "triton":
        from ferrox.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from ferrox.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend()
