"""Llama 4 text models (Scout: 16 experts in every layer; Maverick: 128 experts every other layer), as
transformers' Llama4ForCausalLM defines them; Llama4ForConditionalGeneration serves its language model
(weights under `language_model.`; the loader reads text_config) and builds no vision tower, so a request
with an image is refused by name (engine/input_processor.py: the model takes no images).

What differs from the Llama decoder:
- Attention kinds per layer. `no_rope_layers[i]` 1 rotates q and k (RoPE layers), 0 leaves them unrotated
  (NoPE layers). The RoPE layers attend within chunks of `attention_chunk_size` tokens (a query at p sees
  keys (p // C) * C <= k <= p; `layer_types` "chunked_attention", which transformers derives so when the
  config leaves it out) and, with `use_qk_norm`, RMS-norm q and k without a weight after rotary. The NoPE
  layers attend over the whole context, their queries scaled by
  log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1 when `attn_temperature_tuning`.
- RoPE pairs interleaved dims (2j, 2j + 1), where Llama's turns halves (j, j + D/2). Loading reorders each
  q and k head's rows into the half layout (evens, then odds): q.k is unchanged by the same permutation of
  both, as are the weightless q/k norm and the temperature scale, so every rotary kernel applies as is.
- MoE layers every `interleave_moe_layer_step` layers (or those `moe_layers` lists), the others a dense MLP
  of `intermediate_size_mlp`. The router takes the top-k logits through a sigmoid, and that score multiplies
  the expert's input, not its output; an always-on shared expert of `intermediate_size` is added. With top-1
  (every released checkpoint) x * score runs through the fused experts with weight 1; top-k > 1 is refused.
  Experts are stored stacked: gate_up_proj [E, H, 2I] and down_proj [E, I, H] (transposed on load).

Tensor parallelism shards as the Llama and MoE stacks do (heads, dense MLPs and the shared expert by rows /
columns; the experts by their intermediate rows, or whole experts with expert parallelism); the q/k row
reorder stays inside each head, so a rank's heads are whole. Tested with gloo on two CPU ranks.

LoRA: adapters' q_proj / k_proj lora_B rows are reordered as the weights' (`lora_rewrite`, lora/rewrite.py); the
attention, the dense layers' MLPs and the MoE layers' shared expert take adapters one module per projection, the
routed experts in PEFT's target_parameters format only (`feed_forward.experts.gate_up_proj / down_proj`, unpacked
per expert by lora/expert_params.py; lora/moe_targets.py). The experts' LoRA input is the score-scaled x the
experts run on, as in transformers (the router's sigmoid scales the experts' input, the adapters' delta included).

Not here: the fused one-token decode path (its MoE routes by softmax top-k; one-token steps run the general
layers, with the same attention kernels), quantized checkpoints (refused by the loader).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.distributed.sharding import experts_transposed, materialize
from ferrox.layers.fused_moe import FusedMoE, TopKRouter, experts_with_shared
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, QKVLinear, RowParallelLinear
from ferrox.layers.ops import NO_ROPE, DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaMLP, load_dense_tensor, load_kv_scale
from ferrox.models.load_check import check_all_loaded
from ferrox.models.moe import MoeForCausalLM

_MERGED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
# The stacked experts' tensors -> FusedMoE's stacked parameter (transposed from [E, in, out] to [E, out, in]).
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}
# A Llama4ForConditionalGeneration's parts ferrox does not build (served text-only).
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")

_QK_WEIGHT = (".self_attn.q_proj.weight", ".self_attn.k_proj.weight")


@dataclasses.dataclass(frozen=True, slots=True)
class Llama4Layout:
    """Each layer's kind, read from the config as transformers reads it."""

    rotary: tuple[bool, ...]  # no_rope_layers: True rotates q and k
    chunk: tuple[int, ...]  # the attention chunk of each layer (0: the whole context)
    moe: tuple[bool, ...]  # a routed-experts layer (else a dense MLP of intermediate_size_mlp)


def _int_list(config: dict[str, Any], key: str, num_layers: int | None = None) -> list[int] | None:
    value = config.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value) or (
            num_layers is not None and len(value) != num_layers):
        size = f" of {num_layers}" if num_layers is not None else ""
        raise ModelLoadError(f"config.json: field {key!r} must be a list{size} integers, got {value!r}")
    return value


