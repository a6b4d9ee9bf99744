"""Mixture-of-experts families on the Llama decoder: Qwen2-MoE, Qwen3-MoE and Mixtral.

The attention, norms and rotary are Llama's (llama.py: LlamaAttention, with Qwen3's per-head q/k
norms as a switch); the MLP of a sparse layer is an MoeBlock: a router, the top-k routed experts
(layers/fused_moe.py, the fused Triton kernels on GPU) and, for Qwen2-MoE, a shared expert
scaled by its own sigmoid gate. Dense layers (Qwen's mlp_only_layers / decoder_sparse_step)
keep LlamaMLP.

The families differ only in switches: q/k/v bias (Qwen2-MoE), q/k norm (Qwen3-MoE), whether the
top-k weights are renormalised (Mixtral always; Qwen as norm_topk_prob says), and checkpoint
names (Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2 for gate/up/down).

A one-token decode step takes the backend's decode path like Llama's (attention/fused_decode.py on
the Triton backend): each layer describes itself (`one_token_view`), a sparse layer with its
MoeBlock in place of the dense MLP's projections.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.decode_path import DecodePath, OneTokenLayer, OneTokenMoe
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes
from ferrox.kernels import select_kernels
from ferrox.layers.fused_moe import FusedMoE, TopKRouter, experts_with_shared
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear
from ferrox.layers.ops import DeviceOps, for_device
from ferrox.layers.quant.method import use_quant_config
from ferrox.layers.rotary import RotaryEmbedding, check_rotary_dim
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, MoeSpec, UnsupportedModelError
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.llama import LlamaAttention, LlamaMLP, load_dense_tensor, load_kv_scale
from ferrox.models.load_check import check_all_loaded
from ferrox.models.pre_norm import PreNormDecoderLayer, run_pre_norm_layers

# HF names folded into a merged layer (attention, dense MLPs, the shared expert): (module, shard).
_MERGED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}
# One routed expert's tensor: <layer>.experts.<e>.<proj>.<leaf>, Qwen and Mixtral projection names.
_EXPERT_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.(?P<leaf>\w+)$")
_EXPERT_SHARDS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def expected_checkpoint_keys(model: nn.Module, skip: tuple[str, ...] = ()) -> set[str]:
    """Every checkpoint piece a model needs (models/load_check.check_all_loaded compares): plain parameters by
    name, merged-layer shards as `<module>.<leaf>#<shard>` (a quantized layer names its method's tensors),
    routed experts as `<experts>#<e>.<shard>.<leaf>`; modules under the `skip` prefixes (loaded by themselves)
    left out."""
    expected = set()
    for name, module in model.named_modules():
        if skip and name.startswith(skip):
            continue
        if isinstance(module, Linear):
            expected |= module.checkpoint_keys(name)
        elif isinstance(module, FusedMoE):
            expected |= {f"{name}#{e}.{shard}.{leaf}" for e, shard, leaf in module.expected_weights()}
        else:
            expected |= {f"{name}.{leaf}" if name else leaf for leaf, _ in module.named_parameters(recurse=False)}
    return expected


def load_routed_expert(modules: dict[str, nn.Module], name: str, tensor: Any) -> str | None:
    """One routed expert's tensor (`<experts>.<e>.<proj>.<leaf>`, Qwen's or Mixtral's projection names) into its
    FusedMoE; the key it loaded under (expected_checkpoint_keys' spelling), None when no FusedMoE takes it."""
    expert = _EXPERT_NAME.match(name)
    module = modules.get(expert["experts"]) if expert is not None and expert["proj"] in _EXPERT_SHARDS else None
    if expert is None or not isinstance(module, FusedMoE):
        return None
    shard = _EXPERT_SHARDS[expert["proj"]]
    module.load_expert_weight(expert["leaf"], int(expert["expert"]), shard, tensor)
    return f"{expert['experts']}#{int(expert['expert'])}.{shard}.{expert['leaf']}"


class MoeBlock(nn.Module):
    """Routed experts (+ an optional shared expert): the MLP of a sparse decoder layer."""

    # The fused one-token path (attention/fused_decode.py) routes with softmax top-k, as `route` does
    # here; a block that routes otherwise (GLM-4.5's grouped sigmoid top-k: glm4_moe.py) says False,
    # and its model's layers keep the general path.
    fused_decode_routing = True

    def __init__(self, spec: ModelSpec, moe: MoeSpec, ops: DeviceOps, dtype, device, *, renormalize: bool):
        super().__init__()
        self.top_k = moe.num_experts_per_tok
        self.renormalize = renormalize
        self.gate = TopKRouter(spec.hidden_size, moe.num_experts, device)
        self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype, device=device,
                                ops=ops)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            shared_spec = dataclasses.replace(spec, intermediate_size=moe.shared_expert_intermediate_size)
            self.shared_expert = LlamaMLP(shared_spec, ops, dtype, device)
            # A float [1, H] gate even in a quantized model (checkpoints keep it so, as vLLM reads them).
            with use_quant_config(None):
                self.shared_expert_gate = Linear(spec.hidden_size, 1, bias=False, dtype=dtype, device=device)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] float32, expert ids [T, k]) of each token: softmax top-k of the router."""
        return self.experts.route(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.shared_expert is None or self.shared_expert_gate is None:
            return self.experts(x, weights, ids)
        return experts_with_shared(self.experts, x, weights, ids, self.shared_expert, x,
                                   torch.sigmoid(self.shared_expert_gate(x)))


class MoeDecoderLayer(PreNormDecoderLayer):
    """LlamaDecoderLayer with the MLP chosen per layer (sparse or dense)."""

    def __init__(self, spec: ModelSpec, index: int, backend: AttentionBackend, ops: DeviceOps, dtype, device, *,
                 qkv_bias: bool, qk_norm: bool, renormalize: bool, block_class: type[MoeBlock] = MoeBlock,
                 attention_class: type[LlamaAttention] = LlamaAttention):
        super().__init__()
        moe = spec.moe
        assert moe is not None  # MoeForCausalLM checked it
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.self_attn = attention_class(spec, backend, ops, dtype, device, qkv_bias=qkv_bias,
                                         o_bias=spec.attention_bias, qk_norm=qk_norm, window=spec.window_of(index))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mlp: nn.Module = (block_class(spec, moe, ops, dtype, device, renormalize=renormalize)
                               if moe.is_sparse(index) else LlamaMLP(spec, ops, dtype, device))


    def one_token_view(self) -> OneTokenLayer:
        """This layer as a fused one-token decode path reads it (attention/decode_path.py)."""
        attn, mlp = self.self_attn, self.mlp
        dense = mlp if isinstance(mlp, LlamaMLP) else None
        return OneTokenLayer(input_norm=self.input_layernorm, qkv_proj=attn.qkv_proj, o_proj=attn.o_proj,
                             post_norm=self.post_attention_layernorm,
                             gate_up_proj=dense.gate_up_proj if dense is not None else None,
                             down_proj=dense.down_proj if dense is not None else None, num_heads=attn.num_heads,
                             num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, scale=attn.scale,
                             tp=attn.o_proj.tp, kv_scales=attn.kv_scales, q_norm=attn.q_norm, k_norm=attn.k_norm,
                             moe=OneTokenMoe(mlp) if dense is None else None, window=attn.window)


class MoeModel(nn.Module):
    block_class: type[MoeBlock] = MoeBlock  # the sparse layers' MLP (GLM-4.5 routes its own way: glm4_moe.py)
    # The layers' attention (MiniMax-M2 norms q and k over the whole projection: minimax_m2.py).
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *,
                 qkv_bias: bool, qk_norm: bool, renormalize: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        layers = [MoeDecoderLayer(spec, i, backend, ops, dtype, device, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                  renormalize=renormalize, block_class=self.block_class,
                                  attention_class=self.attention_class)
                  for i in range(spec.num_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        # As in LlamaModel: the model's op set, so Qwen3-MoE's q/k norms and rotary are one kernel.
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        views = [layer.one_token_view() for layer in layers]
        # One rank only: under tensor or expert parallelism (not yet run on two GPUs) the layers keep
        # the general path; the decode path may still fuse the lm_head.
        sharded = views[0].tp is not None and views[0].tp.size > 1
        # Blocks the fused path cannot route (MoeBlock.fused_decode_routing) keep the general path too.
        fusable = all(getattr(layer.mlp, "fused_decode_routing", True) for layer in layers)
        self.decode_path = backend.decode_path(views if fusable and not sharded else None, self.rotary.rope_rows)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        """inputs_embeds: the step's input rows when they are not all token embeddings (a prompt of embeddings:
        multimodal/prompt_embeds.py)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if self.decode_path.takes_step(h.shape[0], kv_caches, meta):
            return self.norm(self.decode_path.forward(h, positions, kv_caches, meta))
        return run_pre_norm_layers(self.layers, self.norm, h, self.rotary(positions, h.dtype), kv_caches, meta)


