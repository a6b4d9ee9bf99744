"""llama.cpp GGUF files of families ferrox also runs from Hugging Face folders: OLMo 2, Command R / R+ / Aya,
Command R7B, StarCoder2, Phi-2, GPT-2, GPT-NeoX (Pythia), GLM-4-0414, EXAONE 4, Arcee AFM and ERNIE 4.5.

Such a file is read back into the Hugging Face checkpoint llama.cpp's converter (convert_hf_to_gguf.py) made it
from: every tensor under its transformers name and in its transformers layout, so the family's own `load_weights`
(its renames, fused cuts and rotary row orders) takes it as it takes a safetensors checkpoint. What the converter
changed is undone here: GPT-2's Conv1D matrices it transposed, GPT-NeoX's per-head [q, k, v] rows it regrouped into
[all q; all k; all v]; the fused attn_qkv of older Phi-2 / GLM-4 conversions is cut into q, k and v. (Arcee's q/k
rows, permuted as Llama's, are put back by gguf_file.py.) The config comes from the metadata under each family's own
field names. Every `{arch}.*` metadata key and every tensor a family does not honour is refused by name, never
skipped. These families' models take float weights only (no `supports_quantized_gguf`): a quantized file is
dequantized at load.

Where a file holds less than the Hugging Face config: StarCoder2's converter writes no sliding window, so the file
runs with full attention as llama.cpp runs it (unless it has `starcoder2.attention.sliding_window`); the MLP's
activation is not in any file and is each family's releases' (GELU-tanh for Phi-2, GPT-2 and StarCoder2; exact GELU
for GPT-NeoX, as Pythia's configs say, where llama.cpp computes the tanh form).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrox.config_fields import to_float, to_int
from ferrox.loader.errors import ModelLoadError, UnsupportedModelError

# The value of hf_name for a tensor the config takes instead of a weight (rope_freqs.weight: rope_scaling).
CONFIG_TENSOR = ""


class Meta:
    """One file's `{arch}.*` metadata, read with errors that name the file and key."""

    def __init__(self, gguf: Any):
        self.gguf = gguf
        self.arch: str = gguf.architecture

    def what(self, suffix: str) -> str:
        return f"GGUF file {self.gguf.path}: metadata {self.arch}.{suffix}"

    def get(self, suffix: str, default: Any = None) -> Any:
        value = self.gguf.arch_key(suffix)
        return default if value is None else value

    def integer(self, suffix: str, default: int | None = None) -> int:
        value = self.get(suffix, default)
        if value is None:
            raise ModelLoadError(f"{self.what(suffix)} is missing")
        return to_int(value, self.what(suffix))

    def number(self, suffix: str, default: float | None = None) -> float:
        value = self.get(suffix, default)
        if value is None:
            raise ModelLoadError(f"{self.what(suffix)} is missing")
        value = to_float(value, self.what(suffix))
        if not math.isfinite(value):
            raise ModelLoadError(f"{self.what(suffix)} must be finite, got {value}")
        return value

    def flag(self, suffix: str, default: bool) -> bool:
        value = self.get(suffix, default)
        if not isinstance(value, (bool, np.bool_)):
            raise ModelLoadError(f"{self.what(suffix)} must be a boolean, got {value!r}")
        return bool(value)

    def has_tensor(self, name: str) -> bool:
        return name in self.gguf.tensor_names


