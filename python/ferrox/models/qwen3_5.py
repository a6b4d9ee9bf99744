"""Qwen3.5 / Qwen3.6 and Qwen3-Next: hybrid decoders of Gated DeltaNet and gated full attention.

Layers follow config.json's layer_types (Qwen3-Next: every full_attention_interval-th layer is full attention):
- "linear_attention": layers/gated_delta_net.py, whose per-request recurrent states sit in pools beside the KV
  cache (worker/recurrent_states.py). These layers have no KV cache: the loader gives them a zero-head cache
  shape (loader/model_config.py), so the KV budget counts only the full-attention layers.
- "full_attention": Qwen3's attention (per-head q/k RMSNorm, rotary over the first partial_rotary_factor of
  each head) whose q_proj also yields an output gate: per head [q | gate] rows, o = attn * sigmoid(gate).
The MLP is dense (Qwen3.5), or routed experts with a shared expert under its sigmoid gate (Qwen3.5-MoE /
Qwen3.6-35B-A3B always renormalise the top-k weights; Qwen3-Next as norm_topk_prob says, with dense layers where
mlp_only_layers / decoder_sparse_step put them): models/moe.py MoeBlock.

RMSNorms are zero-centred (output * (1 + weight), Gemma's): the loader adds 1 to those weights; the gated norm
inside the linear attention is a plain one. Partial rotary: q / k rows and their norm weights are put in
whole-head pairs at load (layers/rotary.py partial_rotary_order), the gate rows left in place.

Qwen3-Next stores the linear attention's input projections fused and interleaved per key-head group
(in_proj_qkvz, in_proj_ba); they are cut into Qwen3.5's separate q / k / v / z / b / a rows at load
(`split_qwen3_next_projections`). The multi-token-prediction layer (mtp.*) is read only as a drafter under
speculative_config method 'mtp' (models/qwen3_5_mtp.py, worker/mtp_proposer.py).

Block-wise FP8 checkpoints (the FP8 releases: Qwen3.5-397B-A17B-FP8, Qwen3.6-35B-A3B-FP8,
Qwen3-Next-80B-A3B-Instruct-FP8): the linear attention's in_proj_qkv / in_proj_z / out_proj (Qwen3-Next: the fused
in_proj_qkvz, whose block scales are cut with its rows, each group component being whole weight blocks), the full
attention's o_proj, the dense and shared-expert MLPs and the routed experts run FP8; the full attention's q / k / v
are dequantized at load and in_proj_b / in_proj_a (Qwen3-Next: in_proj_ba) stay float (`check_quantization`).

Tensor parallelism: the full attention's query heads (each with its gate rows) and KV heads shard as Llama's
(layers/linear.py QKVLinear), the linear attention's by key-head groups (layers/gated_delta_net.py: in_proj_qkv
is cut into its q, k and v rows at load so that each rank takes its share of each), the experts as models/moe.py
MoeBlock's (sharded, or whole under expert parallelism; the shared expert's partial summed with theirs). Head
counts that do not split are refused at start (distributed/sharding.py check_tp_shapes).

The multimodal checkpoints (Qwen3_5ForConditionalGeneration and its MoE twin, the releases' architectures) put
Qwen3-VL's vision tower on these decoders: models/qwen3_5_vl.py.

LoRA: adapters on both token mixers' projections (the full attention's q/k/v/o, the linear attention's
in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; Qwen3-Next's in_proj_qkvz, in_proj_ba), the dense MLPs and,
on the text models (Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM), the routed experts and the shared expert
(lora/moe_targets.py; shared_expert_gate refused by name, as vLLM leaves it alone; the multimodal MoE's experts are
refused by name: vLLM reads their adapters stacked). Their lora_B rows go through this loader's row edits
(`lora_rewrite`, lora/rewrite.py): the partial-rotary q/k row order, in_proj_qkv cut into its q, k and v rows,
Qwen3-Next's fused projections cut, the multimodal checkpoints' `model.language_model.` prefix (their vision tower
takes none). Prefix caching keeps apart what each adapter computed: a state snapshot is keyed by the block
hash, which the request's adapter seeds (rust/prefix_cache.rs root_hash).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend, get_attention_backend
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.kv_cache import KVCacheScales
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.distributed.sharding import check_tp_shapes, materialize, row_block, shape_of
from ferrox.kernels import select_kernels
from ferrox.layers.gated_delta_net import GatedDeltaNet, step_state_rows
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import QKVLinear, RowParallelLinear
from ferrox.layers.ops import DeviceOps, Rope, for_device
from ferrox.layers.quant.method import get_quant_config, use_quant_config
from ferrox.layers.rotary import RotaryEmbedding, partial_rotary_order
from ferrox.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError, hybrid_layer_types
from ferrox.models.decoder_stack_lm import DecoderStackLM
from ferrox.models.glm4 import reorder_head_rows
from ferrox.models.hybrid_layer import HybridMixingLayer
from ferrox.models.llama import LlamaMLP
from ferrox.models.moe import MoeBlock, expected_checkpoint_keys, load_moe_tensors
from ferrox.models.qwen3_vl_moe import unfuse_experts

_MERGED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    # (in_proj_qkv arrives cut into its q, k and v rows: Qwen3_5ForCausalLM._rewritten)
    "in_proj_q": ("qkvz_proj", "q"),
    "in_proj_k": ("qkvz_proj", "k"),
    "in_proj_v": ("qkvz_proj", "v"),
    "in_proj_z": ("qkvz_proj", "z"),
    "in_proj_b": ("ba_proj", "b"),
    "in_proj_a": ("ba_proj", "a"),
}
# Zero-centred norms (module docstring): their checkpoint weights + 1.
_ZERO_CENTRED = re.compile(r"(layernorm|^model\.norm|self_attn\.q_norm|self_attn\.k_norm)\.weight$")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class GatedAttention(nn.Module):
    """Full attention with Qwen3's q/k norms and an output gate (module docstring). Under tensor parallelism
    num_heads / num_kv_heads are this rank's (QKVLinear: each local query head's [q | gate] rows)."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype, device: Any,
                 *, float_qkv: bool = False):
        """float_qkv: q/k/v in the model dtype whatever the quantization (a block-FP8 checkpoint's, dequantized at
        load: Qwen3_5ForCausalLM)."""
        super().__init__()
        self.head_dim = d = spec.head_dim
        self.scale = self.head_dim ** -0.5
        with use_quant_config(None) if float_qkv else contextlib.nullcontext():
            self.qkv_proj = QKVLinear(spec.hidden_size, spec.num_heads, spec.num_kv_heads, d,
                                      bias=spec.attention_bias, dtype=dtype, device=device, q_rows_per_head=2 * d)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * d, spec.hidden_size, bias=spec.attention_bias, dtype=dtype,
                                        device=device)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device, ops)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps, dtype, device, ops)
        self.backend = backend
        self.kv_scales = KVCacheScales(device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        q_gate = qkv[:, :2 * h * d].view(t, h, 2 * d)
        gate = q_gate[..., d:].reshape(t, h * d)
        q = self.q_norm(q_gate[..., :d].contiguous())
        k = self.k_norm(qkv[:, 2 * h * d:(2 * h + kv) * d].reshape(t, kv, d))
        v = qkv[:, (2 * h + kv) * d:].view(t, kv, d)
        q, k = rope.rotate_qk(torch.cat([q, k], dim=1), h)
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.kv_scales)
        return self.o_proj(o.reshape(t, h * d) * torch.sigmoid(gate))