class MoeForCausalLM(DecoderStackLM):
    """The shared MoE causal LM; the registered families below set its switches."""

    qk_norm = False  # Qwen3-MoE: per-head RMSNorm of q and k
    always_renormalize = False  # Mixtral: top-k weights always sum to 1
    # load_weights puts partial-rotary q/k rows in whole-head pairs (GLM-4.5: glm4_moe.py; layers/rotary.py).
    reorders_partial_rotary = False
    # Attention and dense MLPs shard as Llama's; experts are sharded or split (layers/fused_moe.py).
    # Tested with gloo on CPU and NCCL on two GPUs (tests/engine/test_moe_gpu.py).
    supports_tensor_parallel = True
    # FP8 (per row, per block, online) in the linear layers and the experts; other methods are
    # refused by the experts (QuantConfig.moe_method).
    supports_quantization = True
    # Eager steps stay host-bound up to ~2k tokens (routing, the expert sort and the expert kernels
    # are ~18 launches a layer: 1,024- and 2,048-token Qwen3-30B-A3B prefills both took ~55-100 ms
    # eagerly on an H200), so piecewise CUDA graphs reach that far (worker/piecewise_graphs.py).
    piecewise_graph_tokens = 2048
    model_class: type[MoeModel] = MoeModel  # the decoder stack (Qwen3-VL-MoE's adds DeepStack: qwen3_vl_moe.py)
    # Modules a subclass loads itself (a vision tower): not among the pieces load_weights expects.
    own_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        """kernels: "torch" | "triton" forces a kernel set (tests run the Triton one on CPU in the
        interpreter); by default the device's (kernels.select_kernels)."""
        super().__init__()
        if spec.moe is None:
            raise UnsupportedModelError(f"config.json: {spec.architecture} needs num_experts / num_local_experts")
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        self.spec = spec
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        check_rotary_dim(spec, reorders_rows=self.reorders_partial_rotary)
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        self.backend = get_attention_backend(device, self.kernels)
        renormalize = self.always_renormalize or spec.moe.norm_topk_prob
        self.model = self.model_class(spec, self.backend, self.ops, dtype, device, qkv_bias=self.qkv_bias(spec),
                                    qk_norm=self.qk_norm, renormalize=renormalize)
        self.lm_head = (None if spec.tie_word_embeddings else
                        ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device))
        self.register_buffer("lm_head_colmajor", None, persistent=False)

    @staticmethod
    def qkv_bias(spec: ModelSpec) -> bool:
        return spec.attention_bias

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head_colmajor is not None:
            return self.lm_head_colmajor
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def finalize_weights(self) -> None:
        """Quantized layers' runners (FP8 experts: online ones quantized now); then column-major
        float projections where the op set asks (torch on CPU), for the reason
        LlamaForCausalLM.finalize_weights gives; each float expert's matrices too."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.finalize_quantized()
        if any(m.weight_method is not None and not m.weight_method.fused_decode
               for m in self.modules() if isinstance(m, Linear)):
            # As in Llama: layers that run their own matmuls send one-token steps the general way.
            self.model.decode_path = DecodePath()
        if not self.ops.column_major_weights:
            return
        for module in self.modules():
            if isinstance(module, (Linear, ParallelLMHead)) and getattr(module, "quant", None) is None:
                module.weight.data = module.weight.data.t().contiguous().t()
            elif isinstance(module, FusedMoE) and module.w13_scale is None:
                module.w13.data = module.w13.data.transpose(1, 2).contiguous().transpose(1, 2)
                module.w2.data = module.w2.data.transpose(1, 2).contiguous().transpose(1, 2)
        if self.lm_head is None:
            self.lm_head_colmajor = self.model.embed_tokens.weight.data.t().contiguous().t()

    def _expected_keys(self) -> set[str]:
        return expected_checkpoint_keys(self, self.own_weight_prefixes)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named checkpoint tensors in, stacking each layer's experts; every piece must be
        set exactly once."""
        load_moe_tensors(self, (item for item in weights
                                if not (item[0] == "lm_head.weight" and self.lm_head is None)),
                         self.spec.architecture, self._expected_keys())


