"""The shape of a model (ferrox.model_spec.ModelSpec), read from config.json or from GGUF metadata.

The spec keeps the raw HF config (`hf_config`) for anything model code needs beyond the common
fields, and normalises the fields that moved between transformers versions (rope_theta /
rope_scaling vs rope_parameters, torch_dtype vs dtype).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from ferrox.loader.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from ferrox.loader.source import ModelSource
from ferrox.model_spec import ModelSpec, MoeSpec

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def spec_from_hf_config(config: dict[str, Any], where: str) -> ModelSpec:
    """Build the spec from an HF config dict; `where` names the file in errors."""
    archs = config.get("architectures")
    if not archs or not isinstance(archs, list):
        raise ModelLoadError(f"{where}: field 'architectures' is missing (cannot tell which model class to use)")

    def need(key: str) -> Any:
        if key not in config or config[key] is None:
            raise ModelLoadError(f"{where}: required field {key!r} is missing")
        return config[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    # transformers >= 5 nests rope_theta and the scaling under rope_parameters.
    rope = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    theta = config.get("rope_theta")
    if theta is None:  # absent, or null beside a nested rope_parameters
        theta = rope.get("rope_theta", 10000.0)
    max_pos = int(config.get("max_position_embeddings") or 2048)
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True) and int(window) < max_pos:
        # Sliding-window attention is not implemented: within the window it equals full attention,
        # so cap the context there and stay exact (Mistral v0.1: 4096 of 32768).
        max_pos = int(window)
    dtype_name = config.get("torch_dtype") or config.get("dtype") or "float32"
    dtype = _DTYPES.get(str(dtype_name).replace("torch.", ""), torch.float32)
    return ModelSpec(
        hf_config=config,
        architecture=str(archs[0]),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        vocab_size=int(need("vocab_size")),
        max_position_embeddings=max_pos,
        dtype=dtype,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        hidden_act=str(config.get("hidden_act", "silu")),
        moe=_moe_spec(config, where),
    )


def _moe_spec(config: dict[str, Any], where: str) -> MoeSpec | None:
    """The experts of an MoE config, None for a dense one. Qwen names the count num_experts,
    Mixtral num_local_experts; Mixtral's experts have intermediate_size, Qwen's moe_intermediate_size."""
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    if num_experts <= 0:
        return None
    top_k = int(config.get("num_experts_per_tok") or 0)
    if not 0 < top_k <= num_experts:
        raise ModelLoadError(f"{where}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    step = int(config.get("decoder_sparse_step") or 1)
    return MoeSpec(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        intermediate_size=int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=max(step, 1),
        mlp_only_layers=tuple(int(i) for i in config.get("mlp_only_layers") or ()),
    )


def hf_config_from_gguf(gguf: Any) -> dict[str, Any]:
    """The config.json a GGUF file stands for (keys named as transformers names them)."""
    from ferrox.loader.gguf_file import GGUF_ARCHITECTURES

    arch = gguf.architecture
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF file {gguf.path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )

    def need(suffix: str) -> Any:
        value = gguf.arch_key(suffix)
        if value is None:
            raise ModelLoadError(f"GGUF file {gguf.path}: metadata {arch}.{suffix} is missing")
        return value

    meta = gguf.metadata
    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    head_dim = int(gguf.arch_key("attention.key_length") or gguf.arch_key("rope.dimension_count") or hidden // heads)
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
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf.arch_key("attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(gguf.arch_key("context_length") or 2048),
        "rms_norm_eps": float(gguf.arch_key("attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": float(gguf.arch_key("rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in gguf.tensor_names,
        "attention_bias": "blk.0.attn_output.bias" in gguf.tensor_names,
        "torch_dtype": _gguf_dtype(gguf),
    }
    if arch == "qwen2":
        config["attention_bias"] = False  # qkv bias is implied by the architecture; o_proj has none
    scaling_type = gguf.arch_key("rope.scaling.type")
    if "rope_freqs.weight" in gguf.tensor_names:
        config["rope_scaling"] = {"rope_type": "freq_factors", "factors": gguf.float_tensor("rope_freqs.weight").tolist()}
    elif scaling_type == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"GGUF file {gguf.path}: rope scaling {scaling_type!r} is not supported")
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def _gguf_dtype(gguf: Any) -> str:
    from gguf import GGMLQuantizationType

    types = {GGMLQuantizationType(t.tensor_type) for t in gguf.reader.tensors}
    if types <= {GGMLQuantizationType.F32}:
        return "float32"
    if GGMLQuantizationType.BF16 in types:
        return "bfloat16"
    return "float16" if GGMLQuantizationType.F16 in types else "bfloat16"


def load_model_spec(source: ModelSource) -> ModelSpec:
    """The spec from config.json (HF folder) or from the GGUF metadata."""
    if source.format == "gguf":
        from ferrox.loader.gguf_file import open_gguf

        gguf = open_gguf(source.path)
        return spec_from_hf_config(hf_config_from_gguf(gguf), gguf.path)
    path = os.path.join(source.path, "config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"model folder {source.path} has no config.json")
    return spec_from_hf_config(read_json(path), path)
