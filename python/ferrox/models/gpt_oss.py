"""OpenAI gpt-oss (gpt-oss-20b, gpt-oss-120b): a pre-norm mixture-of-experts decoder, as transformers'
GptOss defines it:

- attention: GQA with biases on q/k/v/o, half-split (NeoX) rotary with YaRN, a 128-token sliding
  window on alternate layers (config.json `layer_types`; else every even layer, transformers' rule),
  and attention sinks: a learned logit per head joined to every query's softmax denominator (it takes
  probability mass but adds no value). The sinks go to the attention backend with each call
  (attention/backend.py): the torch backend and both Triton kernels take them; cuDNN prefill and
  the CUDA decode kernel step aside;
- every MLP is sparse: a router with a bias, the top-k of its logits weighted by a softmax over
  those k, and experts with biases on both products and their own activation (layers/fused_moe.py
  SwigluOai: clamped gate and up, gate * sigmoid(1.702 gate) * (up + 1));
- checkpoints store the experts fused: `gate_up_proj` [E, H, 2I] with gate and up INTERLEAVED along
  2I (even columns gate, odd up) and `down_proj` [E, I, H] (transformers' save_pretrained layout),
  or, as published, in MXFP4 (`*_blocks` / `*_scales` of the [E, 2I, H] / [E, H, I] matrices,
  layers/quant/mxfp4.py). Both are turned into FusedMoE's w13 [E, 2I, H] (gate rows, then up rows)
  and w2 [E, H, I]. MXFP4 experts stay MXFP4 where the layer's kernels multiply them (the Triton set:
  layers/quant/mxfp4_moe.py, ~4.25 bits a weight), as vLLM serves these checkpoints; elsewhere (the
  torch loop on CPU) they are dequantized to the model dtype here while loading.

One-token decode steps take the general path (the fused one-token kernels have neither sinks nor
expert biases); the decode path still runs a one-row lm_head. Tensor parallelism shards attention by
heads (the sinks with them) and the experts as the other MoE families (by intermediate rows, or whole
experts with expert parallelism; the down bias added on one rank). A checkpoint quantization other than
MXFP4, or a `quantization` argument with an MXFP4 checkpoint (layers/quant/config.py), is refused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import (
    check_tp_shapes,
    even_split,
    experts_transposed,
    materialize,
    narrow,
    shape_of,
)
from ferrox.layers.fused_moe import FusedMoE, SwigluOai
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear, MergedLinear
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.quant.method import hf_quantization_config
from ferrox.layers.quant.mxfp4 import dequantize_mxfp4
from ferrox.layers.quant.mxfp4_moe import Mxfp4MoeMethod
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.layers.vocab_parallel import VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, linear_takes, load_kv_scale
from ferrox.models.load_check import check_all_loaded, load_into
from ferrox.models.pre_norm import PreNormDecoderLayer, run_pre_norm_layers

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
# The experts' checkpoint tensors (leaf under `<layer>.mlp.experts.`) -> the FusedMoE parameter they fill.
_EXPERT_TENSORS = {"gate_up_proj": "w13", "gate_up_proj_bias": "w13_bias", "down_proj": "w2", "down_proj_bias": "w2_bias"}
_MXFP4_PARTS = ("_blocks", "_scales")
_MXFP4_LEAVES = {f"{proj}{part}" for proj in ("gate_up_proj", "down_proj") for part in _MXFP4_PARTS}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class GptOssAttention(LlamaAttention):
    """Llama's attention (merged qkv, biases) with the layer's sinks passed to the backend."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, *, window: int):
        super().__init__(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias, o_bias=spec.attention_bias,
                         qk_norm=False, window=window)
        # float32 whatever the model dtype: every kernel reads them so (one logit per query head; under
        # tensor parallelism this rank's heads, as qkv_proj's).
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        tp = self.o_proj.tp
        self.total_heads = spec.num_heads
        self.head_start = even_split(spec.num_heads, tp.size, tp.rank, "num_attention_heads")[0]

    def load_weight(self, param_name: str, tensor: Any, shard: str | None = None) -> None:
        """The checkpoint's sinks [H]: this rank's heads."""
        if param_name != "sinks":
            raise ValueError(f"attention has no parameter {param_name!r} of its own")
        if tuple(shape_of(tensor)) != (self.total_heads,):
            raise ValueError(f"sinks: checkpoint shape {tuple(shape_of(tensor))}, model expects ({self.total_heads},)")
        self.sinks.data.copy_(narrow(tensor, 0, self.head_start, self.num_heads))

    def forward(self, x, rope: Rope, kv_cache, meta):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        q, k = rope.rotate_qk(qkv[:, :q_size + kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim),
                              self.num_heads)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales, window=self.window,
                                 sinks=self.sinks)
        return self.o_proj(o.reshape(t, q_size))