@dataclass(frozen=True)
class GGUFFamily:
    """One llama.cpp architecture read back as a Hugging Face checkpoint."""

    architecture: str  # the `architectures` entry ferrox runs it as
    model_type: str  # transformers' model_type
    layer_prefix: str  # the HF name of layer N's tensors: layer_prefix.format(N) + suffix
    layer_names: Mapping[str, str]  # llama.cpp suffix after blk.N. -> HF suffix ("{}": q, k, v of a fused tensor)
    global_names: Mapping[str, str]  # llama.cpp name -> HF name, outside the layers
    keys: frozenset[str]  # the `{arch}.*` metadata keys honoured (the suffix after "{arch}.")
    config: Callable[[Meta, dict[str, Any]], dict[str, Any]]  # config.json fields beyond the common ones
    config_tensors: frozenset[str] = frozenset()  # tensors the config takes (rope_freqs.weight)
    transposed: frozenset[str] = frozenset()  # HF suffixes whose matrix the converter transposed (GPT-2's Conv1D)
    per_head_qkv: frozenset[str] = frozenset()  # HF suffixes whose per-head [q, k, v] rows it regrouped (GPT-NeoX)
    hints: Mapping[str, str] = field(default_factory=dict)  # why a metadata key is refused, where it says more

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a tensor ("{}" in it: the q, k and v of a fused one), CONFIG_TENSOR for one the config
        takes, None for one this family has no place for."""
        if gguf_name in self.config_tensors:
            return CONFIG_TENSOR
        if gguf_name in self.global_names:
            return self.global_names[gguf_name]
        if gguf_name.startswith("blk."):
            layer, _, suffix = gguf_name[4:].partition(".")
            if layer.isdigit() and suffix in self.layer_names:
                return self.layer_prefix.format(int(layer)) + self.layer_names[suffix]
        return None


def check_file(gguf: Any, family: GGUFFamily) -> None:
    """UnsupportedModelError naming the first `{arch}.*` metadata key or tensor the family does not honour."""
    arch = gguf.architecture
    for key in gguf.metadata:
        suffix = key[len(arch) + 1:] if key.startswith(arch + ".") else None
        if suffix is not None and suffix not in family.keys:
            hint = family.hints.get(suffix, f"not a key ferrox honours in {arch} files, run as {family.architecture}")
            raise UnsupportedModelError(f"GGUF file {gguf.path}: metadata {key} is not supported ({hint})")
    for name in gguf.tensor_names:
        if family.hf_name(name) is None:
            raise UnsupportedModelError(f"GGUF file {gguf.path}: tensor {name!r} is not supported for {arch} files "
                                        f"(ferrox runs them as {family.architecture}, which has no such weight)")


def family_config(gguf: Any, family: GGUFFamily, config: dict[str, Any]) -> dict[str, Any]:
    """The family's config.json fields over the common ones `config` holds (head_dim, hidden_size...)."""
    meta = Meta(gguf)
    value_length = meta.get("attention.value_length")
    if value_length is not None and meta.integer("attention.value_length") != config["head_dim"]:
        raise UnsupportedModelError(f"{meta.what('attention.value_length')} {value_length} differs from the key "
                                    f"length {config['head_dim']}; ferrox's {family.architecture} has one head size")
    return {"model_type": family.model_type, **family.config(meta, config)}


def hf_tensors(family: GGUFFamily, name: str, arr: np.ndarray, n_heads: int, n_kv_heads: int,
               where: str) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of one dequantized tensor in the HF checkpoint's layout: what the converter did undone."""
    if "{}" in name:  # a fused [q; k; v]: q has n_heads heads, k and v n_kv_heads each
        rows = arr.shape[0]
        if rows % (n_heads + 2 * n_kv_heads):
            raise ModelLoadError(f"{where}: {rows} rows of a fused q/k/v tensor ({name.format('qkv')}) do not split "
                                 f"into {n_heads} + 2 x {n_kv_heads} heads")
        head_dim = rows // (n_heads + 2 * n_kv_heads)
        q, kv = n_heads * head_dim, n_kv_heads * head_dim
        yield name.format("q"), arr[:q]
        yield name.format("k"), arr[q:q + kv]
        yield name.format("v"), arr[q + kv:]
        return
    if any(name.endswith("." + s) for s in family.transposed):
        arr = np.ascontiguousarray(arr.T)  # back to Conv1D's [in, out]
    elif any(name.endswith("." + s) for s in family.per_head_qkv):
        # [q of every head; k...; v...] back to the checkpoint's q, k, v of head 0, then of head 1...
        if arr.shape[0] % (3 * n_heads):
            raise ModelLoadError(f"{where}: {arr.shape[0]} rows of {name} do not split into 3 x {n_heads} heads")
        head_dim = arr.shape[0] // (3 * n_heads)
        arr = np.ascontiguousarray(arr.reshape(3, n_heads, head_dim, *arr.shape[1:]).swapaxes(0, 1).reshape(arr.shape))
    yield name, arr


# ---- metadata ------------------------------------------------------------------------------------------------------
# Keys every family's common config reads (model_config.hf_config_from_gguf); rotary families add _ROPE_KEYS.
_SHAPE_KEYS = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length",
                         "attention.head_count", "attention.head_count_kv", "attention.key_length",
                         "attention.value_length", "vocab_size"})
_ROPE_KEYS = frozenset({"rope.freq_base", "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor",
                        "rope.scaling.original_context_length"})
_LAYER_NORM = frozenset({"attention.layer_norm_epsilon"})
_RMS_NORM = frozenset({"attention.layer_norm_rms_epsilon"})
_WINDOW = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})


