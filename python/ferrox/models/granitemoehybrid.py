"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM: granite-4.0-h-micro / -tiny / -small): Mamba2 layers between
attention layers, each followed by a shared MLP and, in the MoE variants, routed experts.

Layers follow config.json's layer_types (model_spec.hybrid_layer_types: "mamba" / "attention"):
- "mamba": layers/mamba2_mixer.py, whose per-request conv and SSM states sit in pools beside the KV cache
  (worker/recurrent_states.py, the machinery of the hybrid Qwens). These layers have no KV cache: the loader gives
  them a zero-head cache shape (loader/model_config.py), so the KV budget counts only the attention layers.
- "attention": Llama's attention without rotary when position_embedding_type is not "rope" (the releases' NoPE),
  with Llama's rotary otherwise; scores scaled by attention_multiplier.
Each layer's MLP is the shared MLP (shared_mlp: input_linear = [gate; up] rows, output_linear = down), plus, with
num_local_experts > 0, GraniteMoe's routed experts (softmax over the top-k router logits, which is softmax top-k
renormalised: models/moe.py MoeBlock), summed.

Granite's multipliers are folded into the weights at load as models/granite.py folds them: embed_tokens rows times
embedding_multiplier; every layer output feeding the residual (attention o_proj, the mixer's out_proj, the shared
MLP's and the experts' down projections) times residual_multiplier; the final norm's weight divided by
logits_scaling (and by embedding_multiplier when the LM head is the tied, scaled embedding).

Tensor parallelism: the Mamba2 mixers split by heads, with their B / C groups split or (one group) replicated as
vLLM's MambaMixer2 does (layers/mamba2_mixer.py); the attention's query and KV heads as Llama's; the shared MLP by
its rows and the experts as models/moe.py MoeBlock's (sharded, or whole under expert parallelism), the shared MLP's
partial summed with theirs in one all-reduce. The multipliers fold into each rank's slices as they are read. Counts
that do not split are refused at start (distributed/sharding.py check_tp_shapes).