class GptOssRouter(nn.Module):
    """Router logits in float32 (weight and bias kept so: near-tied experts rank alike in any dtype)."""

    def __init__(self, hidden_size: int, num_experts: int, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight, self.bias)


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's routing as transformers writes it: the k largest logits, then a softmax over those k
    (the renormalised top-k of the full softmax, in other words). (weights float32 [T, k], ids [T, k])."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids


class GptOssMLP(nn.Module):
    def __init__(self, spec: ModelSpec, ops: DeviceOps, dtype, device, activation: SwigluOai):
        super().__init__()
        moe = spec.moe
        assert moe is not None  # GptOssForCausalLM checked it
        self.top_k = moe.num_experts_per_tok
        self.router = GptOssRouter(spec.hidden_size, moe.num_experts, device)
        self.experts = FusedMoE(moe.num_experts, spec.hidden_size, moe.intermediate_size, dtype=dtype, device=device,
                                ops=ops, bias=True, activation=activation, mxfp4=is_mxfp4(spec))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.router(x), self.top_k)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, spec: ModelSpec, index: int, backend: AttentionBackend, ops: DeviceOps, dtype, device,
                 activation: SwigluOai):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.self_attn = GptOssAttention(spec, backend, ops, dtype, device, window=spec.window_of(index))
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.mlp = GptOssMLP(spec, ops, dtype, device, activation)



class GptOssModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype, device, **_: Any):
        super().__init__()
        activation = swiglu_of(spec)
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(GptOssDecoderLayer(spec, i, backend, ops, dtype, device, activation)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        self.backend = backend
        self.qk_norm = False
        # The fused one-token kernels have no sinks and no expert biases: no layers for them (the
        # decode path keeps the one-row lm_head).
        self.one_token_layers = None
        self.decode_path = backend.decode_path(None, self.rotary.rope_rows)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None):
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return run_pre_norm_layers(self.layers, self.norm, h, self.rotary(positions, h.dtype), kv_caches, meta)


def swiglu_of(spec: ModelSpec) -> SwigluOai:
    """The experts' activation from config.json (swiglu_limit; swiglu_alpha, transformers 5's field,
    else 1.702 as in the published checkpoints' code)."""
    config = spec.hf_config
    try:
        return SwigluOai(alpha=float(config.get("swiglu_alpha") or 1.702), limit=float(config.get("swiglu_limit") or 7.0))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json: swiglu_alpha / swiglu_limit must be numbers ({e})") from e


def is_mxfp4(spec: ModelSpec) -> bool:
    """Whether the checkpoint stores the experts in MXFP4 (config.json quantization_config)."""
    quant = hf_quantization_config(spec.hf_config)
    return quant is not None and str(quant.get("quant_method", "")).lower() == "mxfp4"


