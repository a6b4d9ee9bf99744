"""GLM-4-0414 (THUDM/GLM-4-9B-0414, GLM-4-32B-0414 and their Z1 / base variants: Glm4ForCausalLM).

The Llama decoder with three differences, as transformers' Glm4 defines them:

- sandwich norms: the attention output and the MLP output are each RMS-normed
  (post_self_attn_layernorm, post_mlp_layernorm) before their residual add, beside the usual pre-norms
  (input_layernorm, post_attention_layernorm);
- q/k/v carry a bias (`attention_bias`, on in every released checkpoint), o_proj never does;
- rotary over the first `partial_rotary_factor` (default 0.5, as in transformers) of each head in the
  INTERLEAVED layout: dims (2i, 2i + 1) pair, with frequency i. ferrox's kernels rotate whole heads in
  the half-split layout (i pairs with i + head_dim / 2), so each head's q and k rows (weights and biases)
  are reordered while loading (`interleaved_rotary_order`): pair (2i, 2i + 1) moves to (i, i + head_dim / 2)
  and the passed-through dims get frequency 0 (layers/rotary.py). q . k is unchanged by the same
  permutation of both; v and the outputs are not touched.

The checkpoint's fused `mlp.gate_up_proj` ([gate rows; up rows]) is cut by rows into the merged layer's
two shards (a tensor-parallel rank reads only its rows). Decoding takes the general path: the
four-norm layer is not the pre-norm shape the fused one-token kernels run (as Gemma 2's). Tensor
parallelism comes with the Llama layers. LoRA adapters get the same row edits (`lora_rewrite`, lora/rewrite.py):
their q_proj / k_proj lora_B rows permuted as the weights' are, a gate_up_proj lora_B cut into gate and up.
Refused by name: a checkpoint `quantization_config` (the q/k rows are permuted at load, which packed or
row-scaled tensors do not allow; `quantization="fp8"` quantizes the loaded weights instead) and hidden_act
other than silu. GLM-4-0414's GGUF files (llama.cpp's "glm4") load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.sharding import materialize, row_block, shape_of
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.quant.method import hf_quantization_config
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.layer_stack import ResidualLayerStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel

# transformers' Glm4Config / Glm4MoeConfig default when config.json names no partial_rotary_factor.
GLM_PARTIAL_ROTARY_FACTOR = 0.5
# q/k rows (and GLM-4.5's per-head q/k norm weights) whose order inside each head follows the rotary layout.
_ROTARY_ROWS = re.compile(r"\.self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias)$")


def glm_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with GLM's rotary width: transformers takes partial_rotary_factor 0.5 when config.json
    names none (the loader's spec then says every dim rotates)."""
    config = spec.hf_config
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    named = "partial_rotary_factor" in (rope or {}) or config.get("partial_rotary_factor") is not None
    if named:
        return spec
    return dataclasses.replace(spec, rotary_dim=int(spec.head_dim * GLM_PARTIAL_ROTARY_FACTOR))