def load_moe_tensors(model: nn.Module, weights: Iterable[tuple[str, Any]], architecture: str,
                     expected: set[str], merged: Mapping[str, tuple[str, str]] = _MERGED) -> None:
    """HF-named tensors into `model`'s MoE stack layers (routed experts stacked, the `merged` projections (checkpoint
    name -> (merged layer, shard)), KV scales, the rest by name), then every expected piece checked (MoeForCausalLM,
    the hybrid Qwens, a checkpoint's MTP layer)."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if load_kv_scale(modules, name, tensor):  # FP8 KV-cache scales
            continue
        hf_name = name
        name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's MLP module name
        expert = _EXPERT_NAME.match(name)
        try:
            if expert is not None and expert["proj"] in _EXPERT_SHARDS:
                key = load_routed_expert(modules, name, tensor)
            else:
                key = load_dense_tensor(modules, params, name, tensor, merged)
        except ValueError as e:
            raise ModelLoadError(f"tensor {hf_name!r}: {e} (config.json does not match the weights?)") from e
        if key is None:
            unexpected.append(hf_name)
        else:
            loaded.add(key)
    check_all_loaded(architecture, unexpected, expected, loaded)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """Qwen1.5-MoE / Qwen2-MoE: q/k/v bias (config `qkv_bias`, on when absent), a shared expert."""

    @staticmethod
    def qkv_bias(spec: ModelSpec) -> bool:
        return bool(spec.hf_config.get("qkv_bias", True)) or spec.attention_bias


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True


class MixtralForCausalLM(MoeForCausalLM):
    always_renormalize = True
