"""The shape of a model (ferrox.model_spec.ModelSpec), read from config.json or from GGUF metadata.

The spec keeps the raw HF config (`hf_config`) for anything model code needs beyond the common
fields, and normalises the fields that moved between transformers versions (rope_theta /
rope_scaling vs rope_parameters, torch_dtype vs dtype).
"""

from __future__ import annotations

from typing import Any

import torch

from ferrox.config_fields import to_float, to_int
from ferrox.loader.config_file import read_model_config
from ferrox.loader.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ferrox.loader.source import ModelSource
from ferrox.model_spec import ModelSpec, MoeSpec, hybrid_layer_types, rope_type_of, sliding_layer_kinds

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


# transformers' Gemma3TextConfig defaults: the hub's Gemma 3 multimodal configs (gemma-3-4b/12b/27b-it) write
# only the text fields that differ from them under text_config.
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True,
}


# transformers' text config defaults by model_type, for LLaVA's text_config (llava-hf configs write only a few
# fields of their Vicuna / Mistral / Qwen2 language model).
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 11_008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "rope_theta": 10_000.0, "tie_word_embeddings": False, "hidden_act": "silu"},
    "mistral": {"vocab_size": 32_000, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 4096 * 32,
                "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": False, "sliding_window": 4096,
                "hidden_act": "silu"},
    "qwen2": {"vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32_768,
              "rms_norm_eps": 1e-6, "rope_theta": 10_000.0, "tie_word_embeddings": False,
              "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "hidden_act": "silu"},
    "gemma3_text": _GEMMA3_TEXT_DEFAULTS,
}
# Gemma 4's language model (Gemma4TextConfig's defaults; models/gemma4.py): the text_config of
# Gemma4ForConditionalGeneration, and read for Gemma4ForCausalLM's own config where it leaves a field out.
_TEXT_DEFAULTS["gemma4_text"] = {
    "vocab_size": 262_144, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 30,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "sliding_window": 512, "tie_word_embeddings": True,
    "vocab_size_per_layer_input": 262_144, "hidden_size_per_layer_input": 256, "attention_k_eq_v": False,
    "num_kv_shared_layers": 0, "enable_moe_block": False, "use_double_wide_mlp": False,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0}}}
# Qwen2-VL's and Qwen2.5-VL's language model (Qwen2VLTextConfig's / Qwen2_5_VLTextConfig's defaults).
_TEXT_DEFAULTS["qwen2_vl_text"] = _TEXT_DEFAULTS["qwen2_5_vl_text"] = {
    "vocab_size": 152_064, "hidden_size": 8192, "intermediate_size": 29_568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "max_position_embeddings": 32_768, "rms_norm_eps": 1e-5,
    "rope_theta": 1_000_000.0, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 4096,
    "max_window_layers": 80, "hidden_act": "silu"}
# Qwen3-VL's language model (Qwen3VLTextConfig's defaults): a Qwen3 with q/k norms and interleaved mrope.
_TEXT_DEFAULTS["qwen3_vl_text"] = {
    "vocab_size": 151_936, "hidden_size": 4096, "intermediate_size": 22_016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 128_000,
    "rms_norm_eps": 1e-6, "rope_theta": 500_000.0, "attention_bias": False, "tie_word_embeddings": False,
    "hidden_act": "silu"}
# Qwen3-VL-MoE's language model (Qwen3VLMoeTextConfig's defaults): a Qwen3-MoE with interleaved mrope.
_TEXT_DEFAULTS["qwen3_vl_moe_text"] = {
    "vocab_size": 151_936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 128_000, "rms_norm_eps": 1e-6,
    "rope_theta": 500_000.0, "attention_bias": False, "tie_word_embeddings": True, "hidden_act": "silu",
    "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_local_experts": 60,
    "mlp_only_layers": []}  # (the count under the name transformers 5 saves it by, so the hub's num_experts wins)
# Qwen3's (Qwen3Config's defaults): InternVL3.5's language model.
_TEXT_DEFAULTS["qwen3"] = {**_TEXT_DEFAULTS["qwen2"], "vocab_size": 151_936, "intermediate_size": 22_016,
                           "head_dim": 128, "attention_bias": False}