def check_config(spec: ModelSpec) -> None:
    """Refuse, by name, what config.json may say that gpt-oss in ferrox does not do."""
    config = spec.hf_config
    moe = spec.moe
    if moe is None:
        raise UnsupportedModelError("config.json: GptOssForCausalLM needs num_local_experts")
    if moe.mlp_only_layers or moe.decoder_sparse_step != 1 or moe.shared_expert_intermediate_size:
        raise UnsupportedModelError("config.json: mlp_only_layers / decoder_sparse_step / "
                                    "shared_expert_intermediate_size are not gpt-oss fields (every layer is sparse)")
    per_token = config.get("experts_per_token")  # the original repo's name, kept in the published config.json
    if per_token is not None and per_token != moe.num_experts_per_tok:
        raise UnsupportedModelError(f"config.json: experts_per_token {per_token} differs from num_experts_per_tok "
                                    f"{moe.num_experts_per_tok}")
    if spec.hidden_act != "silu":
        # transformers' gpt-oss ignores hidden_act (its experts' activation is fixed); only the published value.
        raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported for "
                                    "GptOssForCausalLM (only silu, with the experts' clamped SwiGLU)")
    if spec.rotary_dim is not None:
        raise UnsupportedModelError("config.json: partial_rotary_factor is not supported for GptOssForCausalLM")
    quant = hf_quantization_config(config)
    if quant is not None and str(quant.get("quant_method", "")).lower() != "mxfp4":
        raise UnsupportedModelError(f"config.json: quantization_config.quant_method {quant.get('quant_method')!r} "
                                    "is not supported for GptOssForCausalLM (only mxfp4)")


