"""OLMo 2 (allenai/OLMo-2-*: Olmo2ForCausalLM) and OLMoE (allenai/OLMoE-1B-7B: OlmoeForCausalLM).

Both families RMS-norm the WHOLE q and k projections before rotary (`q_norm` of num_heads * head_dim,
`k_norm` of num_kv_heads * head_dim: one variance over all heads, unlike Qwen3's per-head norms):
`FullQKNormAttention`, shared by the two, over Llama's projections and attention backend.

- OLMo 2: post-norms in place of pre-norms, as transformers' Olmo2DecoderLayer:
  h = h + post_attention_layernorm(attn(h)); h = h + post_feedforward_layernorm(mlp(h)) (no input norm).
- OLMoE: Qwen-MoE's pre-norm layers (MoeDecoderLayer) with the full-width q/k norms, softmax top-k
  routing renormalised as `norm_topk_prob` says (default false), no shared expert; and `clip_qkv`: q, k
  (after their norms) and v clamped to [-clip_qkv, clip_qkv], as transformers' OlmoeAttention does.

One-token decode steps take the general path (the fused kernels norm q/k per head: attention/
fused_decode.py); the backend's decode path keeps only the fused lm_head. Under tensor parallelism a rank holds
its heads' rows of q and k and of the norms' weights, and the norms' variance is every rank's sum of squares,
all-reduced (q's and k's in one [tokens, 2] reduction a layer; a KV head replicated over r ranks counted
once). Refused by name: config.json `sliding_window` (transformers' Olmo2 never applies one; its Olmoe applies any
config attribute of that name regardless of use_sliding_window, which no released checkpoint has),
`clip_qkv` for OLMo 2 (its transformers class ignores it), `mlp_bias` (the MLPs carry no bias in
transformers), and, for OLMoE, a head_dim other than hidden_size / num_attention_heads (its q_norm has
hidden_size weights). OLMo 2's GGUF files (llama.cpp's "olmo2") load dequantized (loader/gguf_families.py);
OLMoE's are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import even_split, kv_head_range, materialize
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.layer_stack import ResidualLayerStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM
from ferrox.models.moe import MoeBlock, MoeDecoderLayer, MoeForCausalLM, MoeModel
from ferrox.models.post_norm import PostNormDecoderLayer


def check_olmo_config(spec: ModelSpec, *, takes_clip_qkv: bool, windowed: bool = False) -> float | None:
    """The fields the OLMo families refuse (module docstring); the clip_qkv to apply, if any. windowed: the family
    has sliding-window layers (OLMo 3)."""
    config = spec.hf_config
    arch = spec.architecture
    if config.get("sliding_window") is not None and not windowed:
        raise UnsupportedModelError(f"config.json: sliding_window {config['sliding_window']!r} is not supported "
                                    f"for {arch} (transformers' OLMo models attend to the whole context)")
    if spec.mlp_bias:
        raise UnsupportedModelError(f"config.json: mlp_bias true is not supported for {arch} (its MLPs carry no "
                                    "bias in transformers)")
    clip = config.get("clip_qkv")
    if clip is None:
        return None
    if not takes_clip_qkv:
        raise UnsupportedModelError(f"config.json: clip_qkv {clip!r} is not supported for {arch} (transformers' "
                                    f"{arch} does not clamp q/k/v)")
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip <= 0:
        raise UnsupportedModelError(f"config.json: clip_qkv must be a positive number or null, got {clip!r}")
    return float(clip)


class NormShard(RMSNorm):
    """A rank's share of an RMSNorm over a whole q or k projection (tensor parallelism): the weights of its heads,
    `start` the first of them in the checkpoint's `full`; `copies`, the ranks holding each of its heads (a KV head
    replicated over ranks), which the all-reduced sum of squares counts that many times."""

    def __init__(self, start: int, size: int, full: int, copies: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str, ops: DeviceOps):
        super().__init__(size, eps, dtype, device, ops)
        self.start, self.full, self.copies = start, full, copies

    def load_weight(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        value = materialize(tensor)
        if tuple(value.shape) != (self.full,):
            raise ValueError(f"checkpoint shape {tuple(value.shape)}, model expects ({self.full},)")
        self.weight.data.copy_(value[self.start:self.start + self.size])

    def sharded(self, x: torch.Tensor, sum_of_squares: torch.Tensor) -> torch.Tensor:
        """x (this rank's rows) normalised by the whole projection's mean square (`sum_of_squares` [T, 1] over
        every rank, all-reduced), in float32, then times the weight in x's dtype (transformers' RMSNorm)."""
        scale = torch.rsqrt(sum_of_squares / (self.full * self.copies) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


class FullQKNormAttention(LlamaAttention):
    """Llama attention with RMSNorm over the whole q and k projections before rotary (OLMo 2, OLMoE), and
    an optional clamp of q, k, v (OLMoE's clip_qkv). Under tensor parallelism the norms' variance spans every
    rank's heads: one all-reduce of q's and k's sums of squares (module docstring)."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, q_norm_size: int, clip_qkv: float | None, window: int = 0):
        super().__init__(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias, o_bias=spec.attention_bias,
                         qk_norm=False, window=window)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if q_norm_size != spec.num_heads * spec.head_dim:
            raise UnsupportedModelError(f"config.json: head_dim {spec.head_dim} x num_attention_heads "
                                        f"{spec.num_heads} is not hidden_size {spec.hidden_size}, which "
                                        f"{spec.architecture}'s q_norm spans")
        self.tp = get_tp_group()
        if self.tp.size > 1:
            # (this rank's heads, as qkv_proj holds them: layers/linear.py QKVLinear)
            q_start = even_split(spec.num_heads, self.tp.size, self.tp.rank, "num_attention_heads")[0]
            kv_start = kv_head_range(spec.num_kv_heads, self.tp.size, self.tp.rank)[0]
            hd = self.head_dim
            self.q_norm = NormShard(q_start * hd, q_size, spec.num_heads * hd, 1, spec.rms_norm_eps, dtype,
                                    device, ops)
            self.k_norm = NormShard(kv_start * hd, kv_size, spec.num_kv_heads * hd,
                                    max(1, self.tp.size // spec.num_kv_heads), spec.rms_norm_eps, dtype, device, ops)
        else:
            self.q_norm = RMSNorm(q_size, spec.rms_norm_eps, dtype, device, ops)
            self.k_norm = RMSNorm(kv_size, spec.rms_norm_eps, dtype, device, ops)
        self.clip_qkv = clip_qkv

    def forward(self, x, rope: Rope, kv_cache, meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None  # (set in __init__; LlamaAttention types them optional)
        q, k = qkv[:, :q_size].contiguous(), qkv[:, q_size:q_size + kv_size].contiguous()
        if isinstance(q_norm, NormShard) and isinstance(k_norm, NormShard):
            squares = self.tp.all_reduce(torch.stack([q.float().square().sum(-1), k.float().square().sum(-1)], 1))
            q, k = q_norm.sharded(q, squares[:, :1]), k_norm.sharded(k, squares[:, 1:])
        else:
            q, k = q_norm(q), k_norm(k)
        v = qkv[:, q_size + kv_size:]
        if self.clip_qkv is not None:
            q, k, v = (part.clamp(-self.clip_qkv, self.clip_qkv) for part in (q, k, v))
        q, k = rope.rotate(q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim))
        o = self.backend.forward(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), kv_cache, meta, self.scale,
                                 self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


# ---- OLMo 2 ------------------------------------------------------------------------------------------
class Olmo2DecoderLayer(PostNormDecoderLayer):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__(spec, FullQKNormAttention(spec, backend, ops, dtype, device,
                                                   q_norm_size=spec.num_heads * spec.head_dim, clip_qkv=None),
                         ops, dtype, device)


class Olmo2Model(ResidualLayerStack):
    layer_class = Olmo2DecoderLayer  # (post-norm layers, full-width q/k norms: not what the fused kernels run)


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
    supports_tensor_parallel = True  # (the full-width q/k norms' variance all-reduced: FullQKNormAttention)
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_olmo_config(spec, takes_clip_qkv=False)
        super().__init__(spec, dtype, device, kernels=kernels)


# ---- OLMoE -------------------------------------------------------------------------------------------
class OlmoeDecoderLayer(MoeDecoderLayer):
    """MoeDecoderLayer (pre-norms, routed experts) with the full-width q/k-norm attention."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, renormalize: bool, clip_qkv: float | None):
        nn.Module.__init__(self)
        moe = spec.moe
        assert moe is not None  # MoeForCausalLM checked it
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        # transformers' OlmoeAttention: q_norm over hidden_size, k_norm over head_dim(hidden / heads) * kv heads.
        self.self_attn = FullQKNormAttention(spec, backend, ops, dtype, device, q_norm_size=spec.hidden_size,
                                             clip_qkv=clip_qkv)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mlp = MoeBlock(spec, moe, ops, dtype, device, renormalize=renormalize)


class OlmoeModel(MoeModel):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, renormalize: bool, **_: Any):
        nn.Module.__init__(self)
        clip_qkv = check_olmo_config(spec, takes_clip_qkv=True)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(OlmoeDecoderLayer(spec, backend, ops, dtype, device, renormalize=renormalize,
                                                      clip_qkv=clip_qkv) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        # (full-width q/k norms: not the per-head ones the fused one-token kernels run)
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: every layer sparse (transformers' Olmoe has no dense layers or shared expert)."""

    supports_tensor_parallel = True  # (the full-width q/k norms' variance all-reduced: FullQKNormAttention)
    model_class = OlmoeModel

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_olmo_config(spec, takes_clip_qkv=True)
        config = spec.hf_config
        for key, unset in (("shared_expert_intermediate_size", (None, 0)), ("mlp_only_layers", (None, [])),
                           ("decoder_sparse_step", (None, 1))):
            if config.get(key) not in unset:
                raise UnsupportedModelError(f"config.json: {key} {config[key]!r} is not supported for "
                                            "OlmoeForCausalLM (transformers' Olmoe has no shared or dense MLPs)")
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["FullQKNormAttention", "NormShard", "Olmo2ForCausalLM", "OlmoeForCausalLM", "check_olmo_config"]