# Llama 4's language model (Llama4TextConfig's defaults; Scout's shape): Llama4ForConditionalGeneration.
_TEXT_DEFAULTS["llama4_text"] = {
    "vocab_size": 202_048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16_384,
    "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0,
    "tie_word_embeddings": False, "num_experts_per_tok": 1, "num_local_experts": 16, "attention_chunk_size": 8192}
# Ministral 3's language model (Ministral3Config's defaults: the 8B's shape, YaRN with Llama 4's query scaling):
# Mistral3ForConditionalGeneration's text_config on the Ministral 3 and Mistral-Medium-3.5 releases.
_TEXT_DEFAULTS["ministral3"] = {
    "vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 14_336, "num_hidden_layers": 34,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 262_144, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "sliding_window": None,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
                        "original_max_position_embeddings": 16_384, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}}
# Mistral 4's language model (Mistral4Config's defaults: DeepSeek's latent attention and experts, YaRN with Llama 4's
# query scaling): Mistral3ForConditionalGeneration's text_config on the Mistral Small 4 releases (models/mistral4.py).
_TEXT_DEFAULTS["mistral4"] = {
    "vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 12_288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": 1,
    "n_routed_experts": 128, "routed_scaling_factor": 1.0, "kv_lora_rank": 256, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 4, "first_k_dense_replace": 0, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 1_048_576, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_interleave": True, "attention_bias": False,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 128.0,
                        "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
                        "partial_rotary_factor": 0.5}}
# Qwen3.5's language models (Qwen3_5TextConfig's / Qwen3_5MoeTextConfig's defaults: the 9B's and the 35B-A3B's
# shapes): Qwen3_5(Moe)ForConditionalGeneration's text_config (models/qwen3_5.py).
_QWEN3_5_TEXT = {
    "vocab_size": 248_320, "hidden_size": 4096, "intermediate_size": 12_288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "hidden_act": "silu",
    "max_position_embeddings": 32_768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25}}
_TEXT_DEFAULTS["qwen3_5_text"] = _QWEN3_5_TEXT
_TEXT_DEFAULTS["qwen3_5_moe_text"] = {
    **_QWEN3_5_TEXT, "vocab_size": 248_320, "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8,
    "num_experts": 256}
# Checkpoints whose text fields may sit at the top level beside vision_config (transformers < 5 wrote Qwen2-VL so).
_FLAT_TEXT = {"Qwen2VLForConditionalGeneration": "qwen2_vl_text", "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text"}
# Multimodal-RoPE checkpoints -> transformers' mrope_section when the config leaves it out.
_MROPE_SECTION = {"Qwen2VLForConditionalGeneration": [16, 24, 24], "Qwen2_5_VLForConditionalGeneration": [16, 24, 24],
                  "Qwen3VLForConditionalGeneration": [24, 20, 20], "Qwen3VLMoeForConditionalGeneration": [24, 20, 20],
                  # (over the rotated pairs only: a quarter of each head on the releases)
                  "Qwen3_5ForConditionalGeneration": [11, 11, 10], "Qwen3_5MoeForConditionalGeneration": [11, 11, 10]}

# Multimodal checkpoints: architecture -> the text model_type when text_config does not say.
MULTIMODAL_ARCHITECTURES = {"Gemma3ForConditionalGeneration": "gemma3_text",
                            "Gemma4ForConditionalGeneration": "gemma4_text", "LlavaForConditionalGeneration": "llama",
                            "Idefics3ForConditionalGeneration": "llama", "SmolVLMForConditionalGeneration": "llama",
                            "Mistral3ForConditionalGeneration": "mistral", "LlavaNextForConditionalGeneration": "llama",
                            "Qwen3VLForConditionalGeneration": "qwen3_vl_text", "InternVLForConditionalGeneration": "qwen2",
                            "InternVLChatModel": "qwen2",
                            "LlavaOnevisionForConditionalGeneration": "qwen2",
                            "Qwen2AudioForConditionalGeneration": "qwen2",
                            "VoxtralForConditionalGeneration": "llama",
                            "Qwen3VLMoeForConditionalGeneration": "qwen3_vl_moe_text",
                            "Llama4ForConditionalGeneration": "llama4_text",
                            "Qwen3_5ForConditionalGeneration": "qwen3_5_text",
                            "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe_text",
                            **_FLAT_TEXT}