class HybridDecoderLayer(HybridMixingLayer):
    def __init__(self, spec: ModelSpec, kind: str, mlp: nn.Module, backend: AttentionBackend, ops: DeviceOps,
                 dtype: torch.dtype, device: Any, *, float_qkv: bool = False):
        super().__init__()
        config = spec.hf_config
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                spec.hidden_size, num_k_heads=int(config["linear_num_key_heads"]),
                num_v_heads=int(config["linear_num_value_heads"]), head_k_dim=int(config["linear_key_head_dim"]),
                head_v_dim=int(config["linear_value_head_dim"]), conv_kernel=int(config["linear_conv_kernel_dim"]),
                eps=spec.rms_norm_eps, dtype=dtype, device=device, ops=ops)
        else:
            self.self_attn = GatedAttention(spec, backend, ops, dtype, device, float_qkv=float_qkv)
        self.mlp = mlp

    def recurrent_mixer(self) -> nn.Module | None:
        return self.linear_attn

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, kv_cache: torch.Tensor,
                meta: AttentionMetadata, step: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.mix(x, residual, rope, kv_cache, meta, step)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype, device: Any,
                 *, float_qkv: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        moe = spec.moe
        renormalize = moe is not None and (moe.norm_topk_prob or spec.hf_config.get("model_type") != "qwen3_next")

        def mlp(i: int) -> nn.Module:
            if moe is not None and moe.is_sparse(i):
                return MoeBlock(spec, moe, ops, dtype, device, renormalize=renormalize)
            return LlamaMLP(spec, ops, dtype, device)

        kinds = hybrid_layer_types(spec.hf_config)
        assert kinds is not None  # (Qwen3_5ForCausalLM checked it)
        self.layers = nn.ModuleList(HybridDecoderLayer(spec, kind, mlp(i), backend, ops, dtype, device,
                                                       float_qkv=float_qkv) for i, kind in enumerate(kinds))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)
        self.rotary = RotaryEmbedding.for_spec(spec, device, ops)
        self.decode_path = DecodePath()  # (the general layers every step; a one-row lm_head as any model's)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, h.dtype)
        step = step_state_rows(meta)
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, rope, kv_caches[i], meta, step)
        h, _ = self.norm(h, residual)
        return h