def rotary_factor(rotary_dim: int, head_dim: int) -> float:
    """partial_rotary_factor for `rotary_dim` of `head_dim` dims, such that int(head_dim * factor) gives rotary_dim
    back (rotary_dim / head_dim can land a hair below: 30 / 176 * 176 < 30)."""
    factor = rotary_dim / head_dim
    while int(head_dim * factor) < rotary_dim:
        factor = math.nextafter(factor, 2.0)
    return factor


def _rotary(meta: Meta, config: dict[str, Any], *, partial: bool = False) -> dict[str, Any]:
    """rope.dimension_count, the rotating dims of a head (llama.cpp's n_rot): a leading part of it for the
    `partial` families (their config's partial_rotary_factor, always written: GLM and Phi default to 0.5), the whole
    head for the others."""
    head_dim = config["head_dim"]
    rotary = meta.integer("rope.dimension_count", head_dim)
    if partial and rotary <= head_dim and rotary % 2 == 0:
        return {"partial_rotary_factor": rotary_factor(rotary, head_dim)}
    if partial:
        raise UnsupportedModelError(f"{meta.what('rope.dimension_count')} {rotary} is not supported: the rotating "
                                    f"part of a head must be an even number of its {head_dim} dims")
    if rotary != head_dim:
        raise UnsupportedModelError(f"{meta.what('rope.dimension_count')} {rotary} is not supported: ferrox rotates "
                                    f"the whole head ({head_dim} dims) of {meta.arch} files, as transformers does")
    return {}


def _layer_types(meta: Meta, num_layers: int) -> list[str] | None:
    """attention.sliding_window_pattern (one boolean a layer, true: sliding) as transformers' layer_types."""
    pattern = meta.get("attention.sliding_window_pattern")
    if pattern is None:
        return None
    if not isinstance(pattern, list) or len(pattern) != num_layers or not all(
            isinstance(p, (bool, np.bool_)) for p in pattern):
        raise ModelLoadError(f"{meta.what('attention.sliding_window_pattern')} must hold one boolean a layer "
                             f"({num_layers}), got {pattern!r}")
    return ["sliding_attention" if p else "full_attention" for p in pattern]


def _windows(meta: Meta, config: dict[str, Any], default_pattern: int | None) -> dict[str, Any]:
    """The sliding window and which layers take it: the pattern's layer_types, else the family's default
    (every default_pattern-th layer global), else every layer."""
    if not meta.get("attention.sliding_window"):
        if meta.get("attention.sliding_window_pattern") is not None:
            raise UnsupportedModelError(f"{meta.what('attention.sliding_window_pattern')} without "
                                        f"{meta.arch}.attention.sliding_window is not supported")
        return {}
    out: dict[str, Any] = {"sliding_window": meta.integer("attention.sliding_window")}
    types = _layer_types(meta, config["num_hidden_layers"])
    if types is not None:
        out["layer_types"] = types
    elif default_pattern is not None:
        out["sliding_window_pattern"] = default_pattern
    return out


def _olmo2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {"rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"), **_rotary(meta, config)}