class GptOssForCausalLM(LlamaForCausalLM):
    model_class = GptOssModel
    # Attention (sinks with their heads) and experts (sharded or split, layers/fused_moe.py) as the MoE families.
    supports_tensor_parallel = True
    supports_quantized_gguf = False
    supports_quantization = False  # (MXFP4 checkpoints are read here: kept MXFP4 or dequantized, mxfp4_moe.py)
    # As the other MoE families: eager steps stay host-bound to ~2k tokens (worker/piecewise_graphs.py).
    piecewise_graph_tokens = 2048

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_config(spec)
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        super().__init__(spec, dtype, device, kernels=kernels)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF-named tensors in: q/k/v into qkv_proj, the fused experts (bf16 layout or MXFP4) into
        each layer's FusedMoE, the rest by name. Every parameter must be set exactly once."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        linears = {name: m for name, m in modules.items() if isinstance(m, Linear)}
        expected = {p for p in params if p.rpartition(".")[0] not in linears}
        for name, linear in linears.items():
            expected |= linear.checkpoint_keys(name)
        # (MXFP4 experts are buffers, not parameters: expected all the same)
        expected |= {f"{name}.{w}" for name, m in modules.items() if isinstance(m, FusedMoE) for w in ("w13", "w2")}
        loaded: set[str] = set()
        unexpected: list[str] = []
        pending: dict[str, dict[str, torch.Tensor]] = {}  # an MXFP4 weight waiting for its other part
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if load_kv_scale(modules, name, tensor):
                continue
            prefix, _, leaf = name.rpartition(".")
            parent, _, proj = prefix.rpartition(".")
            try:
                experts = modules.get(prefix)
                if isinstance(experts, FusedMoE):
                    key = self._load_experts(experts, prefix, leaf, tensor, pending)
                    if key is None:  # half of an MXFP4 pair (kept), or not an expert tensor
                        if leaf not in _MXFP4_LEAVES:
                            unexpected.append(name)
                        continue
                elif proj in _QKV:
                    merged = modules.get(f"{parent}.qkv_proj")
                    if not isinstance(merged, MergedLinear) or not linear_takes(merged, f"{parent}.qkv_proj", leaf,
                                                                                  _QKV[proj]):
                        unexpected.append(name)
                        continue
                    merged.load_weight(leaf, tensor, _QKV[proj])
                    key = f"{parent}.qkv_proj.{leaf}#{_QKV[proj]}"
                else:
                    module = modules.get(prefix)
                    if module is None or not (name in params or linear_takes(module, prefix, leaf, None)):
                        unexpected.append(name)
                        continue
                    load_into(module, params.get(name), leaf, tensor)
                    key = name
            except ValueError as e:
                raise ModelLoadError(f"tensor {name!r}: {e} (config.json does not match the weights?)") from e
            loaded.add(key)
        for weight, parts in pending.items():
            missing = next(part for part in _MXFP4_PARTS if part not in parts)
            raise ModelLoadError(f"tensor {weight + missing!r} is missing (an MXFP4 weight needs both its _blocks "
                                 "and its _scales)")
        check_all_loaded(self.spec.architecture, unexpected, expected, loaded)

    @staticmethod
    def _load_experts(experts: FusedMoE, prefix: str, leaf: str, tensor: Any,
                      pending: dict[str, dict[str, torch.Tensor]]) -> str | None:
        """One fused expert tensor into `experts`; the parameter key it filled, or None (half of an
        MXFP4 pair, kept until the other half comes, or a name that is not an expert tensor)."""
        for part in _MXFP4_PARTS:
            if leaf in _MXFP4_LEAVES and leaf.endswith(part):
                base = leaf.removesuffix(part)
                parts = pending.setdefault(f"{prefix}.{base}", {})
                parts[part] = materialize(tensor)
                if len(parts) < 2:
                    return None
                del pending[f"{prefix}.{base}"]
                blocks, scales = parts["_blocks"], parts["_scales"]  # [E, rows, cols / 32, 16], [E, rows, cols / 32]
                method = experts.weight_method
                if isinstance(method, Mxfp4MoeMethod):  # kept packed; rows are whole, so de-interleave them
                    if base == "gate_up_proj":
                        blocks, scales = _deinterleave(blocks, 1), _deinterleave(scales, 1)
                    method.load_stacked(experts, _EXPERT_TENSORS[base], blocks, scales)
                else:  # -> [E, rows, cols] in the model dtype, rows the outputs
                    out_major = dequantize_mxfp4(blocks, scales, experts.w13.dtype)
                    _set_expert_weight(experts, base, out_major)
                return f"{prefix}.{_EXPERT_TENSORS[base]}"
        if leaf not in _EXPERT_TENSORS:
            return None
        if leaf.endswith("_bias"):
            _set_expert_bias(experts, leaf.removesuffix("_bias"), materialize(tensor))
        else:  # transformers' layout [E, in, out], transposed (and de-interleaved) as this rank reads its experts
            then = _gate_up_halves if leaf == "gate_up_proj" else None
            experts.load_stacked(_EXPERT_TENSORS[leaf], experts_transposed(tensor, then))
        return f"{prefix}.{_EXPERT_TENSORS[leaf]}"


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate / up interleaved along `dim` (gate at even indices) -> [gate | up] halves."""
    even = t.index_select(dim, torch.arange(0, t.shape[dim], 2, device=t.device))
    odd = t.index_select(dim, torch.arange(1, t.shape[dim], 2, device=t.device))
    return torch.cat([even, odd], dim=dim)


def _gate_up_halves(experts: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] rows with gate / up interleaved -> w13's gate rows, then up rows."""
    return _deinterleave(experts, 1)


def _set_expert_weight(experts: FusedMoE, proj: str, value: torch.Tensor) -> None:
    """gate_up_proj / down_proj of every expert, in the [E, out, in] layout."""
    if proj == "gate_up_proj":
        experts.load_stacked("w13", _deinterleave(value, 1))
    else:
        experts.load_stacked("w2", value)


def _set_expert_bias(experts: FusedMoE, proj: str, value: torch.Tensor) -> None:
    if proj == "gate_up_proj":
        experts.load_stacked("w13_bias", _deinterleave(value, 1))
    else:
        experts.load_stacked("w2_bias", value)

