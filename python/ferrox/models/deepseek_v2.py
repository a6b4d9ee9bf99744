"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): DeepSeek-V2-Lite, V2, V2.5, V3, R1,
Kimi-K2 and other checkpoints of that architecture; Mistral 4 builds on these modules (models/mistral4.py: its
router through `read_moe`, Llama 4's query scaling through `model_class`).

A decoder layer is multi-head latent attention (models/mla_attention.py: the cache holds one latent row a
token) and an MLP: the first `first_k_dense_replace` layers are dense, later ones (every `moe_layer_freq`-th)
mixture-of-experts: `n_routed_experts` routed experts (layers/fused_moe.py; the fused Triton kernels on GPU),
`num_experts_per_tok` of them a token, plus `n_shared_experts` always-on experts run as one plain MLP of
n_shared_experts x moe_intermediate_size (no gate). Routing (layers/grouped_topk.py):

- V2: softmax scores; topk_method "greedy" (plain top-k) or "group_limited_greedy" (the best `topk_group`
  of `n_group` groups by their best expert first); weights times routed_scaling_factor.
- V3: sigmoid scores; "noaux_tc": the checkpoint's e_score_correction_bias steers the choice (groups
  ranked by their two best biased scores), weights are the unbiased scores, renormalised if
  norm_topk_prob, times routed_scaling_factor.

Where the references disagree: V2 with norm_topk_prob true is refused (transformers ignores the field,
DeepSeek's own V2 code renormalises and then skips routed_scaling_factor, vLLM renormalises and applies it;
no published V2 sets it); moe_layer_freq, which transformers ignores, is honoured as DeepSeek's code and
vLLM read it (every published checkpoint has 1); each family's routing fields are held to what its
transformers reference runs (V2: softmax, greedy / group_limited_greedy; V3: sigmoid, noaux_tc), other
values refused by name.

Attention: with the Triton kernel set (CUDA) the latent attention kernels of kernels/mla_attention.py, which
keep the decode and piecewise CUDA graphs; with the torch set (the CPU) the torch reference backend, which
plans steps on the host and so runs without graphs (`supports_cuda_graphs`; models/mla_attention.py).

Tensor parallelism (`--tensor-parallel-size`), as vLLM shards DeepSeek: the attention's query heads split
across the ranks, the latent replicated (models/mla_attention.py); dense MLPs and the shared experts
column / row parallel like Llama's; the routed experts each split by their intermediate rows, or with
`--enable-expert-parallel` whole experts split across the ranks (layers/fused_moe.py); the router and
V3's e_score_correction_bias replicated, so grouped top-k sees every expert on every rank. A block-FP8
checkpoint's scales are cut with their weights, on block edges only (layers/quant/fp8_block.py refuses
another cut naming the tensor).