def _command_r(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    """Command R / R+: Cohere's LayerNorms, logit_scale, R+'s per-head q/k norms (their tensors say)."""
    return {"layer_norm_eps": meta.number("attention.layer_norm_epsilon"), "logit_scale": meta.number("logit_scale"),
            "use_qk_norm": meta.has_tensor("blk.0.attn_q_norm.weight"), **_rotary(meta, config)}


def _cohere2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    """Command R7B: Command R's with windowed layers, every fourth global (llama.cpp fixes that pattern for cohere2,
    as transformers' default does) unless the file lists them."""
    if not meta.get("attention.sliding_window"):
        raise ModelLoadError(f"{meta.what('attention.sliding_window')} is missing (Cohere2's local layers need it)")
    return {"layer_norm_eps": meta.number("attention.layer_norm_epsilon"), "logit_scale": meta.number("logit_scale"),
            **_windows(meta, config, 4), **_rotary(meta, config)}


def _starcoder2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {"norm_epsilon": meta.number("attention.layer_norm_epsilon"), "hidden_act": "gelu_pytorch_tanh",
            "use_bias": meta.has_tensor("blk.0.attn_q.bias"), **_windows(meta, config, None), **_rotary(meta, config)}


def _phi2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {"layer_norm_eps": meta.number("attention.layer_norm_epsilon"), "hidden_act": "gelu_new",
            **_rotary(meta, config, partial=True)}


def _gpt2(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    # The current converter ties the head (no output.weight); older ones wrote the embedding again as output.weight,
    # which then loads as an untied head (the common config's tie_word_embeddings), as llama.cpp runs it.
    return {"layer_norm_epsilon": meta.number("attention.layer_norm_epsilon"), "activation_function": "gelu_new",
            "hidden_act": "gelu_new"}


def _gptneox(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {"layer_norm_eps": meta.number("attention.layer_norm_epsilon"), "hidden_act": "gelu",
            "use_parallel_residual": meta.flag("use_parallel_residual", True),
            "attention_bias": meta.has_tensor("blk.0.attn_qkv.bias"), **_rotary(meta, config, partial=True)}


def _glm4(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    bias = meta.has_tensor("blk.0.attn_q.bias") or meta.has_tensor("blk.0.attn_qkv.bias")
    return {"rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"), "attention_bias": bias,
            **_rotary(meta, config, partial=True)}


def _exaone4(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    # (transformers' Exaone4Config: every fourth layer global when the pattern is not given)
    return {"rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"), **_windows(meta, config, 4),
            **_rotary(meta, config)}


def _arcee(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    return {"rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"), "hidden_act": "relu2",
            **_rotary(meta, config)}


def _ernie4_5(meta: Meta, config: dict[str, Any]) -> dict[str, Any]:
    bias = meta.has_tensor("blk.0.attn_q.bias")  # (use_bias: every projection, or none)
    return {"rms_norm_eps": meta.number("attention.layer_norm_rms_epsilon"), "use_bias": bias,
            "attention_bias": bias, "mlp_bias": bias, **_rotary(meta, config)}


# ---- tensor names --------------------------------------------------------------------------------------------------
def _pair(gguf_stem: str, hf_stem: str) -> dict[str, str]:
    return {f"{gguf_stem}.weight": f"{hf_stem}.weight", f"{gguf_stem}.bias": f"{hf_stem}.bias"}


_ATTN = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
         "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight"}
_QKV_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias"}
_FUSED_QKV = {"attn_qkv.weight": "self_attn.{}_proj.weight", "attn_qkv.bias": "self_attn.{}_proj.bias"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GATED_MLP = {"ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
              "ffn_down.weight": "mlp.down_proj.weight"}
# OLMo 2's and EXAONE 4's norms after attention and after the MLP (no input norm).
_POST_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_LLAMA_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
_LAYERS = "model.layers.{}."
_ROPE_FREQS = frozenset({"rope_freqs.weight"})  # llama3-style scaling as divisors (model_config: freq_factors)

_COHERE_LAYERS = {"attn_norm.weight": "input_layernorm.weight", **_ATTN, **_GATED_MLP}

GGUF_FAMILIES: dict[str, GGUFFamily] = {
    "olmo2": GGUFFamily(
        "Olmo2ForCausalLM", "olmo2", _LAYERS, {**_ATTN, **_QK_NORMS, **_POST_NORMS, **_GATED_MLP}, _LLAMA_GLOBALS,
        _SHAPE_KEYS | _ROPE_KEYS | _RMS_NORM, _olmo2,
        hints={"attention.sliding_window": "an OLMo 3 file (llama.cpp writes Olmo3ForCausalLM as olmo2 with sliding "
                                           "windows); ferrox does not map OLMo 3 GGUF files yet"}),
    "command-r": GGUFFamily(
        "CohereForCausalLM", "cohere", _LAYERS, {**_COHERE_LAYERS, **_QK_NORMS}, _LLAMA_GLOBALS,
        _SHAPE_KEYS | _ROPE_KEYS | _LAYER_NORM | {"logit_scale"}, _command_r),
    "cohere2": GGUFFamily(
        "Cohere2ForCausalLM", "cohere2", _LAYERS, _COHERE_LAYERS, _LLAMA_GLOBALS,
        _SHAPE_KEYS | _ROPE_KEYS | _LAYER_NORM | _WINDOW | {"logit_scale"}, _cohere2),
    "starcoder2": GGUFFamily(
        "Starcoder2ForCausalLM", "starcoder2", _LAYERS,
        {**_pair("attn_norm", "input_layernorm"), **_ATTN, **_QKV_BIASES, "attn_output.bias": "self_attn.o_proj.bias",
         **_pair("ffn_norm", "post_attention_layernorm"), **_pair("ffn_up", "mlp.c_fc"),
         **_pair("ffn_down", "mlp.c_proj")},
        {**_LLAMA_GLOBALS, "output_norm.bias": "model.norm.bias"},
        _SHAPE_KEYS | _ROPE_KEYS | _LAYER_NORM | {"attention.sliding_window"}, _starcoder2, config_tensors=_ROPE_FREQS),
    "phi2": GGUFFamily(
        "PhiForCausalLM", "phi", _LAYERS,
        {**_pair("attn_norm", "input_layernorm"), **_ATTN, **_QKV_BIASES, **_FUSED_QKV,
         **_pair("attn_output", "self_attn.dense"), **_pair("ffn_up", "mlp.fc1"), **_pair("ffn_down", "mlp.fc2")},
        {"token_embd.weight": "model.embed_tokens.weight", **_pair("output_norm", "model.final_layernorm"),
         **_pair("output", "lm_head")},
        _SHAPE_KEYS | _ROPE_KEYS | _LAYER_NORM, _phi2),
    "gpt2": GGUFFamily(
        "GPT2LMHeadModel", "gpt2", "transformer.h.{}.",
        {**_pair("attn_norm", "ln_1"), **_pair("attn_qkv", "attn.c_attn"), **_pair("attn_output", "attn.c_proj"),
         **_pair("ffn_norm", "ln_2"), **_pair("ffn_up", "mlp.c_fc"), **_pair("ffn_down", "mlp.c_proj")},
        {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
         **_pair("output_norm", "transformer.ln_f"), "output.weight": "lm_head.weight"},
        _SHAPE_KEYS | _LAYER_NORM, _gpt2,  # (learned positions: no rope keys)
        transposed=frozenset({"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"})),
    "gptneox": GGUFFamily(
        "GPTNeoXForCausalLM", "gpt_neox", "gpt_neox.layers.{}.",
        {**_pair("attn_norm", "input_layernorm"), **_pair("attn_qkv", "attention.query_key_value"),
         **_pair("attn_output", "attention.dense"), **_pair("ffn_norm", "post_attention_layernorm"),
         **_pair("ffn_up", "mlp.dense_h_to_4h"), **_pair("ffn_down", "mlp.dense_4h_to_h")},
        {"token_embd.weight": "gpt_neox.embed_in.weight", **_pair("output_norm", "gpt_neox.final_layer_norm"),
         "output.weight": "embed_out.weight"},
        _SHAPE_KEYS | _ROPE_KEYS | _LAYER_NORM | {"use_parallel_residual"}, _gptneox,
        per_head_qkv=frozenset({"attention.query_key_value.weight", "attention.query_key_value.bias"})),
    "glm4": GGUFFamily(
        "Glm4ForCausalLM", "glm4", _LAYERS,
        {"attn_norm.weight": "input_layernorm.weight", **_ATTN, **_QKV_BIASES, **_FUSED_QKV,
         "post_attention_norm.weight": "post_self_attn_layernorm.weight",
         "ffn_norm.weight": "post_attention_layernorm.weight", "post_ffw_norm.weight": "post_mlp_layernorm.weight",
         # (one [gate; up] tensor, as the checkpoint's gate_up_proj: models/glm4.py cuts it)
         "ffn_up.weight": "mlp.gate_up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"},
        _LLAMA_GLOBALS, _SHAPE_KEYS | _ROPE_KEYS | _RMS_NORM, _glm4),
    "exaone4": GGUFFamily(
        "Exaone4ForCausalLM", "exaone4", _LAYERS, {**_ATTN, **_QK_NORMS, **_POST_NORMS, **_GATED_MLP}, _LLAMA_GLOBALS,
        _SHAPE_KEYS | _ROPE_KEYS | _RMS_NORM | _WINDOW, _exaone4, config_tensors=_ROPE_FREQS),
    "arcee": GGUFFamily(
        "ArceeForCausalLM", "arcee", _LAYERS,
        {"attn_norm.weight": "input_layernorm.weight", **_ATTN, "ffn_norm.weight": "post_attention_layernorm.weight",
         "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"},
        _LLAMA_GLOBALS, _SHAPE_KEYS | _ROPE_KEYS | _RMS_NORM, _arcee, config_tensors=_ROPE_FREQS),
    "ernie4_5": GGUFFamily(
        "Ernie4_5ForCausalLM", "ernie4_5", _LAYERS,
        {"attn_norm.weight": "input_layernorm.weight", **_ATTN, **_QKV_BIASES,
         "attn_output.bias": "self_attn.o_proj.bias", "ffn_norm.weight": "post_attention_layernorm.weight",
         **_GATED_MLP, "ffn_gate.bias": "mlp.gate_proj.bias", "ffn_up.bias": "mlp.up_proj.bias",
         "ffn_down.bias": "mlp.down_proj.bias"},
        _LLAMA_GLOBALS, _SHAPE_KEYS | _ROPE_KEYS | _RMS_NORM, _ernie4_5),
}

__all__ = ["CONFIG_TENSOR", "GGUFFamily", "GGUF_FAMILIES", "check_file", "family_config", "hf_tensors",
           "rotary_factor"]
