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

FP8 (IBM's -FP8 releases: llm-compressor's compressed-tensors float8, per-channel weight scales and dynamic per-token
activations, the experts' fused input_linear / output_linear quantized as [E, rows, in] codes with [E, rows, 1]
scales; ModelOpt FP8; the fp8 layout; quantization="fp8" at load): the Mamba2 in_proj (cut into its five segments,
layers/mamba2_mixer.py Mamba2InProj) and out_proj, the attention projections, the shared MLP and the routed experts
(layers/quant/fp8_moe.py) take the checkpoint's codes; conv1d, A_log, D, dt_bias, the norms, the routers, the
embeddings and LM head stay float. A quantized layer's residual_multiplier folds into its weight scale instead of its
codes: W = codes x scale row by row, so residual x W = codes x (residual x scale) exactly, and the FP8 matmul runs
unchanged (online FP8 folds into the float weight before quantizing it, as the float path does). The other multipliers
touch only float tensors (the embedding, the final norm) or the attention's scale. The ignore / exclude list is
matched in the checkpoint's spelling too (`checkpoint_module_name`: shared_mlp.input_linear / output_linear,
block_sparse_moe).
Refused by name: block-wise FP8 (the in_proj's dt segment is a row per head, no whole 128-row blocks), NVFP4 and
every integer format, experts an FP8 checkpoint leaves in float, GGUF's quantized types.
LoRA: adapters on the attention's q/k/v/o, the Mamba2 mixers' in_proj (its B cut into z / x / B / C / dt rows as the
weight: lora/packed.py) and out_proj, and the shared MLP's input_linear (cut into gate / up rows: `lora_rewrite`) /
output_linear; residual_multiplier scales the B of every layer feeding the residual as it scales its weight
(Linear.output_scale). The routed experts and the router are refused by name (no LoRA on experts).
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
from ferrox.layers.mamba2_mixer import Mamba2Mixer, check_mamba2_quantization
from ferrox.layers.ops import NO_ROPE, DeviceOps, Rope, for_device
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError, hybrid_layer_types
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.granite import GraniteMultipliers
from ferrox.models.hybrid_layer import HybridMixingLayer
from ferrox.models.llama import LlamaAttention, LlamaMLP
from ferrox.models.moe import MoeBlock, expected_checkpoint_keys, load_moe_tensors

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# (this model's module, the checkpoint's): the names an ignore / exclude list may use for the shared MLP.
_CHECKPOINT_SPELLINGS = ((".shared_mlp.gate_up_proj", ".shared_mlp.input_linear"),
                         (".shared_mlp.down_proj", ".shared_mlp.output_linear"))


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
    # FP8 with per-tensor or per-channel scales only (module docstring; __init__ refuses the rest by name).
    supports_quantization = True
    supports_quantized_gguf = False

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__()
        config = spec.hf_config
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        if hybrid_layer_types(config) is None:
            raise ModelLoadError(f"config.json: {spec.architecture} needs model_type 'granitemoehybrid'")
        check_mamba2_quantization(spec.architecture, "compressed-tensors float8, as ibm-granite's -FP8 releases; "
                                  "ModelOpt FP8; the fp8 layout")
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
        # residual_multiplier is folded into the layers feeding the residual at load (_rewritten); a LoRA delta on one
        # of them takes it too (Linear.output_scale, lora/packed.py).
        for layer in self.model.layers:
            mixer = layer.self_attn.o_proj if layer.self_attn is not None else layer.mamba.out_proj
            for proj in (mixer, layer.shared_mlp.down_proj):
                proj.output_scale = multipliers.residual

    # ---- loading --------------------------------------------------------------------------------------
    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """The checkpoint's name of module `name`: what an ignore / exclude list names (layers/quant/
        excluded_modules.py; the experts' block_sparse_moe spelling is matched there)."""
        for ours, theirs in _CHECKPOINT_SPELLINGS:
            if name.endswith(ours):
                return name[:-len(ours)] + theirs
        return name

    def _holds_codes(self, modules: dict[str, nn.Module], name: str) -> bool:
        """Whether layer `name` loads a quantized checkpoint's codes and scales (not a float weight: unquantized,
        excluded, or quantized at load)."""
        method = getattr(modules.get(name), "weight_method", None)
        return method is not None and not method.float_weight

    def _rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream in this model's terms (module docstring): the shared MLP's input_linear cut into
        gate / up rows and output_linear named down_proj; the experts' fused input_linear [E, 2I, H] and
        output_linear [E, H, I] (or transformers 5's experts.gate_up_proj / down_proj) cut per expert, the router
        named gate; the multipliers folded in (into the weight scale of a layer holding FP8 codes)."""
        m = self.multipliers
        moe = self.spec.moe
        shared = int(self.spec.hf_config.get("shared_intermediate_size") or 1024)
        modules = dict(self.named_modules())
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            base, _, leaf = name.rpartition(".")
            if base.endswith(".shared_mlp.input_linear"):
                rows = shape_of(tensor)[0] if shape_of(tensor) else 0
                mlp = base[:-len("input_linear")]
                if rows == 2 * shared:  # (the weight, and per-channel scales: each half's rows)
                    yield f"{mlp}gate_proj.{leaf}", row_block(tensor, 0, shared)
                    yield f"{mlp}up_proj.{leaf}", row_block(tensor, shared, shared)
                elif leaf in ("weight", "bias"):
                    raise ModelLoadError(f"tensor {name!r}: {rows} rows, config.json's shared MLP has 2 x {shared}")
                else:  # (a per-tensor weight scale, the input scale: the layer's, so both halves')
                    yield f"{mlp}gate_proj.{leaf}", tensor
                    yield f"{mlp}up_proj.{leaf}", tensor
                continue
            if base.endswith(".shared_mlp.output_linear"):
                down = f"{base[:-len('output_linear')]}down_proj"
                yield f"{down}.{leaf}", _folded(tensor, leaf, m.residual, self._holds_codes(modules, down))
                continue
            if ".block_sparse_moe." in name:
                layer = name[:name.index(".block_sparse_moe.")]
                kind = name[len(layer) + len(".block_sparse_moe."):]
                if kind in ("router.layer.weight", "router.weight"):
                    yield f"{layer}.mlp.gate.weight", tensor
                    continue
                proj, _, leaf = kind.rpartition(".")
                if kind in ("experts.gate_up_proj", "experts.down_proj"):  # (transformers 5's names: the weight)
                    proj, leaf = kind, "weight"
                if moe is not None and proj in ("input_linear", "output_linear", "experts.gate_up_proj",
                                                "experts.down_proj"):
                    experts = f"{layer}.mlp.experts"
                    yield from _experts(experts, name, leaf, materialize(tensor), proj.endswith(("input_linear",
                                        "gate_up_proj")), moe.num_experts, self.spec.hidden_size,
                                        moe.intermediate_size, m.residual, self._holds_codes(modules, experts))
                    continue
            if base.endswith((".self_attn.o_proj", ".mamba.out_proj")):
                tensor = _folded(tensor, leaf, m.residual, self._holds_codes(modules, base))
            elif name == "model.embed_tokens.weight":
                tensor = scaled(tensor, m.embedding)
            elif name == "model.norm.weight":
                tensor = scaled(tensor, 1.0 / self.hidden_states_scale)
            yield name, tensor

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs in this model's names and rows (lora/rewrite.py): the shared MLP's
        input_linear cut into gate / up rows, output_linear named down_proj; every other name kept (the experts' and
        router's, refused by name where the manager finds no projection of theirs). residual_multiplier reaches the
        B of the layers feeding the residual through their output_scale (__init__), however the loader folded it
        into their weights (float, or an FP8 weight scale)."""
        shared = int(self.spec.hf_config.get("shared_intermediate_size") or 1024)
        for name, b in pairs:
            base, _, leaf = name.rpartition(".")
            if base.endswith(".shared_mlp.input_linear"):
                rows = shape_of(b)[0] if shape_of(b) else 0
                if rows != 2 * shared:
                    raise ModelLoadError(f"{rows} rows, config.json's shared MLP has 2 x {shared}")
                mlp = base[:-len("input_linear")]
                yield f"{mlp}gate_proj.{leaf}", row_block(b, 0, shared)
                yield f"{mlp}up_proj.{leaf}", row_block(b, shared, shared)
            elif base.endswith(".shared_mlp.output_linear"):
                yield f"{base[:-len('output_linear')]}down_proj.{leaf}", b
            else:
                yield name, b

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_moe_tensors(self, self._rewritten(weights), self.spec.architecture, expected_checkpoint_keys(self))


def _folded(tensor: Any, leaf: str, factor: float, codes: bool) -> Any:
    """A tensor of a layer whose output carries `factor` (residual_multiplier), with the factor in it: a float weight
    or bias times it; a layer of FP8 codes keeps its codes and input scale and takes it on its weight scale (per
    tensor or per row, W = codes x scale: the product is exact)."""
    if leaf == "bias" or leaf == ("weight_scale" if codes else "weight"):
        return scaled(tensor, factor)
    return tensor


def _experts(prefix: str, name: str, leaf: str, value: torch.Tensor, gate_up: bool, num_experts: int, hidden: int,
             intermediate: int, residual: float, codes: bool) -> Iterator[tuple[str, Any]]:
    """GraniteMoe's fused expert tensor as one tensor per expert and projection (`<prefix>.<e>.gate_proj.weight`...):
    input_linear [E, 2I, H] rows [gate; up], output_linear [E, H, I] (residual_multiplier folded: `_folded`). An FP8
    checkpoint's scales beside them (llm-compressor's Granite 4 experts: weight_scale [E, 2I, 1] / [E, H, 1]) are cut
    the same way, a value per expert (per tensor) going to both its gate and up."""
    if leaf == "weight":
        want = (num_experts, 2 * intermediate, hidden) if gate_up else (num_experts, hidden, intermediate)
        if tuple(value.shape) != want:
            raise ModelLoadError(f"tensor {name!r}: shape {tuple(value.shape)}, config.json's experts make {list(want)}")
    elif value.dim() == 0 or value.shape[0] != num_experts:
        raise ModelLoadError(f"tensor {name!r}: shape {tuple(value.shape)}, expected one entry per expert "
                             f"({num_experts}) first")
    for e in range(num_experts):
        v = value[e]
        if not gate_up:
            yield f"{prefix}.{e}.down_proj.{leaf}", _folded(v, leaf, residual, codes)
        elif v.dim() and v.shape[0] == 2 * intermediate:
            yield f"{prefix}.{e}.gate_proj.{leaf}", v[:intermediate]
            yield f"{prefix}.{e}.up_proj.{leaf}", v[intermediate:]
        else:
            yield f"{prefix}.{e}.gate_proj.{leaf}", v
            yield f"{prefix}.{e}.up_proj.{leaf}", v
