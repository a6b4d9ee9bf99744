"""NVIDIA Nemotron-H (NemotronHForCausalLM: Nemotron-H 8B / 47B / 56B, Nemotron Nano 2 9B / 12B, Nemotron 3 Nano
30B-A3B and Super): a stack of single-mixer blocks, each `h = h + mixer(norm(h))`, the mixer per
hybrid_override_pattern (model_spec.hybrid_layer_types):
- "M": a Mamba2 mixer (layers/mamba2_mixer.py: its conv and SSM states in the pools of worker/recurrent_states.py,
  as Granite 4.0-H's; in_proj / out_proj biased with use_bias, its gated norm's eps layer_norm_epsilon);
- "*": attention without any position encoding (NoPE: transformers' NemotronHAttention rotates nothing), scale
  head_dim ** -0.5, the only layers with a KV cache;
- "-": the non-gated ReLU^2 MLP (up_proj, down_proj: models/ungated_mlp.py);
- "E": mixture-of-experts (Nemotron 3): a sigmoid router with a correction bias and grouped top-k, non-gated
  ReLU^2 experts (the fused MoE kernels on the GPU), with moe_latent_size (Super) a projection into and out of
  the experts' width, and a shared ReLU^2 expert beside them (models/nemotron_h_moe.py).
Checkpoint names: the releases' `backbone.embeddings`, `backbone.layers.N.{norm,mixer}`, `backbone.norm_f` are read
as model.embed_tokens / model.layers.N / model.norm; experts one tensor each (`mixer.experts.{e}.up_proj.weight`,
the releases' and save_pretrained's) or stacked (`mixer.experts.up_proj` [E, I, H], `down_proj` [E, H, I], as
transformers holds them). Multi-token-prediction layers (`mtp.*`, num_nextn_predict_layers: Nemotron 3 Super) are
skipped here, as transformers skips them for the causal LM, and read only as a drafter under speculative_config
method 'mtp' (models/nemotron_h_mtp.py, worker/mtp_proposer.py).

Every step's routing and experts run on the device with nothing read back on the host, so decode steps replay CUDA
graphs as the other layers' do (the default `supports_cuda_graphs`); prefill steps run eagerly, as for every
hybrid (worker/model_forward.py: piecewise graphs stay off for recurrent layers).

Tensor parallelism, as vLLM shards the model: the Mamba2 mixers by heads, their B / C groups split or (one group)
replicated (layers/mamba2_mixer.py); the attention's query and KV heads as Llama's; the ReLU^2 MLPs column / row
parallel (models/ungated_mlp.py); the E layers' experts by their intermediate rows or, with --enable-expert-parallel,
whole, the router and latent projections replicated, one all-reduce per layer (models/nemotron_h_moe.py). Counts that
do not split are refused at start, naming the config field (distributed/sharding.py check_tp_shapes).

FP8 checkpoints (NVIDIA's nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8: a ModelOpt FP8 export, layers/quant/modelopt.py):
the quantized layers per tensor with static input scales -- the routed experts (FP8 non-gated experts,
layers/quant/fp8_moe.py), the shared experts and "-" MLPs, the Mamba2 in_proj (cut into its five segments, the
per-tensor scale on each: layers/mamba2_mixer.py Mamba2InProj) and out_proj -- and what the recipe keeps in BF16
named in its exclude_modules (the attention layers, the Mamba layers beside them, every conv1d), matched in the
checkpoint's `backbone.` spelling or this model's (`checkpoint_module_name`); the router, conv1d, A_log, D,
dt_bias, the norms, embeddings and LM head are never quantized here. kv_cache_quant_algo FP8: the attention layers'
`k_proj.k_scale` / `v_proj.v_scale` are the FP8 cache's scales. The other per-tensor / per-channel FP8 layouts
(the fp8 layout, compressed-tensors float8, quantization="fp8" at load) take the same methods.
Refused by name: block-wise FP8 (ModelOpt FP8_PB_WO, weight_block_size: the in_proj's dt segment is a row per head,
no whole 128-row blocks), NVFP4 and every integer format, GGUF's quantized types.
LoRA: adapters on the attention's q/k/v/o, the Mamba2 mixers' in_proj (its B cut into z / x / B / C / dt rows as the
weight: lora/packed.py) and out_proj, and the "-" MLPs' up_proj / down_proj, named as the releases (`backbone.*`) or
transformers (`model.*`) name them (`lora_rewrite`); on the E layers the routed experts' up_proj / down_proj (non-gated:
no gate_proj; one module per expert, `mixer.experts.{e}.up_proj`, or PEFT's target_parameters `mixer.experts.up_proj`
/ `down_proj`: lora/moe_targets.py), the shared expert's and the latent projections (fc1 / fc2_latent_proj). The
router and an MTP layer's modules are refused by name, as are FP8 experts' adapters (quantized experts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.kv_cache import split_kv_scale_name
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes, materialize, shape_of
from ferrox.kernels import select_kernels
from ferrox.layers.gated_delta_net import step_state_rows
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.mamba2_mixer import Mamba2Mixer, check_mamba2_quantization
from ferrox.layers.ops import NO_ROPE, DeviceOps, for_device
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError, hybrid_layer_types
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.granitemoehybrid import config_number
from ferrox.models.llama import LlamaAttention, load_kv_scale
from ferrox.models.moe import expected_checkpoint_keys, load_moe_tensors
from ferrox.models.nemotron_h_moe import NemotronHMoE, NemotronHMoeConfig
from ferrox.models.ungated_mlp import ReluSquaredMLP

_RENAMES = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.norm_f.", "model.norm."),
            ("backbone.", "model."))


def nemotron_h_mixer(spec: ModelSpec, ops: DeviceOps, dtype: torch.dtype, device: Any) -> Mamba2Mixer:
    config = spec.hf_config
    heads, head_dim = int(config["mamba_num_heads"]), int(config["mamba_head_dim"])
    limit = config.get("time_step_limit") or (0.0, float("inf"))
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ModelLoadError(f"config.json: time_step_limit must be [low, high], got {limit!r}")
    return Mamba2Mixer(spec.hidden_size, num_heads=heads, head_dim=head_dim, n_groups=int(config.get("n_groups") or 1),
                       d_state=int(config.get("ssm_state_size") or 128), conv_kernel=int(config.get("conv_kernel") or 4),
                       conv_bias=bool(config.get("use_conv_bias", True)), proj_bias=bool(config.get("use_bias", False)),
                       eps=spec.rms_norm_eps, time_step_limit=(config_number(limit[0]), config_number(limit[1])),
                       activation=str(config.get("mamba_hidden_act", "silu")), dtype=dtype, device=device, ops=ops)


class NemotronHBlock(nn.Module):
    def __init__(self, spec: ModelSpec, kind: str, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: Any, moe: NemotronHMoeConfig | None):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mixer: nn.Module
        if kind == "mamba":
            self.mixer = nemotron_h_mixer(spec, ops, dtype, device)
        elif kind == "full_attention":
            self.mixer = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias,
                                        o_bias=spec.attention_bias, qk_norm=False)
        elif kind == "moe":
            assert moe is not None  # (NemotronHForCausalLM read it)
            self.mixer = NemotronHMoE(spec, moe, ops, dtype, device)
        else:
            self.mixer = ReluSquaredMLP(spec, ops, dtype, device)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, step: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.norm(x)
        else:
            h, residual = self.norm(x, residual)
        if self.kind == "mamba":
            return self.mixer(h, meta, step), residual
        if self.kind == "full_attention":
            return self.mixer(h, NO_ROPE, kv_cache, meta), residual
        return self.mixer(h), residual


class NemotronHModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype, device: Any,
                 moe: NemotronHMoeConfig | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        kinds = hybrid_layer_types(spec.hf_config)
        assert kinds is not None  # (NemotronHForCausalLM checked it)
        self.layers = nn.ModuleList(NemotronHBlock(spec, kind, backend, ops, dtype, device, moe) for kind in kinds)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.decode_path = DecodePath()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        step = step_state_rows(meta)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, kv_caches[i], meta, step)
        h, _ = self.norm(h, residual)
        return h


class NemotronHForCausalLM(DecoderStackLM):
    # Tested with gloo on CPU (tests/models/test_nemotron_h_tp.py); NCCL runs the same layers.
    supports_tensor_parallel = True
    # FP8 with per-tensor or per-channel scales only (module docstring; __init__ refuses the rest by name).
    supports_quantization = True
    supports_quantized_gguf = False

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__()
        config = spec.hf_config
        kinds = hybrid_layer_types(config)
        if kinds is None:
            raise ModelLoadError(f"config.json: {spec.architecture} needs model_type 'nemotron_h'")
        if str(config.get("mlp_hidden_act", "relu2")) != "relu2":
            raise UnsupportedModelError(f"config.json: mlp_hidden_act {config.get('mlp_hidden_act')!r} is not "
                                        "supported (only relu2)")
        check_mamba2_quantization(spec.architecture, "ModelOpt FP8, as nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-FP8; "
                                  "the fp8 layout; compressed-tensors float8")
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        eps = float(config.get("layer_norm_epsilon") or 1e-5)
        spec = dataclasses.replace(spec, rms_norm_eps=eps, mlp_bias=bool(config.get("mlp_bias", False)))
        self.spec = spec
        self.moe = NemotronHMoeConfig.from_config(config) if "moe" in kinds else None
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        self.backend = get_attention_backend(device, self.kernels)
        self.model = NemotronHModel(spec, self.backend, self.ops, dtype, device, self.moe)
        self.lm_head = (None if spec.tie_word_embeddings else
                        ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device))

    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """The releases' name of module `name` (the reverse of _RENAMES): what a checkpoint's exclude list names
        (layers/quant/excluded_modules.py)."""
        dotted = f"{name}."  # (so that `model.norm` itself matches the prefix `model.norm.`)
        for old, new in _RENAMES:
            if dotted.startswith(new):
                return (old + dotted[len(new):])[:-1]
        return name

    def _rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The releases' `backbone.*` names as this model's (module docstring); the tied LM head and the MTP layers
        dropped; stacked expert tensors cut into one per expert."""
        for name, tensor in weights:
            if (name == "lm_head.weight" and self.lm_head is None) or name.startswith("mtp."):
                continue
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if self.moe is not None and name.endswith((".mixer.experts.up_proj", ".mixer.experts.down_proj")):
                yield from _per_expert(name, tensor, self.moe.num_experts)
                continue
            yield name, tensor

    # The checkpoint's MTP layers: their tensors' prefix (worker/mtp_proposer.py reads them).
    mtp_checkpoint_prefix = "mtp."

    def multi_token_predictor(self, quant_config: Any = None, *, float_fc: bool = False) -> nn.Module:
        """The checkpoint's MTP layers (mtp.*) as a drafter sharing this model's embedding and LM head
        (models/nemotron_h_mtp.py), built but not loaded; quant_config None: all float; float_fc: its eh_proj
        float."""
        from ferrox.models.nemotron_h_mtp import NemotronHMultiTokenPredictor

        return NemotronHMultiTokenPredictor(self, quant_config, float_fc=float_fc)

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs under this model's names (lora/rewrite.py): `backbone.*` read as
        model.*, an MTP layer's dropped; the rows are the checkpoint's."""
        return self._rewritten(pairs)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_moe_tensors(self, take_kv_scales(self, self._rewritten(weights)), self.spec.architecture,
                         expected_checkpoint_keys(self))


def take_kv_scales(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """An FP8 checkpoint's KV-cache scales of `model`'s attention mixers (`<layer>.mixer.k_proj.k_scale`...) loaded
    here, the other tensors passed on: the shared loader knows them under `self_attn` (models/llama.py
    load_kv_scale)."""
    modules = dict(model.named_modules())
    for name, tensor in weights:
        layer, sep, tail = name.partition(".mixer.")
        kv = split_kv_scale_name(f"{layer}.self_attn.{tail}") if sep else None
        if kv is not None and isinstance(modules.get(f"{layer}.mixer"), LlamaAttention):
            load_kv_scale({f"{layer}.self_attn": modules[f"{layer}.mixer"]}, f"{layer}.self_attn.{tail}", tensor)
            continue
        yield name, tensor


def per_expert_tensors(weights: Iterable[tuple[str, Any]], num_experts: int) -> Iterator[tuple[str, Any]]:
    """`weights` with stacked expert tensors (transformers' `<layer>.mixer.experts.up_proj`...) cut into one per
    expert (the MTP layers' tensors; the decoder's go through _rewritten)."""
    for name, tensor in weights:
        if name.endswith((".mixer.experts.up_proj", ".mixer.experts.down_proj")):
            yield from _per_expert(name, tensor, num_experts)
        else:
            yield name, tensor


def _per_expert(name: str, tensor: Any, num_experts: int) -> Iterator[tuple[str, Any]]:
    """A stacked expert tensor (`<layer>.mixer.experts.up_proj` [E, I, H] or `.down_proj` [E, H, I]) as the
    per-expert weights the releases store (`<layer>.mixer.experts.<e>.up_proj.weight`...)."""
    if len(shape_of(tensor)) != 3 or shape_of(tensor)[0] != num_experts:
        raise ModelLoadError(f"tensor {name!r}: shape {list(shape_of(tensor))}, config.json's n_routed_experts "
                             f"{num_experts} experts stacked make [{num_experts}, rows, columns]")
    value = materialize(tensor)
    owner, _, proj = name.rpartition(".")
    for e in range(num_experts):
        yield f"{owner}.{e}.{proj}.weight", value[e]
