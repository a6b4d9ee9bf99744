"""Mistral's native tensors (consolidated*.safetensors) under the Hugging Face names ferrox's families load --
vLLM's --load-format mistral.

    tok_embeddings.weight                       -> model.embed_tokens.weight
    norm.weight / output.weight                 -> model.norm.weight / lm_head.weight
    layers.N.attention.wq|wk|wv|wo.*            -> model.layers.N.self_attn.q_proj|k_proj|v_proj|o_proj.*
    layers.N.attention_norm / ffn_norm          -> model.layers.N.input_layernorm / post_attention_layernorm
    layers.N.feed_forward.w1|w2|w3.*            -> model.layers.N.mlp.gate_proj|down_proj|up_proj.*
    *.qscale_weight / *.qscale_act              -> *.weight_scale / *.input_scale (FP8: layers/quant/fp8.py)
    attention.k|v|kv_fake_quantizer.qscale_act  -> self_attn.k_scale|v_scale|kv_scale (an FP8 KV cache's)
    vision_encoder.* (a Pixtral tower)          -> vision_tower.* (attention.wq.. -> attention.q_proj..,
                                                   feed_forward.w1.. -> feed_forward.gate_proj..)
    vision_language_adapter.w_in|w_out          -> multi_modal_projector.linear_1|linear_2
    pre_mm_projector_norm / patch_merger        -> multi_modal_projector.norm / .patch_merger

The rotary layout differs too: Mistral's q/k rows hold each rotary pair side by side (the complex-number form),
Hugging Face's the first halves of the pairs, then the second halves (rotate_half). The rows of wq and wk (and
of a per-row scale) are permuted within each head as transformers' conversion scripts do; a tensor-parallel
rank's lazy read (distributed/sharding.py CheckpointSlice) is permuted the same way, reading the rows its heads
hold (whole heads: the permutation never crosses a head). A name not in the map is an error naming it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import CheckpointSlice
from ferrox.loader.errors import ModelLoadError, ModelNotFoundError
from ferrox.loader.mistral_config import CONSOLIDATED_INDEX, consolidated_files
from ferrox.model_spec import ModelSpec

# Leaves of a projection: the native name -> the HF name; others (bias) keep theirs.
_LEAVES = {"qscale_weight": "weight_scale", "qscale_act": "input_scale"}
# Leaves whose rows are the projection's output rows (so wq / wk permute them); any other leaf of wq / wk is refused.
_ROW_LEAVES = ("weight", "weight_scale", "bias")
_PROJ = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
_FFN = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_KV_SCALES = {"k_fake_quantizer": "k_scale", "v_fake_quantizer": "v_scale", "kv_fake_quantizer": "kv_scale",
              "q_fake_quantizer": "q_scale"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight", "pre_mm_projector_norm.weight": "multi_modal_projector.norm.weight",
        "patch_merger.merging_layer.weight": "multi_modal_projector.patch_merger.merging_layer.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_VISION_LAYER = re.compile(r"vision_encoder\.transformer\.layers\.(\d+)\.(.+)")


def mistral_files(folder: str) -> list[str]:
    """The consolidated*.safetensors of the folder, or a ModelNotFoundError saying what load_format 'mistral'
    needs."""
    files = consolidated_files(folder)
    if not files:
        raise ModelNotFoundError(f"load_format 'mistral': model folder {folder} has no consolidated*.safetensors "
                                 f"({CONSOLIDATED_INDEX} or consolidated.safetensors: Mistral's native layout)")
    return files


def iter_mistral_safetensors(folder: str, spec: ModelSpec, *, lazy: bool = False) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of every tensor of the folder's consolidated files, q/k rows in Hugging Face's rotary
    layout. lazy: CheckpointSlices (tensor parallelism) that read only the rows a rank asks for."""
    from ferrox.loader.weights import iter_safetensors_files

    names = MistralNames(spec)
    for name, tensor in iter_safetensors_files(mistral_files(folder), lazy=lazy):
        hf_name, heads = names.hf_name(name)
        yield hf_name, tensor if heads is None else rotary_rows(tensor, heads, hf_name)