Refused by name: quantized checkpoints (the folds would reach inside packed weights); LoRA (`lora_refusal`).
Speculative decoding works as for the hybrid Qwens: verify steps keep the state after each draft
(layers/mamba2_ssm.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes, materialize, row_block, scaled, shape_of
from ferrox.kernels import select_kernels
from ferrox.layers.fused_moe import experts_with_shared
from ferrox.layers.gated_delta_net import step_state_rows
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.mamba2_mixer import Mamba2Mixer
from ferrox.layers.ops import NO_ROPE, DeviceOps, Rope, for_device
from ferrox.layers.quant.method import hf_quantization_config
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError, hybrid_layer_types
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.granite import GraniteMultipliers
from ferrox.models.hybrid_layer import HybridMixingLayer
from ferrox.models.llama import LlamaAttention, LlamaMLP
from ferrox.models.moe import MoeBlock, expected_checkpoint_keys, load_moe_tensors

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def mamba2_mixer(spec: ModelSpec, ops: DeviceOps, dtype: torch.dtype, device: Any, *, prefix: str = "mamba_",
                 conv_bias_key: str = "mamba_conv_bias", proj_bias_key: str = "mamba_proj_bias",
                 norm_eps: float | None = None) -> Mamba2Mixer:
    """A Mamba2 mixer from config.json's fields (Granite's mamba_* names with transformers' defaults)."""
    config = spec.hf_config
    heads = int(config.get(f"{prefix}n_heads") or 128)
    inner = int(config.get(f"{prefix}expand") or 2) * spec.hidden_size
    head_dim = config.get(f"{prefix}d_head") or "auto"
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ModelLoadError(f"config.json: {prefix}n_heads {heads} x {prefix}d_head {head_dim} must equal "
                             f"{prefix}expand x hidden_size ({inner})")
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ModelLoadError(f"config.json: time_step_limit must be [low, high], got {limit!r}")
    return Mamba2Mixer(spec.hidden_size, num_heads=heads, head_dim=head_dim,
                       n_groups=int(config.get(f"{prefix}n_groups") or 1),
                       d_state=int(config.get(f"{prefix}d_state") or 256),
                       conv_kernel=int(config.get(f"{prefix}d_conv") or 4),
                       conv_bias=bool(config.get(conv_bias_key, True)), proj_bias=bool(config.get(proj_bias_key, False)),
                       eps=spec.rms_norm_eps if norm_eps is None else norm_eps,
                       time_step_limit=(config_number(limit[0]), config_number(limit[1])), activation=spec.hidden_act, dtype=dtype,
                       device=device, ops=ops)


def config_number(value: Any) -> float:
    """A config float; transformers 5 writes infinities as {"__float__": "Infinity"} (Python's json, Infinity)."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelLoadError(f"config.json: time_step_limit: {value!r} is not a number") from None


class GraniteMoeHybridDecoderLayer(HybridMixingLayer):
    def __init__(self, spec: ModelSpec, kind: str, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: LlamaAttention | None = None
        if kind == "mamba":
            self.mamba = mamba2_mixer(spec, ops, dtype, device)
        else:
            self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias,
                                            o_bias=spec.attention_bias, qk_norm=False)
        shared = int(spec.hf_config.get("shared_intermediate_size") or 1024)
        self.shared_mlp = LlamaMLP(dataclasses.replace(spec, intermediate_size=shared, mlp_bias=False), ops, dtype,
                                   device)
        self.mlp = (MoeBlock(spec, spec.moe, ops, dtype, device, renormalize=True)
                    if spec.moe is not None else None)

    def recurrent_mixer(self) -> nn.Module | None:
        return self.mamba

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata, step: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.mix(x, residual, rope, kv_cache, meta, step)
        if self.mlp is None:
            return self.shared_mlp(h), residual
        return experts_with_shared(self.mlp.experts, h, *self.mlp.route(h), self.shared_mlp, h), residual


class GraniteMoeHybridModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype, device: Any):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        kinds = hybrid_layer_types(spec.hf_config)
        assert kinds is not None  # (GraniteMoeHybridForCausalLM checked it)
        self.layers = nn.ModuleList(GraniteMoeHybridDecoderLayer(spec, kind, backend, ops, dtype, device)
                                    for kind in kinds)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        rope = str(spec.hf_config.get("position_embedding_type") or "nope")
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops) if rope == "rope" else None
        self.decode_path = DecodePath()  # (the general layers every step; a one-row lm_head as any model's)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope: Rope = self.rotary(positions, h.dtype) if self.rotary is not None else NO_ROPE
        step = step_state_rows(meta)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, kv_caches[i], meta, step)
        h, _ = self.norm(h, residual)
        return h


class GraniteMoeHybridForCausalLM(DecoderStackLM):
    # Tested with gloo on CPU (tests/models/test_granitemoehybrid_tp.py); NCCL runs the same layers.
    supports_tensor_parallel = True
    supports_quantization = False
    supports_quantized_gguf = False
    lora_refusal = ("GraniteMoeHybridForCausalLM (Granite 4.0-H): LoRA adapters on its Mamba2 and attention layers "
                    "are not supported in this version")

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__()
        config = spec.hf_config
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        if hybrid_layer_types(config) is None:
            raise ModelLoadError(f"config.json: {spec.architecture} needs model_type 'granitemoehybrid'")
        quant = hf_quantization_config(config)
        if quant is not None:
            raise UnsupportedModelError(
                f"config.json: quantization_config (quant_method {quant.get('quant_method')!r}) is not supported for "
                f"{spec.architecture}: its embedding, residual and logits multipliers are folded into the weights at "
                "load, which quantized tensors do not allow; load the unquantized checkpoint")
        rope = str(config.get("position_embedding_type") or "nope")
        if rope not in ("rope", "nope"):
            raise UnsupportedModelError(f"config.json: position_embedding_type {rope!r} is not supported "
                                        "('rope' or 'nope')")
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        multipliers = GraniteMultipliers.from_config(config)
        spec = dataclasses.replace(spec, attention_scale=multipliers.attention)
        self.spec = spec
        self.multipliers = multipliers
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        self.backend = get_attention_backend(device, self.kernels)
        self.model = GraniteMoeHybridModel(spec, self.backend, self.ops, dtype, device)
        self.lm_head = (None if spec.tie_word_embeddings else
                        ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device))
        # transformers' final hidden states = ours * this (the final norm carries 1 / it: models/granite.py).
        self.hidden_states_scale = multipliers.logits_scaling * (multipliers.embedding if self.lm_head is None else 1.0)
        # ferrox's embedding rows carry embedding_multiplier; a prompt of embeddings gets it here (worker/multimodal.py).
        self.prompt_embeds_scale = multipliers.embedding

    # ---- loading --------------------------------------------------------------------------------------
    def _rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream in this model's terms (module docstring): the shared MLP's input_linear cut into
        gate / up rows and output_linear named down_proj; the experts' fused input_linear [E, 2I, H] and
        output_linear [E, H, I] (or transformers 5's experts.gate_up_proj / down_proj) cut per expert, the router
        named gate; the multipliers folded in."""
        m = self.multipliers
        moe = self.spec.moe
        shared = int(self.spec.hf_config.get("shared_intermediate_size") or 1024)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            base, _, leaf = name.rpartition(".")
            if base.endswith(".shared_mlp.input_linear"):
                rows = shape_of(tensor)[0] if shape_of(tensor) else 0
                if rows != 2 * shared:
                    raise ModelLoadError(f"tensor {name!r}: {rows} rows, config.json's shared MLP has 2 x {shared}")
                mlp = base[:-len("input_linear")]
                yield f"{mlp}gate_proj.{leaf}", row_block(tensor, 0, shared)
                yield f"{mlp}up_proj.{leaf}", row_block(tensor, shared, shared)
                continue
            if base.endswith(".shared_mlp.output_linear"):
                yield f"{base[:-len('output_linear')]}down_proj.{leaf}", scaled(tensor, m.residual)
                continue
            if ".block_sparse_moe." in name:
                layer = name[:name.index(".block_sparse_moe.")]
                kind = name[len(layer) + len(".block_sparse_moe."):]
                if kind in ("router.layer.weight", "router.weight"):
                    yield f"{layer}.mlp.gate.weight", tensor
                    continue
                if moe is not None and kind in ("input_linear.weight", "experts.gate_up_proj",
                                                "output_linear.weight", "experts.down_proj"):
                    gate_up = kind in ("input_linear.weight", "experts.gate_up_proj")
                    yield from _experts(f"{layer}.mlp.experts", name, materialize(tensor), gate_up, moe.num_experts,
                                        self.spec.hidden_size, moe.intermediate_size, m.residual)
                    continue
            if (base.endswith((".self_attn.o_proj", ".mamba.out_proj"))) and leaf in ("weight", "bias"):
                tensor = scaled(tensor, m.residual)
            elif name == "model.embed_tokens.weight":
                tensor = scaled(tensor, m.embedding)
            elif name == "model.norm.weight":
                tensor = scaled(tensor, 1.0 / self.hidden_states_scale)
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_moe_tensors(self, self._rewritten(weights), self.spec.architecture, expected_checkpoint_keys(self))


def _experts(prefix: str, name: str, value: torch.Tensor, gate_up: bool, num_experts: int, hidden: int,
             intermediate: int, residual: float) -> Iterator[tuple[str, Any]]:
    """GraniteMoe's fused expert tensor as one weight per expert and projection (`<prefix>.<e>.gate_proj.weight`...):
    input_linear [E, 2I, H] rows [gate; up], output_linear [E, H, I] (times residual_multiplier)."""
    want = (num_experts, 2 * intermediate, hidden) if gate_up else (num_experts, hidden, intermediate)
    if tuple(value.shape) != want:
        raise ModelLoadError(f"tensor {name!r}: shape {tuple(value.shape)}, config.json's experts make {list(want)}")
    for e in range(num_experts):
        if gate_up:
            yield f"{prefix}.{e}.gate_proj.weight", value[e, :intermediate]
            yield f"{prefix}.{e}.up_proj.weight", value[e, intermediate:]
        else:
            yield f"{prefix}.{e}.down_proj.weight", value[e].float() * residual
