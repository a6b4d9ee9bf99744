"""Gemma 4 text (google/gemma-4-31B-it, 26B-A4B, E2B/E4B and their base checkpoints): Gemma 3's decoder
(models/gemma3.py: four norms a layer around attention and MLP, GELU-tanh MLP, sqrt(hidden) embedding scale,
q/k norms, sliding and full layers with their own RoPE) with these changes, as transformers' Gemma4 defines
them:

- every norm scales by its weight as stored (no 1 + w), in float32;
- values are RMS-normed per head too (no weight), and the scores are not scaled (scale 1: the q/k norms
  set their size); no attention soft cap; final_logit_softcapping caps the logits;
- full-attention layers have their own head_dim (global_head_dim, 512) and, with attention_k_eq_v, their own
  KV head count (num_global_key_value_heads) and no v_proj: the value is the key projection (before the key's
  norm and rotary), loaded here into both. Each layer's cache has its own shape (ModelSpec.layer_kv_shapes,
  attention/kv_cache.py);
- full layers rotate with "proportional" RoPE: partial_rotary_factor of the head's pairs turn, with the
  frequencies of the whole head_dim, the rest not at all (frequency 0), in the NeoX layout over the whole head;
- each layer's output is multiplied by its layer_scalar (a checkpoint tensor);
- MoE (26B-A4B, enable_moe_block): beside the dense MLP, a router (weightless RMSNorm, * scale / sqrt(hidden),
  softmax over all experts, top-k renormalised, times per_expert_scale) picks experts of GELU-tanh gated MLPs
  from the same residual; the two outputs are normed apart (post_feedforward_layernorm_1 / _2) and summed.
  The experts are a FusedMoE (layers/fused_moe.py, activation GeluTanh) given the router's weights and ids;
  the checkpoint's stacked experts.gate_up_proj [E, 2I, H] (gate rows, then up) and experts.down_proj
  [E, H, I] are its w13 and w2 as they stand (FusedMoE.load_stacked);
- per-layer embeddings (E2B/E4B, hidden_size_per_layer_input): a second embedding table of
  hidden_size_per_layer_input per layer, mixed with a projection of the token embedding, gates a residual
  add at the end of every layer;
- KV sharing (E2B/E4B, num_kv_shared_layers): the last layers compute no keys or values and attend over the
  cache of the last earlier layer of their type (ModelSpec.layer_kv_shapes gives their own caches one
  element a token: nothing is written there); use_double_wide_mlp doubles their MLP.

Device paths: every step takes the general path (no fused one-token kernels: the four-norm layer is not the
pre-norm shape they fuse). On the Triton set the attention is the Triton kernels' for every layer (the
cuDNN / FlashAttention-3 long-prefill paths are planned for one head shape and step aside:
AttentionBackend.uniform_heads); q/k norms and rotary are one kernel for head_dim <= 256 (the sliding
layers), torch ops for the 512-wide global heads. The experts run the fused MoE kernels with their GELU-tanh
epilogue (kernels/fused_moe.py: the matrix-vector path for a few decode tokens, the grouped GEMMs past that),
routed in one launch (route_top_k), with nothing read back on the host, so an MoE checkpoint's decode steps
replay CUDA graphs like the dense ones; on the torch set (CPU) FusedMoE's per-expert loop runs them (it reads
each expert's token count on the host: the CPU path and the kernels' reference only).

Tensor parallelism, as vLLM shards Gemma 4: each layer's q/k/v by heads, the sliding layers' KV heads and the
full layers' own (num_global_key_value_heads) each split over the ranks, or replicated where the ranks
outnumber them (QKVLinear), so each layer's cache holds this rank's heads of its own shape (kv_cache_shape); a
KV-sharing layer's queries split the same way, over the heads its source layer's rank holds. o_proj and the
MLPs' down projections are row-parallel (one all-reduce each); the experts' intermediate rows are sharded, or
with --enable-expert-parallel whole experts split (FusedMoE), the router replicated (per_expert_scale is
applied by global expert id before FusedMoE maps the ids to its own); the token and per-layer embedding tables
and the LM head are vocabulary-parallel; the per-layer input projections, every norm and the layer
scalars are replicated; the final soft cap applies to the gathered logits. Refused by name: quantized
checkpoints, GGUF, bidirectional attention ("all").

LoRA: the attention and dense MLP projections as the Llama family's (an attention_k_eq_v layer's k_proj adapter
adapts its value rows too, as transformers' value is that projection: lora_rewrite); the MoE layers' experts
(lora/moe.py: the GELU-tanh over gate | up rows with each pair's delta added, as the layer runs them) one module
per expert (`model.layers.{i}.experts.{e}.gate_proj / up_proj / down_proj`, vLLM's `moe.experts.{e}` path too) or
in PEFT's target_parameters format (`experts.gate_up_proj` / `experts.down_proj`), an adapter of the multimodal
checkpoint under `model.language_model.` read as the text model's (lora/moe_targets.py). Their input is
pre_feedforward_layernorm_2's output for the base experts and the adapter alike; per_expert_scale scales the routing
weight, which weighs the adapter's down delta as the base product.

Images and videos (Gemma4ForConditionalGeneration, at the end): the vision tower and embedder of
models/vision/gemma4_vision.py, each image's rows in place of its soft tokens (multimodal/gemma4_processing.py), a
video's frames each an image of its own (multimodal/gemma4_video.py), an image's (a frame's) tokens attending to each
other both ways on the sliding layers where use_bidirectional_attention is "vision". Audio (E2B / E4B: an
audio_config): the conformer and embedder of models/vision/gemma4_audio.py, each clip's rows in place of its audio
soft tokens (multimodal/gemma4_audio_processing.py), its tokens causal as text (transformers' bidirectional
overlay is for vision tokens only), so a clip may be cut over prefill chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import even_split, kv_head_range, materialize
from ferrox.layers.fused_moe import FusedMoE, GeluTanh
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, MergedLinear, QKVLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.gemma2 import GemmaMLP, check_gelu_tanh, embedding_normalizer
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.load_check import load_whole
from ferrox.multimodal.inputs import MultiModalItem

logger = logging.getLogger(__name__)

_SLIDING, _FULL = "sliding_attention", "full_attention"


def kv_sources(config: dict[str, Any], num_layers: int) -> list[int]:
    """For each layer, the layer whose KV cache it attends over: itself, or for the last num_kv_shared_layers
    layers the last earlier unshared layer of the same type (transformers' kv_sharing_modes)."""
    types = config["layer_types"]
    shared = int(config.get("num_kv_shared_layers") or 0)
    first = num_layers - shared
    if shared and first <= 0:
        raise UnsupportedModelError("config.json: num_kv_shared_layers covers every layer: no layer writes a KV "
                                    "cache for them to share (Gemma 4)")
    sources = list(range(num_layers))
    for i in range(first, num_layers):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedModelError(f"config.json: layer {i} ({types[i]}) shares the KV cache of an earlier "
                                        "layer of its type, and there is none (num_kv_shared_layers)")
        sources[i] = earlier[-1]
    return sources


def _rotary(config: dict[str, Any], layer_type: str, head_dim: int, device: torch.device | str,
            ops: DeviceOps) -> RotaryEmbedding:
    """The RoPE of one layer type, from rope_parameters[layer_type] ("proportional": partial_rotary_factor of
    the pairs turn at the whole head's frequencies, divided by `factor`; the rest get frequency 0)."""
    params = dict((config.get("rope_parameters") or {}).get(layer_type) or {})
    theta = float(params.pop("rope_theta", 10_000.0 if layer_type == _SLIDING else 1_000_000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "proportional":
        return RotaryEmbedding(head_dim, theta, params if kind != "default" else None, device, ops)
    rotary = RotaryEmbedding(head_dim, theta, None, device, ops)
    turning = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    with torch.no_grad():
        rotary.inv_freq[turning:] = 0.0
        rotary.inv_freq /= float(params.get("factor", 1.0))
    return rotary


class _Weight(nn.Module):
    """One checkpoint tensor under its name (the router's projection: float, never quantized or sharded)."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape, dtype=dtype, device=device), requires_grad=False)


class Gemma4Attention(nn.Module):
    v_norm_weight: torch.Tensor  # a registered (non-persistent) buffer of ones: the value norm has no weight

    def __init__(self, spec: ModelSpec, layer: int, source: int, backend: AttentionBackend, ops: DeviceOps,
                 dtype: torch.dtype, device: torch.device | str):
        """source: the layer whose cache this one attends over (itself unless it shares another's)."""
        super().__init__()
        config = spec.hf_config
        kv_heads, self.head_dim = spec.kv_shape_of(source)
        self.window = spec.window_of(layer)
        self.shares_kv = source != layer
        self.k_eq_v = bool(config.get("attention_k_eq_v")) and config["layer_types"][layer] == _FULL
        bias = spec.attention_bias
        if self.shares_kv:  # queries only
            self.qkv_proj: MergedLinear = MergedLinear(spec.hidden_size, {"q": spec.num_heads * self.head_dim},
                                                       bias=bias, dtype=dtype, device=device)
            # This rank's query heads (the q rows split evenly are whole heads) over the KV heads its rank of the
            # source layer holds: the heads QKVLinear gives that layer's rank.
            tp = get_tp_group()
            self.num_heads = even_split(spec.num_heads, tp.size, tp.rank, "num_attention_heads")[1]
            self.num_kv_heads = kv_head_range(kv_heads, tp.size, tp.rank)[1]
        else:
            qkv = QKVLinear(spec.hidden_size, spec.num_heads, kv_heads, self.head_dim, bias=bias, dtype=dtype,
                            device=device)
            self.qkv_proj = qkv
            self.num_heads, self.num_kv_heads = qkv.num_heads, qkv.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * self.head_dim, spec.hidden_size, bias=bias, dtype=dtype,
                                        device=device)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops)
        self.k_norm = None if self.shares_kv else RMSNorm(self.head_dim, spec.rms_norm_eps, dtype, device, ops)
        self.register_buffer("v_norm_weight", torch.ones(self.head_dim, dtype=dtype, device=device), persistent=False)
        self.eps = spec.rms_norm_eps
        self.ops = ops
        self.backend = backend
        self.kv_scales = KVCacheScales(device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: Any,
                shared: dict[int, tuple[torch.Tensor, torch.Tensor]], index: int,
                source: int) -> torch.Tensor:
        """shared: this step's (k, v) by layer, for the layers that share them (filled by their sources)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.shares_kv or self.k_norm is None:
            q = self.ops.rms_norm(qkv.reshape(t * self.num_heads, self.head_dim), self.q_norm.weight, self.eps)
            q, _ = rope.rotate(q.view(t, self.num_heads, self.head_dim), q.new_zeros(t, 1, self.head_dim))
            # The source layer's k and v of this step, written again to the same slots (no change) as the
            # backend attends over its cache.
            k, v = shared[source]
        else:
            q, k = rope.norm_rotate_qk(qkv, self.num_heads, self.num_kv_heads, self.q_norm.weight,
                                       self.k_norm.weight, self.eps)
            v = qkv[:, q_size + kv_size:].reshape(t * self.num_kv_heads, self.head_dim)
            v = self.ops.rms_norm(v, self.v_norm_weight, self.eps).view(t, self.num_kv_heads, self.head_dim)
            shared[index] = (k, v)
        o = self.backend.forward(q, k, v, kv_cache, meta, 1.0, self.kv_scales, window=self.window)
        return self.o_proj(o.reshape(t, q_size))


class Gemma4Router(nn.Module):
    """transformers' Gemma4TextRouter: logits of the weightless-RMS-normed residual times scale / sqrt(hidden);
    softmax (float32) over all experts, top-k, renormalised (the experts' `route`: one launch on the Triton
    set), times each chosen expert's per_expert_scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.proj = _Weight(num_experts, hidden, dtype=dtype, device=device)
        self.scale = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts, dtype=dtype, device=device), requires_grad=False)
        self.top_k, self.eps, self.root = top_k, eps, hidden ** -0.5

    def forward(self, x: torch.Tensor, experts: FusedMoE) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights float32 [T, k], expert ids int64 [T, k]) for `experts`, on the device: no host sync."""
        xf = x.float()
        h = (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).to(x.dtype)
        logits = F.linear(h * self.scale * self.root, self.proj.weight)
        weights, ids = experts.route(logits, self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids], ids


# The checkpoint's stacked expert tensors (transformers' Gemma4TextExperts) -> FusedMoE's, the same layout.
_STACKED_EXPERTS = {"gate_up_proj": "w13", "down_proj": "w2"}


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int, source: int, backend: AttentionBackend, ops: DeviceOps,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        config = spec.hf_config

        def norm(size: int = spec.hidden_size) -> RMSNorm:
            return RMSNorm(size, spec.rms_norm_eps, dtype, device, ops)

        self.index, self.source = layer, source
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = Gemma4Attention(spec, layer, source, backend, ops, dtype, device)
        wide = 2 if config.get("use_double_wide_mlp") and source != layer else 1
        self.mlp = GemmaMLP(dataclasses.replace(spec, intermediate_size=spec.intermediate_size * wide), dtype, device)
        self.router: Gemma4Router | None = None
        self.experts: FusedMoE | None = None
        if config.get("enable_moe_block"):
            moe = spec.moe
            if moe is None:
                raise UnsupportedModelError("config.json: enable_moe_block needs num_experts and top_k_experts")
            self.router = Gemma4Router(spec.hidden_size, moe.num_experts, moe.num_experts_per_tok, spec.rms_norm_eps,
                                       dtype, device)
            self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype,
                                    device=device, ops=ops, activation=GeluTanh())
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()
        per_layer = int(config.get("hidden_size_per_layer_input") or 0)
        if per_layer:
            self.per_layer_input_gate = Linear(spec.hidden_size, per_layer, bias=False, dtype=dtype, device=device)
            self.per_layer_projection = Linear(per_layer, spec.hidden_size, bias=False, dtype=dtype, device=device)
            self.post_per_layer_input_norm = norm()
        self.per_layer = per_layer
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: Any,
                shared: dict[int, tuple[torch.Tensor, torch.Tensor]],
                per_layer_input: torch.Tensor | None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, shared, self.index, self.source)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None and self.experts is not None:
            weights, ids = self.router(x, self.experts)
            routed = self.experts(self.pre_feedforward_layernorm_2(x), weights, ids)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        super().__init__()
        config = spec.hf_config
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.normalizer = embedding_normalizer(spec.hidden_size, dtype)
        self.sources = kv_sources(config, spec.num_layers)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(spec, i, self.sources[i], backend, ops, dtype, device)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.types = list(config["layer_types"])
        sliding_dim = next((spec.kv_shape_of(i)[1] for i, t in enumerate(self.types) if t == _SLIDING), spec.head_dim)
        full_dim = next(spec.kv_shape_of(i)[1] for i, t in enumerate(self.types) if t == _FULL)
        self.rotary_local = _rotary(config, _SLIDING, sliding_dim, device, ops)
        self.rotary = _rotary(config, _FULL, full_dim, device, ops)
        self.per_layer = int(config.get("hidden_size_per_layer_input") or 0)
        if self.per_layer:
            width = spec.num_layers * self.per_layer
            vocab = int(config.get("vocab_size_per_layer_input") or spec.vocab_size)
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, width, dtype=dtype, device=device)
            self.per_layer_normalizer = embedding_normalizer(self.per_layer, dtype)
            self.per_layer_model_projection = Linear(spec.hidden_size, width, bias=False, dtype=dtype, device=device)
            self.per_layer_projection_norm = RMSNorm(self.per_layer, spec.rms_norm_eps, dtype, device, ops)
            self.projection_scale = spec.hidden_size ** -0.5
        # Gemma4ForConditionalGeneration: its image / video / audio token ids, embedded as the pad token (transformers
        # looks both tables up with those ids swapped for pad_token_id; an image's rows then replace its own).
        self.mm_token_ids: tuple[int, ...] = ()
        self.pad_token_id = int(config.get("pad_token_id") or 0)
        self.backend = backend
        self.qk_norm = True
        self.one_token_layers = None  # (the four-norm layer is not the pre-norm shape the fused path takes)
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(self.text_ids(input_ids)) * self.normalizer

    def text_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids the embedding tables are looked up with: media tokens as the pad token (mm_token_ids)."""
        if not self.mm_token_ids:
            return input_ids
        media = input_ids == self.mm_token_ids[0]
        for token in self.mm_token_ids[1:]:
            media = media | (input_ids == token)
        return torch.where(media, self.pad_token_id, input_ids)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, layers, hidden_size_per_layer_input]: the per-layer embedding of each token mixed with a
        projection of its embedding (transformers' get_per_layer_inputs + project_per_layer_inputs)."""
        t, n = h.shape[0], len(self.layers)
        projected = self.per_layer_model_projection(h) * self.projection_scale
        projected = self.per_layer_projection_norm(projected.reshape(t * n, self.per_layer)).view(t, n, self.per_layer)
        table = self.embed_tokens_per_layer(self.text_ids(input_ids)) * self.per_layer_normalizer
        table = table.view(t, n, self.per_layer)
        return (projected + table) * (2.0 ** -0.5)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = self.per_layer_inputs(input_ids, h) if self.per_layer else None
        rope_full = self.rotary(positions, h.dtype)
        rope_local = self.rotary_local(positions, h.dtype) if _SLIDING in self.types else rope_full
        shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # An image's tokens attend to each other both ways on the sliding layers only (transformers'
        # create_masks_for_vision_model); the full layers stay causal. (On the torch backend each switch between
        # the two re-plans the step's masks: image steps only.)
        causal = dataclasses.replace(meta, bidirectional=None) if getattr(meta, "bidirectional", None) else meta
        for i, layer in enumerate(self.layers):
            sliding = self.types[i] == _SLIDING
            h = layer(h, rope_local if sliding else rope_full, kv_caches[self.sources[i]], meta if sliding else causal,
                      shared, per_layer[:, i] if per_layer is not None else None)
        return self.norm(h)


class Gemma4ForCausalLM(LlamaForCausalLM):
    model_class = Gemma4Model
    # Every layer kind sharded (module docstring); tested with gloo on CPU (tests/models/test_gemma4_tp.py).
    supports_tensor_parallel = True
    supports_quantized_gguf = False
    supports_quantization = False

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        check_gelu_tanh(spec)
        if config.get("use_bidirectional_attention") == "all":
            raise UnsupportedModelError("config.json: use_bidirectional_attention 'all' is not supported for "
                                        f"{spec.architecture}: ferrox's attention is causal")
        if "layer_types" not in config or "gemma4_layer_kv" not in config:
            raise UnsupportedModelError(f"{spec.architecture}: config.json's model_type must be gemma4_text "
                                        "(the loader reads Gemma 4's per-layer shapes from it)")
        super().__init__(dataclasses.replace(spec, attention_scale=1.0), dtype, device, kernels=kernels)
        self.backend.uniform_heads = len(set(spec.layer_kv_shapes)) <= 1
        # CUDA graphs for the MoE checkpoint too: its experts route and run on the device with nothing read back
        # on the host (FusedMoE's kernels sort the pairs by expert on the device, or read each pair's expert
        # directly), where the per-expert loop they ran before counted each expert's tokens on the host and so
        # kept every step eager.
        self.supports_cuda_graphs = True
        # The experts load themselves (load_weights: FusedMoE.load_stacked), not by parameter name.
        self.own_weight_prefixes = tuple(f"model.layers.{i}.experts." for i, layer in enumerate(self.model.layers)
                                         if layer.experts is not None)
        self.final_softcap = float(config.get("final_logit_softcapping") or 0.0)
        # (multimodal/prompt_embeds.py: the per-layer table is looked up by the prompt's token ids)
        self.prompt_embeds_problem = ("its per-layer embeddings (hidden_size_per_layer_input) are looked up by the "
                                      "prompt's token ids" if self.model.per_layer else None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_softcap:
            logits = self.final_softcap * torch.tanh(logits / self.final_softcap)
        return logits

    def _k_eq_v_prefixes(self) -> set[str]:
        """attention_k_eq_v: the full layers' value projection is their key projection (the prefixes of their
        k_proj tensors)."""
        return {f"model.layers.{i}.self_attn.k_proj." for i, layer in enumerate(self.model.layers)
                if layer.self_attn.k_eq_v and not layer.self_attn.shares_kv}

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs in this model's rows (lora/rewrite.py): an attention_k_eq_v
        layer's k_proj B is its v rows' too, as load_weights loads the key weight into both (transformers' value is
        that layer's key projection, its adapter's delta included); every other pair as it is."""
        k_eq_v = self._k_eq_v_prefixes()
        for name, tensor in pairs:
            yield name, tensor
            head, sep, leaf = name.rpartition("k_proj.")
            if sep and head + sep in k_eq_v:
                yield f"{head}v_proj.{leaf}", tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        k_eq_v = self._k_eq_v_prefixes()
        shared = {f"model.layers.{i}.self_attn.{p}_" for i, layer in enumerate(self.model.layers)
                  if layer.self_attn.shares_kv for p in ("k", "v")}
        experts = {f"model.layers.{i}.experts": layer.experts for i, layer in enumerate(self.model.layers)
                   if layer.experts is not None}
        loaded_experts: set[str] = set()

        def renamed() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name.startswith(tuple(shared)) and ".self_attn." in name:
                    continue  # a KV-sharing layer's (unused) k/v projections and norms, as transformers skips them
                prefix, _, leaf = name.rpartition(".")
                if prefix in experts and leaf in _STACKED_EXPERTS:
                    try:
                        experts[prefix].load_stacked(_STACKED_EXPERTS[leaf], tensor)  # (a rank reads its part)
                    except ValueError as e:
                        raise ModelLoadError(f"tensor {name!r}: {e} (config.json does not match the weights?)") from e
                    loaded_experts.add(name)
                    continue
                yield name, tensor
                head, sep, leaf = name.rpartition("k_proj.")
                if sep and head + sep in k_eq_v:
                    yield f"{head}v_proj.{leaf}", tensor

        super().load_weights(renamed())
        missing = {f"{prefix}.{leaf}" for prefix in experts for leaf in _STACKED_EXPERTS} - loaded_experts
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(sorted(missing)[:8])}")


_TOWER, _EMBEDDER = "model.vision_tower.", "model.embed_vision."
_AUDIO_TOWER, _AUDIO_EMBEDDER = "model.audio_tower.", "model.embed_audio."
AUDIO_MODALITY = "audio"
# Gemma4Config's media token ids (image, video, audio), where config.json leaves them out.
_MEDIA_TOKENS = {"image_token_id": 258_880, "video_token_id": 258_884, "audio_token_id": 258_881}


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """gemma-4-*-it as published: the language model of the multimodal checkpoint (text_config over
    Gemma4TextConfig's defaults: loader/model_config.py), the vision tower and its embedder
    (models/vision/gemma4_vision.py). Each image is its soft tokens' rows in place of its `<|image|>` run
    (multimodal/gemma4_processing.py: a count that depends on the image's size); a video is its frames, each an
    item of modality "video" that the same tower and embedder take as an image (multimodal/gemma4_video.py: its
    `<|video|>` runs between timestamps); with text_config's use_bidirectional_attention "vision" an image's (a
    frame's) tokens attend to each other both ways on the sliding layers (AttentionMetadata.bidirectional; the full
    layers stay causal), so the scheduler computes each image (frame) in one step. The media tokens (image, video,
    audio) embed as the pad token, as transformers swaps them (in both tables where there are per-layer embeddings:
    Gemma4Model.text_ids). Under tensor parallelism the tower and embedder load whole on every rank (the tower's
    layers then sharded under --mm-encoder-tp-mode weights: models/vision/encoder_setup.py) and each rank embeds
    its requests' images (worker/rank_images.py). With an audio_config (E2B / E4B) the audio tower and its embedder
    (models/vision/gemma4_audio.py) embed each clip, an item of modality "audio" whose rows replace its `<|audio|>`
    run (multimodal/gemma4_audio_processing.py); its tokens stay causal (no atomic span: a clip may be cut over
    prefill chunks, its rows kept until the prefill passes it, as an image's). Without one, audio is refused by name
    (multimodal/chat_parts.py, engine/input_processor.py, worker/multimodal.py)."""

    takes_images = True
    takes_videos = True  # (each frame an item the tower takes as an image)
    takes_audio = True  # (this instance: False without an audio_config)

    @staticmethod
    def takes_audio_of(hf_config: Any) -> bool:
        """Whether a checkpoint of this config has an audio tower (models/vision/encoder_setup.py text_only_model)."""
        return (hf_config.get("multimodal") or {}).get("audio_config") is not None

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        from ferrox.models.vision.encoder_setup import modality_skipped, vision_device
        from ferrox.models.vision.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower

        super().__init__(spec, dtype, device, kernels=kernels)
        mm = spec.hf_config.get("multimodal") or {}
        self.model.mm_token_ids = tuple(int(mm.get(key) or default) for key, default in _MEDIA_TOKENS.items())
        self.bidirectional_images = spec.hf_config.get("use_bidirectional_attention") == "vision"
        vision = mm.get("vision_config")
        if vision is None:  # (Gemma4Config's vision_config is optional: such a checkpoint takes no images)
            self.takes_images = self.takes_videos = False  # type: ignore[misc]
        else:
            self.vision_tower = Gemma4VisionTower(vision, dtype=dtype, device=vision_device(device))
            self.embed_vision = Gemma4VisionEmbedder(self.vision_tower.hidden_size, spec.hidden_size,
                                                     self.vision_tower.eps, dtype, vision_device(device))
            self.own_weight_prefixes = (*self.own_weight_prefixes, "vision_tower.", "embed_vision.")
        audio = mm.get("audio_config")
        if audio is None or modality_skipped("audio"):  # (no tower, or --limit-mm-per-prompt audio 0: vLLM's rule)
            self.takes_audio = False  # type: ignore[misc]
        else:
            from ferrox.models.vision.gemma4_audio import Gemma4AudioEmbedder, Gemma4AudioTower

            # (on the vision device: --language-model-only leaves it unbuilt with the vision side)
            self.audio_tower = Gemma4AudioTower(audio, dtype=dtype, device=vision_device(device))
            self.embed_audio = Gemma4AudioEmbedder(self.audio_tower.output_dims, spec.hidden_size,
                                                   self.audio_tower.eps, dtype, vision_device(device))
            self.own_weight_prefixes = (*self.own_weight_prefixes, "audio_tower.", "embed_audio.")

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image (or video frame, or audio clip) item for this model (worker/multimodal.py
        check_items), or None."""
        if item.modality == AUDIO_MODALITY:
            return self._check_audio_item(item)
        if item.grid is None or len(item.grid) != 2 or min(item.grid) < 1:
            return "no (rows, cols) patch grid"
        rows, cols = item.grid
        tower = self.vision_tower
        problem = tower.check_grid(rows, cols)
        if problem:
            return problem
        tokens = rows * cols // tower.pooling_kernel_size**2
        if item.length != tokens:
            return f"{item.length} placeholder tokens for a {item.grid} grid (it takes {tokens})"
        if list(item.shape) != [rows * cols, 3 * tower.patch_size**2]:
            return f"pixels {list(item.shape)}, the grid {item.grid} takes {[rows * cols, 3 * tower.patch_size**2]}"
        return None

    def _check_audio_item(self, item: MultiModalItem) -> str | None:
        from ferrox.models.vision.gemma4_audio import Gemma4AudioTower, audio_tokens

        tower = getattr(self, "audio_tower", None)
        if not isinstance(tower, Gemma4AudioTower):  # (no audio_config, or --language-model-only left it unbuilt)
            return "the model takes no audio (no audio tower is loaded)"
        problem = tower.check_features(list(item.shape))
        if problem:
            return problem
        tokens = audio_tokens(item.shape[0])
        if item.length != tokens:
            return f"{item.length} placeholder tokens for {item.shape[0]} log-mel frames (they give {tokens})"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: the tower and embedder over the image's (the video frame's) patches, or the audio
        tower and its embedder over a clip's log-mel frames."""
        if item.modality == AUDIO_MODALITY:
            return self.embed_audio(self.audio_tower(item.pixel_values().to(device)))
        assert item.grid is not None  # check_image_item
        rows, cols = item.grid
        return self.embed_vision(self.vision_tower(item.pixel_values().to(device), (rows, cols)))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tower: list[tuple[str, Any]] = []
        embedder: dict[str, torch.Tensor] = {}
        audio_tower: list[tuple[str, Any]] = []
        audio_embedder: dict[str, torch.Tensor] = {}
        vision = getattr(self, "vision_tower", None) is not None
        audio = getattr(self, "audio_tower", None) is not None

        def language_model() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if (not vision and name.startswith((_TOWER, _EMBEDDER))) or (
                        not audio and name.startswith((_AUDIO_TOWER, _AUDIO_EMBEDDER))):
                    continue  # (a tower the config leaves out is not built: its tensors are not read)
                if name.startswith(_AUDIO_TOWER):
                    audio_tower.append((name[len(_AUDIO_TOWER):], tensor))
                elif name.startswith(_AUDIO_EMBEDDER):
                    audio_embedder[name[len(_AUDIO_EMBEDDER):]] = materialize(tensor)
                elif name.startswith(_TOWER):
                    tower.append((name[len(_TOWER):], tensor))
                elif name.startswith(_EMBEDDER):
                    embedder[name[len(_EMBEDDER):]] = materialize(tensor)
                elif name.startswith("model.language_model."):
                    yield "model." + name[len("model.language_model."):], tensor
                elif name == "lm_head.weight" and self.lm_head is None:
                    continue
                else:
                    yield name, tensor

        super().load_weights(language_model())
        if vision:
            self.vision_tower.load_weights((name, materialize(t)) for name, t in tower)
            load_whole(self.embed_vision, embedder, "model.embed_vision", self.spec.architecture)
        if audio:
            self.audio_tower.load_weights((name, materialize(t)) for name, t in audio_tower)
            load_whole(self.embed_audio, audio_embedder, "model.embed_audio", self.spec.architecture)