class MistralNames:
    """Native -> HF names for one model (module docstring); each q/k name comes with the head count whose rows are
    permuted (text q, text k, vision q/k)."""

    def __init__(self, spec: ModelSpec) -> None:
        self.q_heads, self.kv_heads = spec.num_heads, spec.num_kv_heads
        vision = (spec.hf_config.get("multimodal") or {}).get("vision_config") or {}
        self.vision_heads = int(vision["num_attention_heads"]) if vision else 0

    def hf_name(self, name: str) -> tuple[str, int | None]:
        if name in _TOP:
            return _TOP[name], None
        if name.startswith("vision_language_adapter."):
            rest = name[len("vision_language_adapter."):]
            module, _, leaf = rest.partition(".")
            if module in ("w_in", "w_out"):
                return f"multi_modal_projector.linear_{1 if module == 'w_in' else 2}.{leaf}", None
        if name.startswith("vision_encoder."):
            return self._vision(name)
        match = _LAYER.fullmatch(name)
        if match is not None:
            mapped = self._layer(match.group(2))
            if mapped is not None:
                rest, heads = mapped
                return f"model.layers.{match.group(1)}.{rest}", heads
        raise ModelLoadError(f"load_format 'mistral': checkpoint tensor {name!r} is not one of Mistral's native "
                             "names ferrox maps (mixture-of-experts and latent-attention layouts are not supported)")

    def _layer(self, rest: str) -> tuple[str, int | None] | None:
        if rest in ("attention_norm.weight", "ffn_norm.weight"):
            return ("input_layernorm.weight" if rest.startswith("attention") else "post_attention_layernorm.weight",
                    None)
        block, _, tail = rest.partition(".")
        module, _, leaf = tail.partition(".")
        if block == "attention" and module in _KV_SCALES and leaf == "qscale_act":
            return f"self_attn.{_KV_SCALES[module]}", None
        table = _PROJ if block == "attention" else _FFN if block == "feed_forward" else None
        if table is None or module not in table or not leaf:
            return None
        leaf = _LEAVES.get(leaf, leaf)
        # (an input scale is one value per projection: nothing to permute)
        heads = None if leaf == "input_scale" else {"wq": self.q_heads, "wk": self.kv_heads}.get(module)
        if heads is not None and leaf not in _ROW_LEAVES:
            raise ModelLoadError(f"load_format 'mistral': tensor {leaf!r} of layer {rest!r}: its rows cannot be "
                                 "put in Hugging Face's rotary order (weight, qscale_weight, qscale_act and bias are mapped)")
        return f"{'self_attn' if block == 'attention' else 'mlp'}.{table[module]}.{leaf}", heads

    def _vision(self, name: str) -> tuple[str, int | None]:
        match = _VISION_LAYER.fullmatch(name)
        if match is None:  # patch_conv, ln_pre: the same names under vision_tower
            return "vision_tower." + name[len("vision_encoder."):], None
        layer, rest = match.groups()
        block, _, tail = rest.partition(".")
        module, _, leaf = tail.partition(".")
        table = _PROJ if block == "attention" else _FFN if block == "feed_forward" else None
        if table is not None and module in table:
            rest = f"{block}.{table[module]}.{leaf}"
        heads = self.vision_heads if block == "attention" and module in ("wq", "wk") else None
        if heads is not None and leaf not in _ROW_LEAVES:
            raise ModelLoadError(f"load_format 'mistral': vision tensor {name!r}: its rows cannot be put in Hugging "
                                 "Face's rotary order")
        return f"vision_tower.transformer.layers.{layer}.{rest}", heads


# ---- the rotary row permutation -------------------------------------------------------------------------------
def rotary_order(rows: int, heads: int, what: str) -> torch.Tensor:
    """HF row r of a q/k projection of `rows` rows over `heads` heads is native row order[r]: within each head
    (d rows), HF's [first halves | second halves] of the d / 2 pairs, native's pairs side by side."""
    if heads <= 0 or rows % heads or (rows // heads) % 2:
        raise ModelLoadError(f"load_format 'mistral': tensor {what!r} has {rows} rows, not an even number of rows for "
                             f"each of {heads} heads (params.json does not match the weights?)")
    d = rows // heads
    return torch.arange(rows).view(heads, d // 2, 2).transpose(1, 2).reshape(rows)


def rotary_rows(tensor: Any, heads: int, what: str) -> Any:
    """`tensor` (a torch tensor or a CheckpointSlice) with its rows in HF's rotary order. A one-value scale has no
    rows to move."""
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or (len(shape) == 1 and shape[0] == 1) or int(torch.Size(shape).numel()) == 1:
        return tensor
    order = rotary_order(shape[0], heads, what)
    if isinstance(tensor, CheckpointSlice):
        return CheckpointSlice(_PermutedRows(tensor, order), shape=shape)
    return take_rows(tensor, order)


def take_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor[index] along dim 0, for any dtype (float8 has no index kernels on every device: moved as bytes)."""
    if tensor.dtype.is_floating_point and tensor.element_size() == 1:
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


class _PermutedRows:
    """A safetensors slice (get_shape, [index]) seen with its rows permuted: a read of rows [a, b) reads the native
    rows covering order[a:b] -- the same rows when [a, b) is whole heads, as a tensor-parallel rank's are -- and
    puts them in order."""

    def __init__(self, source: CheckpointSlice, order: torch.Tensor) -> None:
        self._source = source
        self._order = order

    def get_shape(self) -> list[int]:
        return list(self._source.shape)

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        rows = index[0] if index else slice(None)
        wanted = self._order[rows]
        low, high = int(wanted.min()), int(wanted.max()) + 1
        block = self._source.narrow(0, low, high - low)
        if len(index) > 1:
            block = block[(slice(None), *index[1:])]
        return take_rows(block, wanted - low)