class Qwen3_5ForCausalLM(DecoderStackLM):
    # Tested with gloo on CPU (tests/models/test_qwen3_5.py); NCCL runs the same layers.
    supports_tensor_parallel = True
    # Block-wise FP8 checkpoints (the FP8 releases) and quantization="fp8" at load: check_quantization.
    supports_quantization = True
    supports_quantized_gguf = False
    # Text weights under model.language_model.* (the multimodal layout) are read as model.*.
    _PREFIXES = (("model.language_model.", "model."),)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__()
        if spec.hidden_act not in ("silu", "swish"):
            raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported (only silu)")
        if hybrid_layer_types(spec.hf_config) is None or spec.hf_config.get("linear_conv_kernel_dim") is None:
            raise ModelLoadError(f"config.json: {spec.architecture} needs a hybrid text config (model_type "
                                 "qwen3_5_text, qwen3_5_moe_text or qwen3_next, with the linear_* fields of its Gated "
                                 "DeltaNet layers)")
        self.spec = spec
        tp = get_tp_group()
        check_tp_shapes(spec, tp.size, expert_parallel=tp.expert_parallel)
        self.kernels = select_kernels(device, kernels)
        self.ops = for_device(device, self.kernels)
        self.backend = get_attention_backend(device, self.kernels)
        self.fp8_block = check_quantization(spec, get_quant_config())
        self.model = HybridModel(spec, self.backend, self.ops, dtype, device, float_qkv=self.fp8_block is not None)
        self.lm_head = (None if spec.tie_word_embeddings else
                        ParallelLMHead(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device))
        d, rotary = spec.head_dim, spec.rotary_dim
        order = None if rotary is None else partial_rotary_order(d, rotary)
        self.rotary_order = order
        # q_proj's head rows are [q | gate]: the q half reordered, the gate half kept.
        self.q_gate_order = None if order is None else torch.cat([order, torch.arange(d, 2 * d)])

    # ---- loading --------------------------------------------------------------------------------------
    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs through the checkpoint's rewrite (lora/rewrite.py), less its FP8
        steps (dequantizing acts on columns; a B is float): prefixes, Qwen3-Next's fused projections and
        in_proj_qkv cut into rows, the partial-rotary q/k row order; the tower's and MTP layer's dropped. The
        rewrite's other edits (norms + 1, conv kernels reshaped) never meet a projection's weight."""
        return self._rewritten(pairs, quantized=False)

    def _rewritten(self, weights: Iterable[tuple[str, Any]], *, quantized: bool = True) -> Iterator[tuple[str, Any]]:
        """The checkpoint stream in this model's terms (module docstring): prefixes, Qwen3-Next's fused
        projections, in_proj_qkv cut into its q, k and v rows (each sharded by rank: layers/gated_delta_net.py),
        zero-centred norms + 1, partial-rotary row order, conv kernels [C, 1, W] -> [C, W]. quantized False: no
        FP8 block handling (lora_rewrite)."""
        d = self.spec.head_dim
        config = self.spec.hf_config
        key_dim = int(config["linear_num_key_heads"]) * int(config["linear_key_head_dim"])
        value_dim = int(config["linear_num_value_heads"]) * int(config["linear_value_head_dim"])
        block = self.fp8_block if quantized else None
        stream = split_qwen3_next_projections(weights, self.spec.hf_config, block)
        if block is not None:
            stream = dequantized_attention(stream, block)
        for name, tensor in stream:
            for old, new in self._PREFIXES:
                if name.startswith(old):
                    name = new + name[len(old):]
            if name.startswith(("mtp.", "model.visual.")) or name.endswith(_IGNORED_SUFFIXES):
                continue
            if name.endswith(".linear_attn.in_proj_qkv.weight"):
                rows = shape_of(tensor)[0] if shape_of(tensor) else 0
                if rows != 2 * key_dim + value_dim:
                    raise ModelLoadError(f"tensor {name!r}: {rows} rows, config.json's linear attention has "
                                         f"{2 * key_dim + value_dim} (2 x {key_dim} q/k + {value_dim} v)")
                base = name[:-len("in_proj_qkv.weight")]
                yield f"{base}in_proj_q.weight", row_block(tensor, 0, key_dim)
                yield f"{base}in_proj_k.weight", row_block(tensor, key_dim, key_dim)
                yield f"{base}in_proj_v.weight", row_block(tensor, 2 * key_dim, value_dim)
                continue
            if name.endswith(".linear_attn.in_proj_qkv.weight_scale_inv") and block is not None:
                # (block rows: check_quantization made the q / k / v cuts fall on block edges)
                bn = block[0]
                base = name[:-len("in_proj_qkv.weight_scale_inv")]
                for part, start, rows in (("q", 0, key_dim), ("k", key_dim, key_dim), ("v", 2 * key_dim, value_dim)):
                    yield f"{base}in_proj_{part}.weight_scale_inv", row_block(tensor, start // bn, -(-rows // bn))
                continue
            if name.endswith(".linear_attn.conv1d.weight"):
                value = materialize(tensor)
                tensor = value.reshape(value.shape[0], -1)
            elif _ZERO_CENTRED.search(name):
                tensor = materialize(tensor).float() + 1.0
                if self.rotary_order is not None and ("q_norm" in name or "k_norm" in name):
                    tensor = reorder_head_rows(tensor, d, self.rotary_order)
            elif self.rotary_order is not None and name.endswith(".self_attn.k_proj.weight"):
                tensor = reorder_head_rows(tensor, d, self.rotary_order)
            elif self.q_gate_order is not None and name.endswith(".self_attn.q_proj.weight"):
                tensor = reorder_head_rows(tensor, 2 * d, self.q_gate_order)
            yield name, tensor

    def _expected_keys(self) -> set[str]:
        return expected_checkpoint_keys(self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        stream = (item for item in self._rewritten(weights)
                  if not (item[0] == "lm_head.weight" and self.lm_head is None))
        load_hybrid_tensors(self, stream, self.spec, self._expected_keys())

    # The checkpoint's MTP layer: its tensors' prefix (worker/mtp_proposer.py reads them).
    mtp_checkpoint_prefix = "mtp."

    def multi_token_predictor(self, quant_config: Any = None, *, float_fc: bool = False) -> nn.Module:
        """The checkpoint's MTP layer (mtp.*) as a drafter sharing this model's embedding and lm_head
        (models/qwen3_5_mtp.py), built but not loaded; quant_config None: all float; float_fc: its fc float."""
        from ferrox.models.qwen3_5_mtp import Qwen3_5MultiTokenPredictor

        return Qwen3_5MultiTokenPredictor(self, quant_config, float_fc=float_fc)


def load_hybrid_tensors(model: nn.Module, stream: Iterable[tuple[str, Any]], spec: ModelSpec,
                        expected: set[str]) -> None:
    """Tensors already in these layers' terms (Qwen3_5ForCausalLM._rewritten) into `model`: fused experts unfused,
    then models/moe.py's loader with these layers' merged projections."""
    if spec.moe is not None:
        stream = unfuse_experts(stream, spec.hidden_size, spec.moe.intermediate_size)
    load_moe_tensors(model, stream, spec.architecture, expected, _MERGED)


def check_quantization(spec: ModelSpec, quant: Any) -> tuple[int, int] | None:
    """The weight blocks of a block-wise FP8 checkpoint (None: unquantized, or quantization="fp8" at load), else
    UnsupportedModelError naming what is not taken. Such a checkpoint's full-attention q / k / v are dequantized
    at load (their rows are reordered for the partial rotary across the 128-row blocks of a 256-dim head, which
    would part rows from their scales; they are a quarter of the layers' attention only), and the q / k / v rows
    of in_proj_qkv must be cut on block edges -- Qwen3-Next's in_proj_qkvz each key-head group's q, k, v and z
    rows, so that its block scales are cut as its rows are (split_qwen3_next_projections)."""
    from ferrox.layers.quant.fp8 import Fp8Config
    from ferrox.layers.quant.fp8_block import Fp8BlockConfig

    if quant is None or (isinstance(quant, Fp8Config) and quant.online_quantization):
        return None
    if not isinstance(quant, Fp8BlockConfig) or quant.name != "fp8":
        raise UnsupportedModelError(f"quantization {quant.name!r}: {spec.architecture} takes block-wise FP8 checkpoints "
                                    "(quant_method 'fp8' with weight_block_size: the FP8 releases) or "
                                    "quantization='fp8' at load")
    config = spec.hf_config
    bn = quant.block[0]
    if config.get("model_type") == "qwen3_next":
        dk = int(config["linear_key_head_dim"])
        dv = int(config["linear_num_value_heads"]) // int(config["linear_num_key_heads"]) * int(
            config["linear_value_head_dim"])
        if dk % bn or dv % bn:
            raise UnsupportedModelError(
                f"quantization_config.weight_block_size {list(quant.block)}: Qwen3-Next's in_proj_qkvz holds, per key "
                f"head, {dk} q, {dk} k, {dv} v and {dv} z rows, which do not each fall on its {bn}-row weight blocks "
                "(its block scales could not be cut with the rows)")
    key_dim = int(config["linear_num_key_heads"]) * int(config["linear_key_head_dim"])
    if key_dim % bn:
        raise UnsupportedModelError(f"quantization_config.weight_block_size {list(quant.block)}: in_proj_qkv's q / k "
                                    f"blocks of {key_dim} rows do not fall on its {bn}-row weight blocks")
    return quant.block


def dequantized_attention(weights: Iterable[tuple[str, Any]], block: tuple[int, int]) -> Iterator[tuple[str, Any]]:
    """The stream with each full-attention q / k / v projection's FP8 codes and block scales replaced by its
    float32 weight (check_quantization says why), the rest passed as it comes."""
    from ferrox.kernels.fp8_block_gemm import dequantize_fp8_blocks

    held: dict[str, dict[str, Any]] = {}
    for name, tensor in weights:
        match = _ATTENTION_QKV.search(name)
        if match is None:
            yield name, tensor
            continue
        module = name[:match.start(2) - 1]
        parts = held.setdefault(module, {})
        parts[match[2]] = tensor
        if len(parts) == 2:
            del held[module]
            yield f"{module}.weight", dequantize_fp8_blocks(materialize(parts["weight"]),
                                                            materialize(parts["weight_scale_inv"]).float(), block,
                                                            torch.float32)
    for module, parts in held.items():  # (one half missing: named by the loader's check)
        for leaf, tensor in parts.items():
            yield f"{module}.{leaf}", tensor


_ATTENTION_QKV = re.compile(r"\.self_attn\.([qkv])_proj\.(weight|weight_scale_inv)$")


def split_qwen3_next_projections(weights: Iterable[tuple[str, Any]], config: dict[str, Any],
                                 block: tuple[int, int] | None = None) -> Iterator[tuple[str, Any]]:
    """Qwen3-Next's in_proj_qkvz [Hk x (2 Dk + 2 r Dv), hidden] and in_proj_ba [Hk x 2 r, hidden] (r = Hv / Hk
    value heads per key head, rows grouped by key head: q, k, then its r v heads and r z heads; b's r then a's r)
    as Qwen3.5's in_proj_qkv (all q, all k, all v), in_proj_z, in_proj_b, in_proj_a. Other tensors pass.

    block: a block-FP8 checkpoint's weight blocks [bn, bk]. in_proj_qkvz's weight_scale_inv (a row per bn weight
    rows) is cut as its weight is, each group component being whole blocks (check_quantization), into
    in_proj_qkv's (all q, all k, all v: the layout Qwen3.5's releases store) and in_proj_z's; an FP8 in_proj_ba
    (with its weight_scale_inv) is dequantized to float32 first, since b / a stay float (layers/gated_delta_net.py).
    """
    hk, hv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    dk, dv, r = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"]), hv // hk
    bn = block[0] if block is not None else 1
    held: dict[str, dict[str, Any]] = {}  # in_proj_ba's halves, until its weight can be read as float
    for name, tensor in weights:
        match = _NEXT_FUSED.search(name)
        if match is None or (match[2] == "weight_scale_inv" and block is None):
            yield name, tensor
            continue
        base, leaf = name[:match.start(1)], match[2]
        if match[1] == "in_proj_qkvz":
            unit = 1 if leaf == "weight" else bn  # (scale rows: one per bn weight rows)
            rows = hk * (2 * dk + 2 * r * dv) // unit
            if shape_of(tensor)[:1] != (rows,):
                raise ModelLoadError(f"tensor {name!r}: shape {shape_of(tensor)}, config.json's linear attention has "
                                     f"{rows} rows ({hk} key-head groups of q, k, v, z)")
            value = materialize(tensor)
            groups = value.reshape(hk, rows // hk, -1)
            q, k, v, z = groups.split([dk // unit, dk // unit, r * dv // unit, r * dv // unit], dim=1)
            yield f"{base}in_proj_qkv.{leaf}", torch.cat([t.reshape(-1, value.shape[-1]) for t in (q, k, v)])
            yield f"{base}in_proj_z.{leaf}", z.reshape(-1, value.shape[-1])
            continue
        parts = held.setdefault(base, {})
        parts[leaf] = tensor
        if "weight" not in parts:
            continue
        weight = parts["weight"] = materialize(parts["weight"])
        if block is not None and weight.dtype == torch.float8_e4m3fn:
            if "weight_scale_inv" not in parts:
                continue
            from ferrox.kernels.fp8_block_gemm import dequantize_fp8_blocks

            weight = dequantize_fp8_blocks(weight, materialize(parts["weight_scale_inv"]).float(), block, torch.float32)
        del held[base]
        b, a = weight.reshape(hk, 2 * r, -1).split([r, r], dim=1)
        yield f"{base}in_proj_b.weight", b.reshape(-1, weight.shape[-1])
        yield f"{base}in_proj_a.weight", a.reshape(-1, weight.shape[-1])
    for base, parts in held.items():  # (an FP8 weight without its scales, or scales alone: named by the loader)
        for leaf, tensor in parts.items():
            yield f"{base}in_proj_ba.{leaf}", tensor


_NEXT_FUSED = re.compile(r"\.linear_attn\.(in_proj_qkvz|in_proj_ba)\.(weight|weight_scale_inv)$")


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.moe is None:
            raise UnsupportedModelError(f"config.json: {spec.architecture} needs num_experts")
        super().__init__(spec, dtype, device, kernels=kernels)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    """Qwen3-Next-80B-A3B: the same layers; its fused projections are cut at load (split_qwen3_next_projections)
    and its router renormalises as norm_topk_prob says (HybridModel)."""