def check_checkpoint_quantization(spec: ModelSpec, order: torch.Tensor | None, *, block_fp8: bool) -> None:
    """A checkpoint quantization_config the permuted q/k rows allow, else UnsupportedModelError naming it.
    block_fp8: the family takes block-wise FP8 (GLM-4.5-FP8, GLM-4.5-Air-FP8, GLM-4.6-FP8: `"quant_method":
    "fp8"` with `weight_block_size`), where a row moves inside its block of rows and so keeps its scale:
    allowed when `order` (the rows' order within a head) never takes a row across a block boundary (a
    128-dim head with 128-row blocks: each head is one block row). Other layouts (packed int4 rows,
    per-row scales) would need their scales and packing permuted too."""
    quant = hf_quantization_config(spec.hf_config)
    if quant is None:
        return
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if block_fp8 and method == "fp8" and isinstance(block, list) and len(block) == 2:
        rows = int(block[0])
        within = torch.arange(spec.head_dim) // rows
        if order is None or (spec.head_dim % rows == 0 and torch.equal(order // rows, within)):
            return
        raise UnsupportedModelError(
            f"config.json: quantization_config weight_block_size {block}: {spec.architecture}'s q/k rows are "
            f"permuted at load for the rotary layout, across {rows}-row blocks of its {spec.head_dim}-dim heads, "
            "which would separate rows from their block scales")
    raise UnsupportedModelError(
        f"config.json: quantization_config (quant_method {method!r}) is not supported for "
        f"{spec.architecture}: its q/k rows are permuted at load for the rotary layout, which quantized "
        "tensors (packed rows, per-row scales) do not allow"
        + (" (block-wise FP8 checkpoints load)" if block_fp8 else "")
        + "; load the unquantized checkpoint, with quantization='fp8' to quantize it at load time")


def interleaved_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Row order, within one head, that puts the interleaved layout (dims 2i, 2i + 1 pair; the first
    rotary_dim dims rotate) into ferrox's whole-head half-split pairs: new row j takes HF row order[j].
    Pair i lands at (i, i + head_dim / 2); the passed-through dims fill the rest of both halves."""
    passed = (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(0, rotary_dim, 2), torch.arange(rotary_dim, rotary_dim + passed),
                      torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim + passed, head_dim)])


def reorder_head_rows(tensor: Any, head_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Rows of every head of `tensor` ([heads * head_dim, ...] or one head's [head_dim] norm weight) put
    in `order`. Read whole: a tensor-parallel rank then takes its heads from the reordered tensor (a
    head's rows stay together)."""
    value = materialize(tensor)
    heads = value.shape[0] // head_dim
    rows = (torch.arange(heads)[:, None] * head_dim + order).reshape(-1)
    return value.index_select(0, rows.to(value.device))


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def without_mtp_layers(weights: Iterable[tuple[str, Any]], num_layers: int,
                       num_mtp_layers: int) -> Iterator[tuple[str, Any]]:
    """The stream without the multi-token-prediction layers' tensors (layers num_layers .. num_layers +
    num_mtp_layers - 1, after the model's own: GLM-4.5's, MiniMax-M2's), which the base model does not run."""
    for name, tensor in weights:
        layer = _LAYER_INDEX.match(name)
        if layer is not None and num_layers <= int(layer[1]) < num_layers + num_mtp_layers:
            continue
        yield name, tensor


def reorder_rotary_rows(weights: Iterable[tuple[str, Any]], head_dim: int,
                        order: torch.Tensor | None) -> Iterator[tuple[str, Any]]:
    """The checkpoint stream with each q/k tensor's head rows in `order` (None: unchanged)."""
    for name, tensor in weights:
        if order is not None and _ROTARY_ROWS.search(name):
            tensor = reorder_head_rows(tensor, head_dim, order)
        yield name, tensor


def interleaved_rotary_setup(spec: ModelSpec) -> torch.Tensor:
    """The whole-head row order of a family rotating interleaved pairs over every dim (ERNIE 4.5, Cohere), its checkpoint
    quantization checked (check_checkpoint_quantization). The family then keeps it as `rotary_order` and loads (and
    rewrites LoRA adapters' rows) through InterleavedRotaryRows."""
    order = interleaved_rotary_order(spec.head_dim, spec.head_dim)
    check_checkpoint_quantization(spec, order, block_fp8=False)
    return order


class InterleavedRotaryRows:
    """Mixin of a causal LM whose q/k rows are reordered at load (`rotary_order`); `rotary_stream` is the family's own
    edit of the checkpoint stream before the reordering (Cohere's per-head norms flattened, ERNIE's MTP tensors
    dropped)."""

    spec: ModelSpec
    rotary_order: torch.Tensor | None

    def rotary_stream(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        return weights

    def _rows_rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return reorder_rotary_rows(self.rotary_stream(weights), self.spec.head_dim, self.rotary_order)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._rows_rewritten(weights))  # type: ignore[misc]

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs with the checkpoint's q/k row order edit (lora/rewrite.py; the
        family's rotary_stream edits only norms and drops MTP tensors: row-only on a projection)."""
        return self._rows_rewritten(pairs)


class Glm4DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device, ops)

        self.input_layernorm, self.post_self_attn_layernorm = norm(), norm()
        self.post_attention_layernorm, self.post_mlp_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias, o_bias=False,
                                        qk_norm=False)
        self.mlp = LlamaMLP(spec, ops, dtype, device)

    def forward(self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        x = x + self.post_self_attn_layernorm(self.self_attn(self.input_layernorm(x), rope, kv_cache, meta))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class Glm4Model(ResidualLayerStack):
    layer_class = Glm4DecoderLayer  # (the four-norm layer is not the pre-norm shape the fused kernels run)


class Glm4ForCausalLM(LlamaForCausalLM):
    model_class: type[nn.Module] = Glm4Model
    reorders_partial_rotary = True
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        spec = glm_spec(spec)
        order = interleaved_rotary_order(spec.head_dim, spec.rotary_dim or spec.head_dim)
        # (its fused gate_up_proj is cut by rows at load, which a block scale's rows would have to follow)
        check_checkpoint_quantization(spec, order, block_fp8=False)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = order

    def _rows_rewritten(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        return reorder_rotary_rows(self._split_gate_up(weights), self.spec.head_dim, self.rotary_order)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._rows_rewritten(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Adapters' (module.weight, lora_B) pairs with the checkpoint's row edits (lora/rewrite.py): a fused
        gate_up_proj cut into gate_proj and up_proj rows, q/k rows permuted (row-only)."""
        return self._rows_rewritten(pairs)

    def _split_gate_up(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The stream with each fused mlp.gate_up_proj tensor cut into gate_proj and up_proj rows."""
        inter = self.spec.intermediate_size
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            if not prefix.endswith(".mlp.gate_up_proj"):
                yield name, tensor
                continue
            if shape_of(tensor)[:1] != (2 * inter,):
                raise ModelLoadError(f"tensor {name!r}: checkpoint shape {shape_of(tensor)}, the model expects "
                                     f"{2 * inter} rows ({inter} gate + {inter} up) (config.json does not match "
                                     "the weights?)")
            parent = prefix.removesuffix(".gate_up_proj")
            yield f"{parent}.gate_proj.{leaf}", row_block(tensor, 0, inter)
            yield f"{parent}.up_proj.{leaf}", row_block(tensor, inter, inter)


class GlmForCausalLM(Glm4ForCausalLM):
    """GLM-4-9B (THUDM/glm-4-9b-chat-hf, glm-4-9b-hf: GlmForCausalLM), transformers' Glm: GLM-4-0414's layers without
    the two sandwich norms -- Llama's pre-norm layers (so the fused one-token kernels), q/k/v biases (attention_bias,
    on when config.json does not say), o_proj without, the fused gate_up_proj cut at load, the interleaved partial
    rotary's q/k rows reordered at load. What GLM-4-0414 refuses, this refuses."""

    model_class = LlamaModel
    o_bias_never = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        bias = bool(spec.hf_config.get("attention_bias", True))  # (transformers' GlmConfig default)
        super().__init__(dataclasses.replace(spec, attention_bias=bias), dtype, device, kernels=kernels)


__all__ = ["Glm4ForCausalLM", "GlmForCausalLM", "InterleavedRotaryRows", "interleaved_rotary_setup", "check_checkpoint_quantization", "glm_spec",
           "interleaved_rotary_order", "reorder_rotary_rows"]