def llama4_layout(config: dict[str, Any], num_layers: int, max_len: int) -> Llama4Layout:
    """Layer kinds; max_len: the longest context served (a chunk at least that long limits nothing, so
    the layer keeps the unchunked kernels)."""
    flags = _int_list(config, "no_rope_layers", num_layers)
    if not flags:  # (transformers: an empty list too) every no_rope_layer_interval-th layer is NoPE
        interval = int(config.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if any(f not in (0, 1) for f in flags):
        raise ModelLoadError(f"config.json: no_rope_layers must hold 0 or 1 per layer, got {flags!r}")
    rotary = tuple(bool(f) for f in flags)
    chunk_size = config.get("attention_chunk_size")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ModelLoadError(f"config.json: attention_chunk_size must be a positive integer or null, got {chunk_size!r}")
    types = config.get("layer_types")
    if types is None:
        types = ["chunked_attention" if r and chunk_size is not None else "full_attention" for r in rotary]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(f"config.json: layer_types must list one type per layer ({num_layers}), got {types!r}")
    unknown = set(types) - {"chunked_attention", "full_attention"}
    if unknown:
        raise UnsupportedModelError(f"config.json: layer_types {sorted(unknown)} are not supported by Llama 4 "
                                    "(chunked_attention, full_attention)")
    if "chunked_attention" in types and chunk_size is None:
        raise ModelLoadError("config.json: layer_types names chunked_attention layers but attention_chunk_size "
                             "is null")
    served_chunk = chunk_size if chunk_size is not None and chunk_size < max_len else 0
    chunk = tuple(served_chunk if t == "chunked_attention" else 0 for t in types)
    moe_layers = _int_list(config, "moe_layers")
    if moe_layers is None:
        step = int(config.get("interleave_moe_layer_step", 1))
        if step < 1:
            raise ModelLoadError(f"config.json: interleave_moe_layer_step must be >= 1, got {step}")
        moe_layers = list(range(step - 1, num_layers, step))
    return Llama4Layout(rotary, chunk, tuple(i in moe_layers for i in range(num_layers)))


def interleaved_to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows [heads * D, ...] of a q or k projection with each head's dims reordered from interleaved
    rotary pairs (2j, 2j + 1) to halves (j, j + D/2): evens first, then odds."""
    rows = weight.shape[0]
    return weight.reshape(rows // head_dim, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama 4's q/k norm (Llama4TextL2Norm): x / rms(x) over each head, in float32, no weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Llama4Attention(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, dtype, device, *, rotary: bool, chunk: int):
        super().__init__()
        config = spec.hf_config
        self.head_dim = spec.head_dim
        self.scale = self.head_dim ** -0.5
        self.rotary, self.chunk = rotary, chunk
        self.qk_norm = rotary and bool(config.get("use_qk_norm", True))
        self.eps = spec.rms_norm_eps
        bias = spec.attention_bias
        self.qkv_proj = QKVLinear(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, bias=bias,
                                  dtype=dtype, device=device)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=bias, dtype=dtype,
                                        device=device)
        self.backend = backend
        self.kv_scales = KVCacheScales(device)

    def forward(self, x, rope: Rope, q_scale: torch.Tensor | None, kv_cache, meta):
        """q_scale: [T] the NoPE layers' attention temperature (None: 1)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        qk = qkv[:, :q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = (rope if self.rotary else NO_ROPE).rotate_qk(qk, self.num_heads)
        if self.qk_norm:
            q, k = weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps)
        if q_scale is not None and not self.rotary:
            q = (q * q_scale[:, None, None]).to(q.dtype)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales, chunk=self.chunk)
        return self.o_proj(o.reshape(t, q_size))