# Architectures whose config class gives its text_config other defaults than the text model_type's own (VoxtralConfig:
# Voxtral-Mini's Llama, its rope_theta 1e8), for a config.json that leaves them out.
_ARCHITECTURE_TEXT_DEFAULTS = {"VoxtralForConditionalGeneration": {
    "vocab_size": 131_072, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 30,
    "num_key_value_heads": 8, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-5, "rope_theta": 100_000_000.0,
    "head_dim": 128}}


def _text_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """A multimodal checkpoint's language model config: text_config over transformers' defaults for its
    model_type, under the checkpoint's architecture name (models/registry.py maps it to the model class). The
    rest of the checkpoint's config (vision_config, the image token, the projector's settings) is kept whole
    under "multimodal" for the model and the prompt processor (multimodal/processing.py)."""
    arch = config["architectures"][0]
    # InternVL's remote-code layout (InternVLChatConfig) names its language model's config llm_config.
    key = "llm_config" if arch == "InternVLChatModel" else "text_config"
    text = config.get(key)
    if text is None and arch in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration"):
        text = {}  # LlavaConfig's / LlavaNextConfig's default: a Llama
    if text is None and arch in _FLAT_TEXT:
        text = {k: v for k, v in config.items() if k not in ("vision_config", "model_type")}
    if not isinstance(text, dict):
        raise ModelLoadError(f"{where}: {arch} needs a {key} object")
    model_type = str(text.get("model_type") or MULTIMODAL_ARCHITECTURES[arch])
    if model_type not in _TEXT_DEFAULTS:
        raise UnsupportedModelError(f"{where}: {key}.model_type {model_type!r} of {arch} is not supported "
                                    f"(supported: {', '.join(sorted(_TEXT_DEFAULTS))})")
    defaults = {**_TEXT_DEFAULTS[model_type], **_ARCHITECTURE_TEXT_DEFAULTS.get(arch, {})}
    if isinstance(text.get("rope_parameters"), dict) and "rope_theta" in text["rope_parameters"]:
        defaults.pop("rope_theta", None)  # transformers 5 writes the theta there: a default must not shadow it
    merged = {**defaults, **text, "model_type": model_type, "architectures": config["architectures"],
              "multimodal": {k: v for k, v in config.items() if k != key}}
    if "torch_dtype" in config or "dtype" in config:
        merged.setdefault("torch_dtype", config.get("torch_dtype") or config.get("dtype"))
    if arch in _MROPE_SECTION:
        _take_mrope(merged, _MROPE_SECTION[arch])
    return merged


