"""Mistral's native checkpoint layout: `params.json` read as the Hugging Face config it stands for.

Mistral publishes its models (Mistral-7B-v0.3, Mistral-Small-3.x, Magistral, Devstral, Ministral-3...) with
`params.json` (mistral-inference's ModelArgs), `consolidated*.safetensors` (its tensor names: the loader maps them,
loader/mistral_weights.py) and `tekken.json`; vLLM serves them with `--config-format mistral --load-format
mistral`. This module turns params.json into the config.json dict the rest of ferrox reads, as vLLM's
transformers_utils/configs/mistral.py does:

    dim / n_layers / n_heads / n_kv_heads / head_dim / hidden_dim -> hidden_size / num_hidden_layers /
                                     num_attention_heads / num_key_value_heads / head_dim / intermediate_size
    norm_eps, rope_theta, vocab_size -> rms_norm_eps, rope_theta, vocab_size
    tied_embeddings                  -> tie_word_embeddings
    max_position_embeddings, max_seq_len -> max_position_embeddings (the smaller when both are set; else the
                                     folder's config.json's; else vLLM's 128,000)
    sliding_window (int, or a per-layer list with null for full attention) -> sliding_window + layer_types
    yarn {factor, original_max_position_embeddings, beta, alpha, apply_scale} -> rope_parameters (YaRN:
                                     beta_fast, beta_slow; apply_scale false -> attention_factor 1)
    llama_4_scaling {original_max_position_embeddings, beta} -> a Ministral 3 (Ministral3ForCausalLM,
                                     rope_parameters.llama_4_scaling_beta, as transformers 5's Ministral3Config)
    quantization {qformat_weight: fp8_e4m3, qscheme_act} -> quantization_config {quant_method: fp8,
                                     activation_scheme: static (TENSOR) | dynamic (NO_SCALES)}; compressed-tensors
                                     passes through
    vision_encoder (or multimodal.vision_encoder_args) -> Mistral3ForConditionalGeneration (a patch-merging
                                     projector: Mistral Small 3.1+) or LlavaForConditionalGeneration (Pixtral-12B)
                                     over a Pixtral vision_config
    dtype (else the consolidated files' own) -> torch_dtype

A key this does not understand, or a feature ferrox does not run (mixture of experts, latent attention, audio),
is refused by name: a key that changes the model is never dropped. No torch here: the API server reads configs.
"""

from __future__ import annotations

import glob
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

from ferrox.config_fields import to_float, to_int
from ferrox.loader.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ferrox.loader.json_file import read_json

PARAMS_FILE = "params.json"
CONSOLIDATED_INDEX = "consolidated.safetensors.index.json"
# vLLM's max_position_embeddings when neither params.json nor config.json states one.
DEFAULT_MAX_POSITION_EMBEDDINGS = 128_000