class Llama4Moe(nn.Module):
    """Routed experts scored by a sigmoid of the top-1 logit, the score scaling the expert's input; plus the
    shared expert."""

    def __init__(self, spec: ModelSpec, ops: DeviceOps, dtype, device):
        super().__init__()
        moe = spec.moe
        assert moe is not None  # (Llama4ForCausalLM checked it)
        self.router = TopKRouter(spec.hidden_size, moe.num_experts, device)
        self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype, device=device,
                                ops=ops)
        self.shared_expert = LlamaMLP(spec, ops, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit, ids = self.router(x).max(dim=-1, keepdim=True)  # top-1 (float32 logits)
        score = torch.sigmoid(logit).to(x.dtype)
        return experts_with_shared(self.experts, x * score, torch.ones_like(logit), ids, self.shared_expert, x)


class Llama4DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, layout: Llama4Layout, backend: AttentionBackend,
                 ops: DeviceOps, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.self_attn = Llama4Attention(spec, backend, dtype, device, rotary=layout.rotary[index],
                                         chunk=layout.chunk[index])
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        dense = dataclasses.replace(spec, intermediate_size=int(spec.hf_config.get("intermediate_size_mlp", 16384)))
        self.feed_forward: nn.Module = (Llama4Moe(spec, ops, dtype, device) if layout.moe[index]
                                        else LlamaMLP(dense, ops, dtype, device))

    def forward(self, x, residual, rope: Rope, q_scale, kv_cache, meta):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, q_scale, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.feed_forward(h), residual


class Llama4Model(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, **_: Any):
        super().__init__()
        config = spec.hf_config
        self.layout = llama4_layout(config, spec.num_layers, spec.max_position_embeddings)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList([Llama4DecoderLayer(spec, i, self.layout, backend, ops, dtype, device)
                                     for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        self.temperature_tuning = bool(config.get("attn_temperature_tuning", True)) and not all(self.layout.rotary)
        self.floor_scale = float(config.get("floor_scale", 8192))
        self.attn_scale = float(config.get("attn_scale", 0.1))
        if self.temperature_tuning and self.floor_scale <= 0:
            raise ModelLoadError(f"config.json: floor_scale must be positive, got {self.floor_scale}")
        # No fused one-token layers (module docstring): the backend's path only computes the logits.
        self.one_token_layers = None
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, h.dtype)
        q_scale = None
        if self.temperature_tuning:  # (float32, as transformers computes it)
            q_scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, q_scale, kv_caches[i], meta)
        h, _ = self.norm(h, residual)
        return h


class Llama4ForCausalLM(MoeForCausalLM):
    model_class = Llama4Model  # type: ignore[assignment]
    supports_tensor_parallel = True  # (module docstring)
    supports_quantization = False
    # No piecewise CUDA graphs (their attention sites carry no chunk); decode graphs capture as usual.
    piecewise_graph_tokens = 0

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.moe is None:
            raise UnsupportedModelError(f"config.json: {spec.architecture} needs num_local_experts")
        if spec.moe.num_experts_per_tok != 1:
            raise UnsupportedModelError(f"config.json: num_experts_per_tok {spec.moe.num_experts_per_tok} is not "
                                        "supported for Llama 4 (only 1, as every released checkpoint routes)")
        if spec.head_dim % 2:
            raise ModelLoadError(f"config.json: head_dim {spec.head_dim} must be even for rotary pairs")
        if spec.rotary_dim is not None:
            raise UnsupportedModelError("config.json: partial_rotary_factor is not supported for Llama 4")
        super().__init__(spec, dtype, device, kernels=kernels)

    def _expected_keys(self) -> set[str]:
        expected = set()
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                expected |= module.checkpoint_keys(name)
            elif isinstance(module, FusedMoE):
                expected |= {f"{name}.{param}" for param in _STACKED.values()}
            else:
                expected |= {f"{name}.{leaf}" if name else leaf for leaf, _ in module.named_parameters(recurse=False)}
        return expected

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs in this model's terms, as load_weights reads the checkpoint
        (lora/rewrite.py): a multimodal checkpoint's `language_model.` prefix dropped (its vision tower's modules
        dropped: no LoRA runs there), q / k rows from interleaved rotary pairs to halves (a row permutation)."""
        for name, tensor in pairs:
            if name.startswith(_VISION_PREFIXES):
                continue
            name = name.removeprefix("language_model.")
            if name.endswith(_QK_WEIGHT):
                tensor = interleaved_to_halves(materialize(tensor), self.spec.head_dim)
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF-named tensors in: a multimodal checkpoint's language model without its `language_model.`
        prefix (its vision tower and projector skipped), q/k rows reordered for the half-split rotary,
        stacked experts transposed into FusedMoE's layout."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        unexpected: list[str] = []
        head_dim = self.spec.head_dim

        def halves(tensor: Any, shard: str) -> Any:  # q / k rows: interleaved rotary pairs -> halves (docstring)
            return interleaved_to_halves(materialize(tensor), head_dim) if shard in ("q", "k") else tensor

        for hf_name, tensor in weights:
            name = hf_name
            if name.startswith(_VISION_PREFIXES):
                continue
            name = name.removeprefix("language_model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if load_kv_scale(modules, name, tensor):
                continue
            prefix, _, leaf = name.rpartition(".")
            try:
                if prefix.endswith(".experts") and leaf in _STACKED:
                    experts = modules.get(prefix)
                    if not isinstance(experts, FusedMoE):
                        unexpected.append(hf_name)
                        continue
                    # (transposed expert by expert as this rank reads its own)
                    experts.load_stacked(_STACKED[leaf], experts_transposed(tensor))
                    key = f"{prefix}.{_STACKED[leaf]}"
                else:
                    dense_key = load_dense_tensor(modules, params, name, tensor, _MERGED, rewrite=halves)
                    if dense_key is None:
                        unexpected.append(hf_name)
                        continue
                    key = dense_key
            except ValueError as e:
                raise ModelLoadError(f"tensor {hf_name!r}: {e} (config.json does not match the weights?)") from e
            loaded.add(key)
        check_all_loaded(self.spec.architecture, unexpected, self._expected_keys(), loaded)


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """The multimodal checkpoint served text-only (module docstring)."""


__all__ = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration", "interleaved_to_halves", "llama4_layout"]