LoRA adapts the latent attention's projections (not the absorbed kv_b_proj), the MLPs, the shared experts and
the routed experts (lora/moe_targets.py). Not here yet: the fused one-token decode kernels. The
multi-token-prediction layers a config declares past num_hidden_layers (V3's num_nextn_predict_layers) are
skipped at load, as vLLM does for the base model; speculative_config method 'mtp' drafts with the first
(models/deepseek_mtp.py builds it from `mtp_decoder_layer` and loads it through `load_deepseek_tensors`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.attention.decode_path import DecodePath
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes
from ferrox.kernels import select_kernels
from ferrox.layers.fused_moe import FusedMoE, TopKRouter, experts_with_shared
from ferrox.layers.grouped_topk import grouped_topk
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import MergedLinear
from ferrox.layers.ops import DeviceOps, for_device
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError, rope_type_of
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.deepseek_mtp import DeepseekLayoutMtpTarget
from ferrox.models.llama import LlamaMLP, linear_takes
from ferrox.models.load_check import check_all_loaded, load_into
from ferrox.models.mla_attention import MlaAttention, MlaShape, MlaTritonBackend, mla_backend
from ferrox.models.moe import expected_checkpoint_keys
from ferrox.models.pre_norm import PreNormDecoderLayer, run_pre_norm_layers

_MERGED = {"gate_proj": "gate", "up_proj": "up"}  # dense MLPs and the shared experts: gate_up_proj shards
_EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)"
                          r"\.(?P<leaf>\w+)$")
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclasses.dataclass(frozen=True, slots=True)
class DeepseekMoeConfig:
    """The experts of a DeepSeek config (module docstring for the routing)."""

    num_experts: int  # n_routed_experts
    top_k: int  # num_experts_per_tok
    intermediate_size: int  # moe_intermediate_size, of one expert
    num_shared_experts: int
    first_k_dense_replace: int
    moe_layer_freq: int
    scoring_func: str  # "softmax" (V2) | "sigmoid" (V3)
    correction_bias: bool  # V3's noaux_tc: e_score_correction_bias in the checkpoint
    num_expert_group: int
    topk_group: int
    renormalize: bool
    routed_scaling_factor: float
    group_top2: bool | None = None  # groups ranked by their two best scores (None: with the bias, as V3)

    def is_sparse(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0


def _field(config: dict[str, Any], key: str, default: Any = None) -> Any:
    value = config.get(key)
    return default if value is None else value


def _int(config: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = _field(config, key, default)
    if value is None:
        raise ModelLoadError(f"config.json: required field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelLoadError(f"config.json: field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_shape(spec: ModelSpec, version: int) -> MlaShape:
    """The latent attention's dimensions and softmax scale from config.json."""
    config = spec.hf_config
    interleaved = bool(_field(config, "rope_interleave", True))
    if version == 2 and not interleaved:
        raise UnsupportedModelError("config.json: rope_interleave false is not supported for "
                                    "DeepseekV2ForCausalLM (V2 always rotates interleaved pairs)")
    q_lora = config.get("q_lora_rank")
    nope, rope = _int(config, "qk_nope_head_dim"), _int(config, "qk_rope_head_dim")
    if rope % 2:
        raise ModelLoadError(f"config.json: qk_rope_head_dim {rope} must be even (rotary pairs)")
    kv_heads = config.get("num_key_value_heads")
    if kv_heads not in (None, spec.num_heads):
        # transformers expands the latent to every head; fewer KV heads have no meaning in MLA.
        raise UnsupportedModelError(f"config.json: num_key_value_heads {kv_heads} must equal num_attention_heads "
                                    f"({spec.num_heads}) for {spec.architecture}")
    scale = (nope + rope) ** -0.5
    scaling = spec.rope_scaling
    if scaling is not None and rope_type_of(scaling) != "default" and scaling.get("mscale_all_dim"):
        # DeepSeek's YaRN also scales the scores of the unrotated dims (transformers' yarn_apply_mscale).
        scale *= _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2
    return MlaShape(kv_lora_rank=_int(config, "kv_lora_rank"),
                    q_lora_rank=None if q_lora is None else _int(config, "q_lora_rank"),
                    qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=_int(config, "v_head_dim"),
                    interleaved=interleaved, scale=scale)


def moe_config(spec: ModelSpec, version: int) -> DeepseekMoeConfig | None:
    """The experts (None: a dense model, n_routed_experts unset), refusing by name what `version`'s
    reference does not run."""
    config = spec.hf_config
    if not config.get("n_routed_experts"):
        return None
    defaults = ("softmax", "greedy") if version == 2 else ("sigmoid", "noaux_tc")
    scoring, method = _field(config, "scoring_func", defaults[0]), _field(config, "topk_method", defaults[1])
    if scoring != defaults[0]:
        raise UnsupportedModelError(f"config.json: scoring_func {scoring!r} is not supported for {spec.architecture} "
                                    f"(only {defaults[0]!r})")
    methods = ("greedy", "group_limited_greedy") if version == 2 else ("noaux_tc",)
    if method not in methods:
        raise UnsupportedModelError(f"config.json: topk_method {method!r} is not supported for {spec.architecture} "
                                    f"(supported: {', '.join(methods)})")
    renormalize = bool(config.get("norm_topk_prob", version == 3))
    if version == 2 and renormalize:
        raise UnsupportedModelError("config.json: norm_topk_prob true is not supported for DeepseekV2ForCausalLM "
                                    "(DeepSeek's code and vLLM disagree on its routed_scaling_factor)")
    if _field(config, "ep_size", 1) != 1:
        raise UnsupportedModelError(f"config.json: ep_size {config['ep_size']} is not supported (only 1; "
                                    "ferrox's --enable-expert-parallel is the engine's choice, not the config's)")
    experts, top_k, groups, topk_group = expert_groups(config, grouped=method != "greedy")
    return DeepseekMoeConfig(
        num_experts=experts, top_k=top_k, intermediate_size=_int(config, "moe_intermediate_size"),
        num_shared_experts=_int(config, "n_shared_experts", 0, minimum=0),
        first_k_dense_replace=_int(config, "first_k_dense_replace", 0, minimum=0),
        moe_layer_freq=_int(config, "moe_layer_freq", 1), scoring_func=scoring, correction_bias=method == "noaux_tc",
        num_expert_group=groups, topk_group=topk_group, renormalize=renormalize,
        routed_scaling_factor=float(_field(config, "routed_scaling_factor", 1.0)))


def expert_groups(config: dict[str, Any], *, grouped: bool = True) -> tuple[int, int, int, int]:
    """(n_routed_experts, num_experts_per_tok, n_group, topk_group) of a DeepSeek-style router, checked to fit
    together (ungrouped: one group of all experts)."""
    groups = _int(config, "n_group", 1) if grouped else 1
    topk_group = _int(config, "topk_group", 1) if grouped else 1
    experts = _int(config, "n_routed_experts")
    top_k = _int(config, "num_experts_per_tok")
    if experts % groups or not 1 <= topk_group <= groups or top_k > topk_group * (experts // groups):
        raise ModelLoadError(f"config.json: {experts} experts in n_group {groups} groups, topk_group {topk_group}, "
                             f"num_experts_per_tok {top_k} do not fit together")
    return experts, top_k, groups, topk_group


class DeepseekRouter(TopKRouter):
    """The float32 router, with V3's e_score_correction_bias (a checkpoint tensor of the gate)."""

    def __init__(self, hidden_size: int, moe: DeepseekMoeConfig, device):
        super().__init__(hidden_size, moe.num_experts, device)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32, device=device),
                                                     requires_grad=False) if moe.correction_bias else None)


class DeepseekMoe(nn.Module):
    """Routed experts plus the shared ones: the MLP of a sparse layer."""

    def __init__(self, spec: ModelSpec, moe: DeepseekMoeConfig, ops: DeviceOps, dtype, device):
        super().__init__()
        self.moe = moe
        self.gate = DeepseekRouter(spec.hidden_size, moe, device)
        self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype,
                                device=device, ops=ops)
        self.shared_experts: LlamaMLP | None = None
        if moe.num_shared_experts:
            shared = dataclasses.replace(spec, intermediate_size=moe.intermediate_size * moe.num_shared_experts)
            self.shared_experts = LlamaMLP(shared, ops, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        weights, ids = grouped_topk(self.gate(x), moe.top_k, scoring_func=moe.scoring_func,
                                    renormalize=moe.renormalize, num_expert_group=moe.num_expert_group,
                                    topk_group=moe.topk_group,
                                    e_score_correction_bias=self.gate.e_score_correction_bias,
                                    routed_scaling_factor=moe.routed_scaling_factor, group_top2=moe.group_top2)
        if self.shared_experts is None:
            return self.experts(x, weights, ids)
        return experts_with_shared(self.experts, x, weights, ids, self.shared_experts, x)


class DeepseekDecoderLayer(PreNormDecoderLayer):
    def __init__(self, spec: ModelSpec, index: int, mla: MlaShape, moe: DeepseekMoeConfig | None,
                 backend: AttentionBackend, ops: DeviceOps, dtype, device):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.self_attn = MlaAttention(spec, mla, backend, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mlp: nn.Module = (DeepseekMoe(spec, moe, ops, dtype, device) if moe is not None and moe.is_sparse(index)
                               else LlamaMLP(spec, ops, dtype, device))



class DeepseekModel(nn.Module):
    def __init__(self, spec: ModelSpec, mla: MlaShape, moe: DeepseekMoeConfig | None, backend: AttentionBackend,
                 ops: DeviceOps, dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList([DeepseekDecoderLayer(spec, i, mla, moe, backend, ops, dtype, device)
                                     for i in range(spec.num_layers)])
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        # Only q_pe / k_pe rotate (qk_rope_head_dim); YaRN's attention factor scales their cos and sin.
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, spec.rope_theta, spec.rope_scaling, device, ops,
                                      max_position_embeddings=int(spec.hf_config.get("max_position_embeddings")
                                                                  or 0) or None)
        self.decode_path = DecodePath()  # the general path (logits: one matmul)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return run_pre_norm_layers(self.layers, self.norm, h, self.rotary(positions, h.dtype), kv_caches, meta)


class DeepseekV2ForCausalLM(DeepseekLayoutMtpTarget, DecoderStackLM):
    version = 2  # which reference's routing and rotary fields (mla_shape, moe_config)
    # Heads, dense and shared MLPs sharded, experts sharded or split, the latent replicated (module docstring).
    # Tested with gloo on the CPU (tests/models/test_deepseek_tp.py) and NCCL on two GPUs (its gpu test).
    supports_tensor_parallel = True
    # Linear layers and experts take the checkpoint's method (block FP8: DeepSeek-V3's own layout);
    # kv_b_proj is dequantized for the absorption (MlaAttention.absorb_kv_b).
    supports_quantization = True
    # CUDA graphs (worker/model_forward.py) need attention that plans nothing on the host: the Triton MLA
    # kernels (set per instance in __init__); the torch backend does not qualify.
    supports_cuda_graphs = False
    model_class: type[DeepseekModel] = DeepseekModel  # (Mistral 4's adds Llama 4's query scaling: models/mistral4.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        """kernels: "torch" | "triton" forces the kernel set, the latent attention's included (tests run the
        Triton one on CPU in the interpreter)."""
        super().__init__()
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        if int(spec.hf_config.get("pretraining_tp") or 1) != 1:
            raise UnsupportedModelError("config.json: pretraining_tp other than 1 is not supported")
        if spec.rotary_dim is not None:
            raise UnsupportedModelError(f"config.json: partial_rotary_factor is not supported for {spec.architecture}")
        self.spec = spec
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        self.num_mtp_layers = _int(spec.hf_config, "num_nextn_predict_layers", 0, minimum=0)
        self.mla = mla_shape(spec, self.version)
        self.moe = self.read_moe(spec)
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        # The MLA kernels with the Triton set, the torch reference otherwise (models/mla_attention.py).
        self.backend = mla_backend(device, self.kernels, self.mla)
        self.supports_cuda_graphs = isinstance(self.backend, MlaTritonBackend)
        self.model_dtype = dtype
        self.model = self.model_class(spec, self.mla, self.moe, self.backend, self.ops, dtype, device)
        self.lm_head = (None if spec.tie_word_embeddings else
                        ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device))

    def read_moe(self, spec: ModelSpec) -> DeepseekMoeConfig | None:
        """The config's experts, routed as this family's reference routes them."""
        return moe_config(spec, self.version)

    def finalize_weights(self) -> None:
        """Quantized layers' runners, then each attention's kv_b_proj absorbed (W_UK, W_UV)."""
        super().finalize_weights()
        for module in self.modules():
            if isinstance(module, MlaAttention):
                module.absorb_kv_b(self.model_dtype)

    def _expected_keys(self) -> set[str]:
        return expected_checkpoint_keys(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors in, stacking each layer's experts; every piece set exactly once. The
        num_nextn_predict_layers layers after num_hidden_layers (multi-token prediction) are skipped."""

        def base(item: tuple[str, Any]) -> bool:
            name = item[0]
            if name == "lm_head.weight" and self.lm_head is None:
                return False
            layer = _LAYER_INDEX.match(name)
            # (a multi-token-prediction layer the config declares: num_nextn_predict_layers)
            return layer is None or not 0 <= int(layer[1]) - self.spec.num_layers < self.num_mtp_layers

        load_deepseek_tensors(self, filter(base, weights), self.spec.architecture, self._expected_keys())

    def mtp_decoder_layer(self, index: int) -> tuple[AttentionBackend, nn.Module]:
        """(A latent-attention backend of its own, the MTP layer's decoder layer: one of this model's.)"""
        device = self.lm_head_weight.device
        backend = mla_backend(device, self.kernels, self.mla)
        return backend, DeepseekDecoderLayer(self.spec, index, self.mla, self.moe, backend, self.ops,
                                             self.model.embed_tokens.weight.dtype, device)

    def load_mtp_tensors(self, mtp: nn.Module, weights: Iterable[tuple[str, Any]], expected: set[str]) -> None:
        load_deepseek_tensors(mtp, weights, self.spec.architecture, expected)

    def finalize_mtp(self, mtp: nn.Module) -> None:
        """After the MTP layer's load: its attention's kv_b_proj absorbed, as the model's own (finalize_weights)."""
        for module in mtp.modules():
            if isinstance(module, MlaAttention):
                module.absorb_kv_b(self.model_dtype)


def load_deepseek_tensors(model: nn.Module, weights: Iterable[tuple[str, Any]], architecture: str,
                          expected: set[str]) -> None:
    """HF-named tensors into `model`'s DeepSeek layers (each layer's experts stacked, gate / up merged, the rest by
    name), then every expected piece checked (the model, and a checkpoint's MTP layer: models/deepseek_mtp.py)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        prefix, _, leaf = name.rpartition(".")
        parent, _, proj = prefix.rpartition(".")
        expert = _EXPERT_NAME.match(name)
        try:
            if expert is not None and isinstance(modules.get(expert["experts"]), FusedMoE):
                shard = expert["proj"].removesuffix("_proj")
                e = int(expert["expert"])
                modules[expert["experts"]].load_expert_weight(expert["leaf"], e, shard, tensor)
                key = f"{expert['experts']}#{e}.{shard}.{expert['leaf']}"
            elif proj in _MERGED and isinstance(merged := modules.get(f"{parent}.gate_up_proj"), MergedLinear):
                if not linear_takes(merged, f"{parent}.gate_up_proj", leaf, _MERGED[proj]):
                    unexpected.append(name)
                    continue
                merged.load_weight(leaf, tensor, _MERGED[proj])
                key = f"{parent}.gate_up_proj.{leaf}#{_MERGED[proj]}"
            else:
                owner, param = modules.get(prefix), params.get(name)
                if owner is None or not (param is not None or linear_takes(owner, prefix, leaf, None)):
                    unexpected.append(name)
                    continue
                load_into(owner, param, leaf, tensor)
                key = name
        except ValueError as e:
            raise ModelLoadError(f"tensor {name!r}: {e} (config.json does not match the weights?)") from e
        loaded.add(key)
    check_all_loaded(architecture, unexpected, expected, loaded)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 / R1 / Kimi-K2: sigmoid routing with the correction bias; rope_interleave from config.json."""

    version = 3