# params.json keys this module maps (each handled below).
_MAPPED = frozenset({
    "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim", "norm_eps", "rope_theta", "vocab_size",
    "tied_embeddings", "max_position_embeddings", "max_seq_len", "sliding_window", "yarn", "llama_4_scaling",
    "quantization", "vision_encoder", "multimodal", "dtype", "activation", "model_type",
})
# Keys that name a feature ferrox does not run from params.json: fine when absent, null or empty, refused when set.
_UNSUPPORTED_WHEN_SET = {
    "moe": "a mixture-of-experts model (Mixtral / Mistral Large 3 in Mistral's layout)",
    "q_lora_rank": "multi-head latent attention (Mistral Large 3)",
    "kv_lora_rank": "multi-head latent attention (Mistral Large 3)",
    "qk_nope_head_dim": "multi-head latent attention (Mistral Large 3)",
    "qk_rope_head_dim": "multi-head latent attention (Mistral Large 3)",
    "v_head_dim": "multi-head latent attention (Mistral Large 3)",
    "lora": "LoRA adapters inside the checkpoint",
}
_YARN_KEYS = frozenset({"factor", "original_max_position_embeddings", "beta", "alpha", "apply_scale"})
_LLAMA4_KEYS = frozenset({"original_max_position_embeddings", "beta"})
_QUANT_KEYS = frozenset({"qformat_weight", "qscheme_act"})
# vision_encoder keys (mistral-inference's VisionEncoderArgs): the tower's shape, the image tokens, the projector.
_VISION_KEYS = frozenset({
    "hidden_size", "num_channels", "image_size", "max_image_size", "patch_size", "rope_theta", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "head_dim", "image_token_id", "image_break_token_id",
    "image_end_token_id", "spatial_merge_size", "adapter_bias", "mm_projector_id", "add_pre_mm_projector_layer_norm",
})
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def consolidated_files(folder: str) -> list[str]:
    """The consolidated*.safetensors files of a Mistral-layout folder: those consolidated.safetensors.index.json
    names when there is one, else every consolidated*.safetensors. [] when there are none."""
    index_path = os.path.join(folder, CONSOLIDATED_INDEX)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: field 'weight_map' is missing or empty")
        files = sorted(set(str(v) for v in weight_map.values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise ModelNotFoundError(f"{index_path} names shard(s) that do not exist: {', '.join(missing)}")
        return [os.path.join(folder, f) for f in files]
    return sorted(glob.glob(os.path.join(folder, "consolidated*.safetensors")))


def read_params_config(folder: str) -> tuple[dict[str, Any], str]:
    """(the HF config, the params.json path) of a Mistral-layout folder; a ModelNotFoundError naming params.json
    when it has none."""
    path = os.path.join(folder, PARAMS_FILE)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"config_format 'mistral': model folder {folder} has no {PARAMS_FILE} (Mistral's "
                                 "config; a Hugging Face folder has config.json: config_format 'hf' or 'auto')")
    hf_path = os.path.join(folder, "config.json")
    fallback = read_json(hf_path) if os.path.isfile(hf_path) else None
    return hf_config_from_params(read_json(path), path, fallback=fallback,
                                 checkpoint_dtype=checkpoint_dtype(consolidated_files(folder))), path


def hf_config_from_params(params: Mapping[str, Any], where: str, *, fallback: Mapping[str, Any] | None = None,
                          checkpoint_dtype: str | None = None) -> dict[str, Any]:
    """The config.json dict params.json stands for (module docstring). fallback: the folder's config.json, which
    gives max_position_embeddings when params.json does not (as vLLM reads it); checkpoint_dtype: the
    consolidated files' float dtype, used when params.json names none."""
    _refuse_unknown(params, where)
    text = _text_config(params, where, fallback)
    dtype = params.get("dtype") or checkpoint_dtype or (fallback or {}).get("torch_dtype") or (
        fallback or {}).get("dtype")
    if dtype:
        text["torch_dtype"] = str(dtype).removeprefix("torch.")
    quant = params.get("quantization")
    if quant:
        text["quantization_config"] = _quantization_config(quant, where)
    vision = params.get("vision_encoder") or _multimodal_vision(params.get("multimodal"), where)
    return _vision_config(vision, text, where) if vision else text


def checkpoint_dtype(files: list[str]) -> str | None:
    """The float dtype of a safetensors checkpoint, read from the files' headers (no tensor is read): bfloat16 if
    any tensor is, else float16 if any is, else float32 if any is (an FP8 checkpoint's unquantized tensors say
    what it runs in); None when no file says."""
    found: set[str] = set()
    for path in files:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, struct.error, ValueError) as e:
            raise ModelLoadError(f"cannot read the safetensors header of {path}: {e} (truncated or corrupt?)") from e
        found |= {str(v.get("dtype")) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    for name in ("BF16", "F16", "F32"):
        if name in found:
            return _SAFETENSORS_DTYPES[name]
    return None


# ---- the language model ---------------------------------------------------------------------------------------
def _refuse_unknown(params: Mapping[str, Any], where: str) -> None:
    unknown = sorted(k for k in params if k not in _MAPPED and k not in _UNSUPPORTED_WHEN_SET and not k.startswith("_"))
    if unknown:
        raise UnsupportedModelError(f"{where}: key(s) {', '.join(map(repr, unknown))} are not understood by ferrox's "
                                    "params.json reader, which refuses what it cannot map rather than drop it (a "
                                    "folder that also has config.json: use config_format 'hf')")
    for key, what in _UNSUPPORTED_WHEN_SET.items():
        if params.get(key) not in (None, False, {}, [], 0):
            raise UnsupportedModelError(f"{where}: {key!r} is set: {what} is not supported from params.json (a folder "
                                        "that also has config.json: use config_format 'hf')")
    if params.get("model_type", "transformer") != "transformer":
        raise UnsupportedModelError(f"{where}: model_type {params['model_type']!r} is not supported (ferrox reads "
                                    "params.json of Mistral's transformers: model_type 'transformer' or none)")


def _text_config(params: Mapping[str, Any], where: str, fallback: Mapping[str, Any] | None) -> dict[str, Any]:
    def need(key: str) -> int:
        if params.get(key) is None:
            raise ModelLoadError(f"{where}: required key {key!r} is missing")
        return to_int(params[key], f"{where}: key {key!r}")

    def number(key: str, default: float | None = None) -> float:
        if params.get(key) is None:
            if default is None:
                raise ModelLoadError(f"{where}: required key {key!r} is missing")
            return default
        return to_float(params[key], f"{where}: key {key!r}")

    hidden, heads = need("dim"), need("n_heads")
    layers = need("n_layers")
    config: dict[str, Any] = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": to_int(params.get("n_kv_heads") or heads, f"{where}: key 'n_kv_heads'"),
        "head_dim": to_int(params.get("head_dim") or hidden // heads, f"{where}: key 'head_dim'"),
        "intermediate_size": need("hidden_dim"),
        "vocab_size": need("vocab_size"),
        "rms_norm_eps": number("norm_eps"),
        "rope_theta": number("rope_theta", 10_000.0),  # mistral-inference's default
        "tie_word_embeddings": bool(params.get("tied_embeddings", False)),
        "hidden_act": str(params.get("activation") or "silu"),
        "max_position_embeddings": _max_position_embeddings(params, where, fallback),
        "sliding_window": None,
    }
    _sliding_window(params.get("sliding_window"), layers, config, where)
    yarn = params.get("yarn")
    if yarn:
        config["rope_parameters"] = _yarn(yarn, config["rope_theta"], where)
    llama4 = params.get("llama_4_scaling")
    if llama4:
        _llama_4_scaling(llama4, config, where)
    return config


def _max_position_embeddings(params: Mapping[str, Any], where: str, fallback: Mapping[str, Any] | None) -> int:
    """params.json's max_position_embeddings / max_seq_len (the smaller when both are set: vLLM caps the context at
    each), else the folder's config.json's (its text_config's for a multimodal one), else vLLM's default."""
    stated = [to_int(params[k], f"{where}: key {k!r}") for k in ("max_position_embeddings", "max_seq_len")
              if params.get(k) is not None]
    if stated:
        return min(stated)
    for config in (fallback or {}, (fallback or {}).get("text_config") or {}):
        if isinstance(config, Mapping) and config.get("max_position_embeddings"):
            return to_int(config["max_position_embeddings"], f"{where} (config.json's max_position_embeddings)")
    return DEFAULT_MAX_POSITION_EMBEDDINGS


def _sliding_window(window: Any, layers: int, config: dict[str, Any], where: str) -> None:
    """An int: every layer attends within it. A list: the window of each layer of a repeating pattern (null: full
    attention), which must tile the layers and name one window (vLLM's reading)."""
    if window is None:
        return
    if isinstance(window, list):
        if not window or layers % len(window):
            raise ModelLoadError(f"{where}: key 'sliding_window' is a pattern of {len(window)} layers, which does not "
                                 f"tile the {layers} layers")
        sizes = {to_int(w, f"{where}: key 'sliding_window'") for w in window if w is not None}
        if len(sizes) > 1:
            raise UnsupportedModelError(f"{where}: key 'sliding_window' names several windows {sorted(sizes)}; one "
                                        "window (and full-attention layers) is supported")
        if not sizes:
            return  # every layer attends fully
        config["sliding_window"] = sizes.pop()
        config["layer_types"] = ["full_attention" if w is None else "sliding_attention"
                                 for w in window * (layers // len(window))]
        return
    config["sliding_window"] = to_int(window, f"{where}: key 'sliding_window'")
    config["layer_types"] = ["sliding_attention"] * layers


def _yarn(yarn: Any, theta: float, where: str) -> dict[str, Any]:
    """mistral-inference's YaRN -> transformers' rope_parameters (the names vLLM maps them to): beta is the fast
    boundary, alpha the slow one; apply_scale false means no attention scaling (attention_factor 1)."""
    if not isinstance(yarn, Mapping):
        raise ModelLoadError(f"{where}: key 'yarn' must be an object, got {yarn!r}")
    unknown = sorted(set(yarn) - _YARN_KEYS)
    if unknown:
        raise UnsupportedModelError(f"{where}: yarn key(s) {', '.join(map(repr, unknown))} are not understood "
                                    f"(known: {', '.join(sorted(_YARN_KEYS))})")
    if yarn.get("factor") is None or yarn.get("original_max_position_embeddings") is None:
        raise ModelLoadError(f"{where}: yarn needs 'factor' and 'original_max_position_embeddings'")
    rope: dict[str, Any] = {
        "rope_type": "yarn", "rope_theta": theta, "mscale_all_dim": 1,
        "factor": to_float(yarn["factor"], f"{where}: yarn.factor"),
        "original_max_position_embeddings": to_int(yarn["original_max_position_embeddings"],
                                                   f"{where}: yarn.original_max_position_embeddings"),
    }
    for key, name in (("beta", "beta_fast"), ("alpha", "beta_slow")):
        if yarn.get(key) is not None:
            rope[name] = to_float(yarn[key], f"{where}: yarn.{key}")
    if not yarn.get("apply_scale", True):
        rope["attention_factor"] = 1.0
    return rope


def _llama_4_scaling(llama4: Any, config: dict[str, Any], where: str) -> None:
    """Llama 4's attention temperature over long contexts (queries times 1 + beta * ln(1 + floor(position /
    original))): Ministral 3. transformers 5's Ministral3Config keeps beta and the length in rope_parameters, one
    original_max_position_embeddings with YaRN's, so the two must agree."""
    if not isinstance(llama4, Mapping):
        raise ModelLoadError(f"{where}: key 'llama_4_scaling' must be an object, got {llama4!r}")
    if set(llama4) != _LLAMA4_KEYS:
        raise UnsupportedModelError(f"{where}: llama_4_scaling must have exactly the keys "
                                    f"{', '.join(sorted(_LLAMA4_KEYS))}, got {', '.join(sorted(llama4))}")
    original = to_int(llama4["original_max_position_embeddings"],
                      f"{where}: llama_4_scaling.original_max_position_embeddings")
    rope = config.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": config["rope_theta"]})
    if rope.get("original_max_position_embeddings", original) != original:
        raise UnsupportedModelError(f"{where}: llama_4_scaling.original_max_position_embeddings {original} differs "
                                    f"from yarn's {rope['original_max_position_embeddings']} (transformers' "
                                    "Ministral3Config holds one)")
    rope["original_max_position_embeddings"] = original
    rope["llama_4_scaling_beta"] = to_float(llama4["beta"], f"{where}: llama_4_scaling.beta")
    config["architectures"] = ["Ministral3ForCausalLM"]
    config["model_type"] = "ministral3"


def _quantization_config(quant: Any, where: str) -> dict[str, Any]:
    """params.json's quantization -> config.json's quantization_config, as vLLM maps it: FP8 E4M3 weights with one
    scale a tensor (qscale_weight) and a static activation scale (qscale_act; qscheme_act TENSOR, the default) or
    none (NO_SCALES: dynamic); a compressed-tensors config as it is."""
    if not isinstance(quant, Mapping):
        raise ModelLoadError(f"{where}: key 'quantization' must be an object, got {quant!r}")
    if str(quant.get("quant_method", "")).lower().replace("_", "-") == "compressed-tensors":
        return {**quant, "quant_method": "compressed-tensors"}
    unknown = sorted(set(quant) - _QUANT_KEYS)
    if unknown:
        raise UnsupportedModelError(f"{where}: quantization key(s) {', '.join(map(repr, unknown))} are not understood "
                                    f"(known: {', '.join(sorted(_QUANT_KEYS))}, or a compressed-tensors config)")
    if quant.get("qformat_weight") != "fp8_e4m3":
        raise UnsupportedModelError(f"{where}: quantization.qformat_weight {quant.get('qformat_weight')!r} is not "
                                    "supported (fp8_e4m3)")
    scheme = quant.get("qscheme_act")
    if scheme not in (None, "TENSOR", "NO_SCALES"):
        raise UnsupportedModelError(f"{where}: quantization.qscheme_act {scheme!r} is not supported (TENSOR: a "
                                    "static per-tensor activation scale; NO_SCALES: dynamic)")
    return {"quant_method": "fp8", "activation_scheme": "dynamic" if scheme == "NO_SCALES" else "static"}


# ---- the vision encoder ---------------------------------------------------------------------------------------
def _multimodal_vision(multimodal: Any, where: str) -> Mapping[str, Any] | None:
    """The newer layout's multimodal.vision_encoder_args (audio, whisper_model_args, is refused by name)."""
    if not multimodal:
        return None
    if not isinstance(multimodal, Mapping):
        raise ModelLoadError(f"{where}: key 'multimodal' must be an object, got {multimodal!r}")
    unknown = sorted(set(multimodal) - {"vision_encoder_args"})
    if unknown:
        raise UnsupportedModelError(f"{where}: multimodal key(s) {', '.join(map(repr, unknown))} are not supported "
                                    "(vision_encoder_args; audio encoders are not)")
    return multimodal.get("vision_encoder_args")


def _vision_config(vision: Any, text: dict[str, Any], where: str) -> dict[str, Any]:
    """A Pixtral tower over the language model: Mistral3ForConditionalGeneration when its projector merges patches
    (mm_projector_id 'patch_merge', with the RMSNorm before it: Mistral Small 3.1+, Magistral, Devstral,
    Ministral 3), else LlavaForConditionalGeneration over the tower (Pixtral-12B's layout), as transformers'
    conversion scripts write them."""
    what = f"{where}: vision_encoder"
    if not isinstance(vision, Mapping):
        raise ModelLoadError(f"{what} must be an object, got {vision!r}")
    unknown = sorted(set(vision) - _VISION_KEYS)
    if unknown:
        raise UnsupportedModelError(f"{what} key(s) {', '.join(map(repr, unknown))} are not understood")

    def need(key: str) -> int:
        if vision.get(key) is None:
            raise ModelLoadError(f"{what}: required key {key!r} is missing")
        return to_int(vision[key], f"{what}.{key}")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    image_size = vision.get("image_size") or vision.get("max_image_size")
    if image_size is None:
        raise ModelLoadError(f"{what}: required key 'image_size' (or 'max_image_size') is missing")
    head_dim = to_int(vision.get("head_dim") or hidden // heads, f"{what}.head_dim")
    if head_dim * heads != hidden:
        raise UnsupportedModelError(f"{what}: head_dim {head_dim} x {heads} heads is not hidden_size {hidden}")
    vision_config = {
        "model_type": "pixtral", "hidden_size": hidden, "num_attention_heads": heads, "head_dim": head_dim,
        "intermediate_size": need("intermediate_size"), "num_hidden_layers": need("num_hidden_layers"),
        "num_channels": to_int(vision.get("num_channels", 3), f"{what}.num_channels"),
        "patch_size": need("patch_size"), "image_size": to_int(image_size, f"{what}.image_size"),
        "rope_theta": to_float(vision.get("rope_theta", 10_000.0), f"{what}.rope_theta"),
        "hidden_act": "silu",  # Mistral's tower: a SiLU-gated feed-forward (transformers' Pixtral configs say so)
    }
    merge = to_int(vision.get("spatial_merge_size", 1), f"{what}.spatial_merge_size")
    projector = vision.get("mm_projector_id") or ""
    config: dict[str, Any] = {
        "vision_config": vision_config, "text_config": text,
        "image_token_index": to_int(vision.get("image_token_id", 10), f"{what}.image_token_id", minimum=0),
        # (the layout's other tokens, which the processor otherwise finds by name: [IMG_BREAK], [IMG_END])
        **{key: to_int(vision[key], f"{what}.{key}", minimum=0) for key in ("image_break_token_id",
                                                                              "image_end_token_id") if key in vision},
        "vision_feature_layer": -1, "projector_hidden_act": "gelu",
        "multimodal_projector_bias": bool(vision.get("adapter_bias", True)),
        "tie_word_embeddings": text["tie_word_embeddings"],
    }
    for key in ("torch_dtype", "quantization_config"):  # (quantization_config also stays in text_config: the
        if key in text:                                # quantized language model is where the loader asks)
            config[key] = text[key]
    if projector == "patch_merge":
        if not vision.get("add_pre_mm_projector_layer_norm", False):
            raise UnsupportedModelError(f"{what}: a patch-merging projector without add_pre_mm_projector_layer_norm "
                                        "is not supported (Mistral 3's projector normalizes first)")
        config.update(architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3",
                      spatial_merge_size=merge)
        return config
    if projector:
        raise UnsupportedModelError(f"{what}: mm_projector_id {projector!r} is not supported ('patch_merge', or none)")
    if merge != 1 or vision.get("add_pre_mm_projector_layer_norm"):
        raise UnsupportedModelError(f"{what}: spatial_merge_size {merge} / add_pre_mm_projector_layer_norm without "
                                    "mm_projector_id 'patch_merge' is not supported")
    config.update(architectures=["LlavaForConditionalGeneration"], model_type="llava",
                  vision_feature_select_strategy="full", image_seq_length=1)
    return config