def _take_mrope(config: dict[str, Any], default_section: list[int]) -> None:
    """Qwen2-VL's multimodal RoPE: its mrope_section (rotary pairs turned by the temporal, height and width
    position) moves to the config's top level, and the rope itself is the plain one it scales nothing of
    (transformers < 5 named it rope_scaling {"type": "mrope"}; 5 puts the section in rope_parameters)."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = config.get(key)
        if isinstance(rope, dict) and "mrope_section" in rope:
            config["mrope_section"] = [int(x) for x in rope["mrope_section"]]
            if "mrope_interleaved" in rope:  # Qwen3-VL's layout (layers/rotary.py MRotaryEmbedding)
                config["mrope_interleaved"] = rope["mrope_interleaved"]
            rest = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
            if rest.get("rope_type", rest.get("type")) in ("mrope", "default", None):
                rest = {k: v for k, v in rest.items() if k not in ("type", "rope_type")}
                if "rope_theta" in rest:
                    config["rope_theta"] = rest.pop("rope_theta")
                config[key] = None if not rest else {"rope_type": "default", **rest}
    config.setdefault("mrope_section", default_section)  # transformers' default when the config leaves it out


def spec_from_hf_config(config: dict[str, Any], where: str, *, scaled_context: bool = True) -> ModelSpec:
    """Build the spec from an HF config dict; `where` names the file in errors. scaled_context: a
    linear or YaRN rope scaling extends the context past max_position_embeddings, as vLLM derives it
    (config.json; a GGUF's context_length is taken as it is)."""
    if isinstance(config.get("architectures"), list) and config["architectures"][:1] and (
            config["architectures"][0] in MULTIMODAL_ARCHITECTURES):
        config = _text_config(config, where)
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ModelLoadError(f"{where}: field 'architectures' is missing (cannot tell which model class to use)")
    if config.get("model_type") == "gemma4_text":
        config = _gemma4_text(config, where)
    if config.get("model_type") in _OWN_NAMES:
        config = _common_names(config)

    def need(key: str) -> int:
        if key not in config or config[key] is None:
            raise ModelLoadError(f"{where}: required field {key!r} is missing")
        return to_int(config[key], f"{where}: field {key!r}")

    def optional(key: str, default: int) -> int:
        value = config.get(key)
        # null or 0 means "not set" (configs write either), as in transformers' own `or` defaults.
        return default if value is None or value == 0 else to_int(value, f"{where}: field {key!r}")

    def mapping(key: str) -> dict[str, Any] | None:
        value = config.get(key)
        if value and not isinstance(value, dict):
            raise ModelLoadError(f"{where}: field {key!r} must be an object, got {value!r}")
        return value or None

    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = optional("num_key_value_heads", heads)
    if not config.get("head_dim") and hidden < heads:
        raise ModelLoadError(f"{where}: num_attention_heads {heads} is larger than hidden_size {hidden}")
    head_dim = optional("head_dim", hidden // heads)
    kv_planes = 2
    if config.get("kv_lora_rank"):
        # Multi-head latent attention (DeepSeek-V2/V3, models/deepseek_v2.py): the paged cache holds one
        # latent "KV head" a token, [c_kv | k_pe], whatever head counts the config names, in one plane (the
        # value is the latent itself: models/mla_attention.py).
        kv_heads, head_dim, kv_planes = 1, need("kv_lora_rank") + need("qk_rope_head_dim"), 1
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # transformers >= 5 nests rope_theta and the scaling under rope_parameters.
    rope = mapping("rope_parameters") or {}
    scaling = mapping("rope_scaling") or (rope if rope_type_of(rope) != "default" else None)
    theta = config.get("rope_theta")
    if theta is None:  # absent, or null beside a nested rope_parameters
        theta = rope.get("rope_theta", 10000.0)
    if scaling is not None:
        scaling = _normalized_scaling(config, scaling)
    if kv_planes == 1:
        _check_mla_rotary(config, rope, where)
    max_pos = optional("max_position_embeddings", 2048)
    if scaled_context and scaling is not None:
        max_pos = _scaled_context(scaling, max_pos, where)
    num_layers = need("num_hidden_layers")
    layer_kv_shapes: tuple[tuple[int, int], ...] = ()
    if "gemma4_layer_kv" in config:
        layer_kv_shapes = tuple(tuple(x) for x in config["gemma4_layer_kv"])
    hybrid = hybrid_layer_types(config)
    if hybrid is not None:
        # (a linear-attention layer keeps recurrent states, no KV: a zero-head cache, worker/recurrent_states.py)
        layer_kv_shapes = tuple((kv_heads if kind == "full_attention" else 0, head_dim) for kind in hybrid)
        if config.get("intermediate_size") is None and config.get("moe_intermediate_size") is not None:
            config = {**config, "intermediate_size": config["moe_intermediate_size"]}  # (every MLP routed)
    window = config.get("sliding_window")
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    if window and config.get("use_sliding_window", True):
        window = to_int(window, f"{where}: field 'sliding_window'")
        # A window of W lets a token see itself and the W - 1 before it (transformers' mask: kv > q - W;
        # vLLM's flash-attention window W - 1). One at least as long as the context is full attention.
        if window < max_pos:
            sliding_window, sliding_layers = window, sliding_layer_kinds(config, num_layers, where)
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = _DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32)
    return ModelSpec(
        hf_config=config,
        architecture=str(archs[0]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        max_position_embeddings=max_pos,
        dtype=dtype,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rms_norm_eps=to_float(config.get("rms_norm_eps", 1e-6), f"{where}: field 'rms_norm_eps'"),
        rope_theta=to_float(theta, f"{where}: field 'rope_theta'"),
        rope_scaling=dict(scaling) if scaling else None,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        hidden_act=str(config.get("hidden_act", "silu")),
        moe=_moe_spec(config, where),
        sliding_window=sliding_window,
        sliding_layers=sliding_layers,
        rotary_dim=_rotary_dim(config, rope, head_dim, where) if kv_planes == 2 else None,
        kv_planes=kv_planes,
        layer_kv_shapes=layer_kv_shapes,
    )


def _gemma4_text(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 4's language model config as the rest of the loader reads it (transformers' Gemma4TextConfig):
    its defaults under what it writes; layer_types (five sliding layers to one full, the last always full);
    the experts' top_k_experts as num_experts_per_tok (no experts unless enable_moe_block); and each layer's
    (KV heads, head_dim) as `gemma4_layer_kv`: full-attention layers take global_head_dim (512 by default) and,
    with attention_k_eq_v, num_global_key_value_heads (the published configs) -- or what transformers 5.25 writes,
    per_layer_config {layer: {head_dim, num_key_value_heads}}."""
    config = {**{k: v for k, v in _TEXT_DEFAULTS["gemma4_text"].items() if k not in config}, **config}
    layers = to_int(config["num_hidden_layers"], f"{where}: field 'num_hidden_layers'")
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    elif not isinstance(types, list) or len(types) != layers:
        raise ModelLoadError(f"{where}: field 'layer_types' must list one type per layer ({layers}), got {types!r}")
    config["layer_types"] = [*types[:-1], "full_attention"]  # (transformers forces the last layer full)
    if config.get("enable_moe_block"):
        config["num_experts_per_tok"] = config.get("top_k_experts")
    else:
        config["num_experts"] = None
    kv_heads = to_int(config.get("num_key_value_heads") or config["num_attention_heads"],
                      f"{where}: field 'num_key_value_heads'")
    head_dim = to_int(config["head_dim"], f"{where}: field 'head_dim'")
    overrides = config.get("per_layer_config")
    if not isinstance(overrides, dict):
        full: dict[str, Any] = {"head_dim": config.get("global_head_dim") or 512}
        if config.get("attention_k_eq_v") and config.get("num_global_key_value_heads"):
            full["num_key_value_heads"] = config["num_global_key_value_heads"]
        overrides = {str(i): full for i, t in enumerate(config["layer_types"]) if t == "full_attention"}
    shapes = []
    shared_from = layers - int(config.get("num_kv_shared_layers") or 0)
    for i in range(layers):
        if i >= shared_from > 0:
            shapes.append([1, 1])  # (a KV-sharing layer attends over an earlier layer's cache: nothing is written)
            continue
        layer = overrides.get(str(i)) or overrides.get(i) or {}
        shapes.append([to_int(layer.get("num_key_value_heads", kv_heads), f"{where}: per_layer_config[{i}]"),
                       to_int(layer.get("head_dim", head_dim), f"{where}: per_layer_config[{i}]")])
    config["gemma4_layer_kv"] = shapes
    return config


def _normalized_scaling(config: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """The rope scaling with original_max_position_embeddings inside it: Phi-3 writes it at the top
    level of config.json, which transformers gives priority over the scaling's own."""
    scaling = dict(scaling)
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in ("llama3", "yarn", "longrope", "su") and config.get("original_max_position_embeddings"):
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    return scaling


def _scaled_context(scaling: dict[str, Any], max_pos: int, where: str) -> int:
    """vLLM's context for a scaled rope: linear (and dynamic) stretch max_position_embeddings by
    `factor`; YaRN stretches original_max_position_embeddings by it (Qwen3: 32,768 x 4 = 131,072);
    llama3 and LongRoPE configs already state the extended length."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("linear", "dynamic", "yarn") or scaling.get("factor") is None:
        return max_pos
    factor = to_float(scaling["factor"], f"{where}: field 'rope_scaling.factor'")
    if factor <= 0:
        raise ModelLoadError(f"{where}: field 'rope_scaling.factor' must be positive, got {factor}")
    base = max_pos
    if kind == "yarn" and scaling.get("original_max_position_embeddings"):
        base = to_int(scaling["original_max_position_embeddings"],
                      f"{where}: field 'rope_scaling.original_max_position_embeddings'")
    return int(base * factor)


def _rotary_dim(config: dict[str, Any], rope: dict[str, Any], head_dim: int, where: str) -> int | None:
    """How many dims of a head rotate (partial_rotary_factor, at the top level or, transformers >= 5,
    under rope_parameters, which wins as in transformers); None when all do."""
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is None:
        return None
    factor = to_float(factor, f"{where}: field 'partial_rotary_factor'")
    rotary_dim = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
        raise ModelLoadError(f"{where}: field 'partial_rotary_factor' {factor} gives {rotary_dim} rotary dims of "
                             f"the head's {head_dim}; it must be in (0, 1] and give an even number")
    return None if rotary_dim == head_dim else rotary_dim


def _check_mla_rotary(config: dict[str, Any], rope: dict[str, Any], where: str) -> None:
    """Latent attention rotates qk_rope_head_dim dims of each query head (models/deepseek_v2.py reads them): a
    partial_rotary_factor (Mistral 4 writes one, of qk_nope_head_dim + qk_rope_head_dim) must say the same."""
    nope, rotary = config.get("qk_nope_head_dim"), config.get("qk_rope_head_dim")
    if isinstance(nope, int) and isinstance(rotary, int) and nope >= 0 and rotary > 0:
        got = _rotary_dim(config, rope, nope + rotary, where)
        if got not in (None, rotary):
            raise ModelLoadError(f"{where}: field 'partial_rotary_factor' gives {got} rotary dims of a "
                                 f"{nope + rotary}-dim query head; latent attention rotates its qk_rope_head_dim "
                                 f"{rotary}")


# Families whose config.json keeps its own names (transformers' attribute_map of GPT2Config, OPTConfig): the common
# ones are added beside them.
_OWN_NAMES = {
    "gpt2": {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
             "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layer_norm_eps",
             "activation_function": "hidden_act"},
    "opt": {"ffn_dim": "intermediate_size", "activation_function": "hidden_act"},
}


def _common_names(config: dict[str, Any]) -> dict[str, Any]:
    own = _OWN_NAMES[config["model_type"]]
    named = {common: config[key] for key, common in own.items() if key in config and common not in config}
    if config["model_type"] == "gpt2" and "intermediate_size" not in config:
        inner = config.get("n_inner")  # (None: four times the width)
        named["intermediate_size"] = inner if inner else 4 * config.get("n_embd", config.get("hidden_size", 0))
    return {**config, **named}


def _moe_spec(config: dict[str, Any], where: str) -> MoeSpec | None:
    """The experts of an MoE config, None for a dense one. Qwen names the count num_experts,
    Mixtral num_local_experts; Mixtral's experts have intermediate_size, Qwen's moe_intermediate_size."""
    def integer(*keys: str, minimum: int = 1) -> int:
        """The first of `keys` set (not null or 0), checked; 0 when none is."""
        key = next((k for k in keys if config.get(k) not in (None, 0)), None)
        return 0 if key is None else to_int(config[key], f"{where}: field {key!r}", minimum)

    if "moe_topk" in config:
        return None  # (Hunyuan's own names, per-layer lists among them: models/hunyuan.py builds its MoeSpec)
    num_experts = integer("num_experts", "num_local_experts")
    if num_experts == 0:
        return None
    top_k = integer("num_experts_per_tok")
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    layers = config.get("mlp_only_layers") or []
    if not isinstance(layers, list):
        raise ModelLoadError(f"{where}: field 'mlp_only_layers' must be a list of layer indices, got {layers!r}")
    return MoeSpec(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=integer("moe_intermediate_size", "intermediate_size"),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=integer("shared_expert_intermediate_size"),
        decoder_sparse_step=integer("decoder_sparse_step") or 1,
        mlp_only_layers=tuple(to_int(i, f"{where}: field 'mlp_only_layers'", minimum=0) for i in layers),
    )


def hf_config_from_gguf(gguf: Any) -> dict[str, Any]:
    """The config.json a GGUF file stands for (keys named as transformers names them)."""
    from ferrox.loader.gguf_families import GGUF_FAMILIES, check_file, family_config
    from ferrox.loader.gguf_file import GGUF_ARCHITECTURES

    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {gguf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    family = GGUF_FAMILIES.get(arch)
    if family is not None:
        check_file(gguf, family)  # (before anything below reads a key or tensor the family does not honour)

    def what(key: str) -> str:
        return f"GGUF file {gguf.path}: metadata {key}"

    def need(suffix: str) -> Any:
        value = gguf.arch_key(suffix)
        if value is None:
            raise ModelLoadError(f"{what(f'{arch}.{suffix}')} is missing")
        return value

    def integer(suffix: str, default: int | None = None) -> int:
        """A positive integer: metadata of a corrupt file can hold any type (or a zero head count)."""
        value = need(suffix) if default is None else gguf.arch_key(suffix) or default
        return to_int(value, what(f"{arch}.{suffix}"))

    def number(suffix: str, default: float) -> float:
        return to_float(gguf.arch_key(suffix) or default, what(f"{arch}.{suffix}"))

    meta = gguf.metadata
    heads = integer("attention.head_count")
    hidden = integer("embedding_length")
    # A Phi-3 file's rope.dimension_count is its rotary part (Phi-4-mini: 96 of 128), not the head; so is a
    # gguf_families.py family's (Phi-2, GPT-NeoX, GLM-4), which checks it against the head.
    dim_keys = (("attention.key_length",) if arch == "phi3" or family is not None
                else ("attention.key_length", "rope.dimension_count"))
    dim_key = next((k for k in dim_keys if gguf.arch_key(k)), None)
    if dim_key is None and hidden < heads:
        raise ModelLoadError(f"{what(f'{arch}.attention.head_count')} {heads} is larger than "
                             f"{arch}.embedding_length {hidden}")
    head_dim = integer(dim_key) if dim_key else hidden // heads
    vocab = gguf.arch_key("vocab_size")
    if vocab is None:
        tokens = gguf.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ModelLoadError(f"GGUF file {gguf.path}: cannot tell the vocabulary size")
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        # An MoE file may give only its experts' size (then no layer is dense).
        "intermediate_size": integer("feed_forward_length", gguf.arch_key("expert_feed_forward_length") or None),
        "num_hidden_layers": integer("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": integer("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": to_int(vocab, what(f"{arch}.vocab_size")),
        "max_position_embeddings": integer("context_length", 2048),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": number("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names,
        "attention_bias": "blk.0.attn_output.bias" in gguf.tensor_names,
        "torch_dtype": _gguf_dtype(gguf),
    }
    if family is not None:
        config.update(family_config(gguf, family, config))
    if arch in ("qwen2", "qwen2moe"):
        config["attention_bias"] = False  # qkv bias is implied by the architecture; o_proj has none
    if gguf.arch_key("expert_count"):
        config.update(_gguf_experts(gguf, arch, integer))
    if arch == "phi3":
        config.update(_gguf_phi3(gguf, config, integer))
    if arch in ("gemma2", "gemma3"):
        config.update(_gguf_gemma(gguf, arch, config, integer))
    if arch == "granite":
        # llama.cpp names Granite's *_multiplier fields *_scale (models/granite.py folds them at load).
        for key, field in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                           ("attention.scale", "attention_multiplier"), ("logit_scale", "logits_scaling")):
            if gguf.arch_key(key) is not None:
                config[field] = to_float(gguf.arch_key(key), what(f"{arch}.{key}"))
    scaling_type = gguf.arch_key("rope.scaling.type")
    if "rope_scaling" in config:
        pass  # set by the family above (Phi-3's LongRoPE)
    elif "rope_freqs.weight" in gguf.tensor_names:
        config["rope_scaling"] = {"rope_type": "freq_factors", "factors": gguf.float_tensor("rope_freqs.weight").tolist()}
    elif scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": to_float(need("rope.scaling.factor"), what(f"{arch}.rope.scaling.factor"))}
    elif scaling_type == "yarn":
        factor = to_float(need("rope.scaling.factor"), what(f"{arch}.rope.scaling.factor"))
        original = integer("rope.scaling.original_context_length", config["max_position_embeddings"])
        config["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
        # vLLM's context for YaRN (spec_from_hf_config's _scaled_context), when the file states less.
        config["max_position_embeddings"] = max(config["max_position_embeddings"], int(original * factor))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF file {gguf.path}: rope scaling {scaling_type!r} is not supported")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad")] = to_int(meta[f"tokenizer.ggml.{key}"],
                                                           what(f"tokenizer.ggml.{key}"), minimum=0)
    return config


def _gguf_experts(gguf: Any, arch: str, integer: Any) -> dict[str, Any]:
    """The MoE keys of a GGUF's config. Top-k weights are renormalised as llama.cpp runs each family:
    Qwen3-MoE yes, Qwen2-MoE no (Mixtral always does, whatever the config says)."""
    experts: dict[str, Any] = {"num_experts": integer("expert_count"), "num_experts_per_tok": integer("expert_used_count")}
    if arch == "llama":  # Mixtral: llama.cpp stores it as llama with experts of feed_forward_length
        return {**experts, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": experts.pop("num_experts")}
    experts["moe_intermediate_size"] = integer("expert_feed_forward_length")
    # A layer without a router is a dense one (Qwen's mlp_only_layers; the metadata has no such key).
    routed = {name.split(".")[1] for name in gguf.tensor_names if name.endswith(".ffn_gate_inp.weight")}
    experts["mlp_only_layers"] = [i for i in range(integer("block_count")) if str(i) not in routed]
    norm = gguf.arch_key("expert_weights_norm")
    experts["norm_topk_prob"] = bool(norm) if norm is not None else arch == "qwen3moe"
    if gguf.arch_key("expert_shared_feed_forward_length"):
        experts["shared_expert_intermediate_size"] = integer("expert_shared_feed_forward_length")
    return experts


def _gguf_phi3(gguf: Any, config: dict[str, Any], integer: Any) -> dict[str, Any]:
    """Phi-3's GGUF keys (llama.cpp's converter): partial rotary as rope.dimension_count, the sliding
    window (0: none, Phi-4), and LongRoPE as two factor tensors beside rope.scaling.original_context_length
    (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini); the attention factor follows from the two lengths."""
    out: dict[str, Any] = {}
    head_dim = config["head_dim"]
    rotary = integer("rope.dimension_count", head_dim)
    if rotary != head_dim:
        out["partial_rotary_factor"] = rotary / head_dim
    window = gguf.arch_key("attention.sliding_window")
    if window:
        out["sliding_window"] = integer("attention.sliding_window")
    original = gguf.arch_key("rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = integer("rope.scaling.original_context_length")
    if "rope_factors_long.weight" in gguf.tensor_names:
        if not original:
            raise ModelLoadError(f"GGUF file {gguf.path}: rope_factors_long.weight without metadata "
                                 "phi3.rope.scaling.original_context_length")
        out["rope_scaling"] = {
            "rope_type": "longrope", "original_max_position_embeddings": out["original_max_position_embeddings"],
            "long_factor": gguf.float_tensor("rope_factors_long.weight").tolist(),
            "short_factor": gguf.float_tensor("rope_factors_short.weight").tolist(),
        }
    return out


def _gguf_gemma(gguf: Any, arch: str, config: dict[str, Any], integer: Any) -> dict[str, Any]:
    """Gemma 2 / 3 keys of llama.cpp's files: the soft caps and the sliding window as metadata; the
    attention scale, which the files do not store, as llama.cpp derives it (query_pre_attn_scalar:
    hidden / heads for the 27B models -- 46 layers for Gemma 2, 62 for Gemma 3 -- else head_dim); Gemma 3's
    local RoPE base, fixed at 10,000 (its global base is rope.freq_base, its scaling rope.scaling.*)."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = gguf.arch_key(key)
        if value:
            out[key] = to_float(value, f"GGUF file {gguf.path}: metadata {arch}.{key}")
    if gguf.arch_key("attention.sliding_window"):
        out["sliding_window"] = integer("attention.sliding_window")
    big = config["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
    out["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else config["head_dim"]
    if arch == "gemma3":
        out["rope_local_base_freq"] = 10_000.0
    return out


def _gguf_dtype(gguf: Any) -> str:
    from gguf import GGMLQuantizationType

    types = {GGMLQuantizationType(t.tensor_type) for t in gguf.reader.tensors}
    if types <= {GGMLQuantizationType.F32}:
        return "float32"
    if GGMLQuantizationType.BF16 in types:
        return "bfloat16"
    return "float16" if GGMLQuantizationType.F16 in types else "bfloat16"


def load_model_spec(source: ModelSource, hf_overrides: dict[str, Any] | None = None,
                    config_format: str = "auto") -> ModelSpec:
    """The spec from config.json (HF folder), Mistral's params.json (config_format, vLLM's: loader/config_file.py)
    or the GGUF metadata. hf_overrides: fields that replace the config's (vLLM's --hf-overrides; each key's whole
    value), named in errors."""
    if source.format == "gguf":
        from ferrox.loader.gguf_file import open_gguf

        if config_format == "mistral":
            raise ModelNotFoundError(f"config_format 'mistral' reads a folder's params.json; {source.path} is a GGUF "
                                     "file")
        gguf = open_gguf(source.path)
        config, where, scaled = hf_config_from_gguf(gguf), gguf.path, False
    else:
        config, where = read_model_config(source.path, config_format)
        scaled = True
    if hf_overrides:
        config = {**config, **hf_overrides}
        where = f"{where} with hf_overrides"
    return spec_from_hf_config(config, where, scaled_context=scaled)
