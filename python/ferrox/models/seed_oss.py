"""Seed-OSS (ByteDance-Seed/Seed-OSS-36B-Base / -Instruct: SeedOssForCausalLM): the Llama decoder with its
attention biases switched apart.

As transformers' SeedOss defines it, the arithmetic is Llama's (pre-norm layers, SiLU MLP, rotary over whole
heads, softmax scale head_dim ** -0.5); what differs is which projections carry a bias, and the defaults of
the config fields that say so:

- `attention_bias` (default true): q, k and v carry a bias (Llama reads the field for o_proj too);
- `attention_out_bias` (default false): o_proj carries one;
- `mlp_bias` (default false): gate, up and down carry one (LlamaMLP reads it).

Every device path is Llama's: the fused one-token kernels add each projection's bias in their epilogues
(attention/fused_decode.py), the CPU Rust decoder takes them too, and tensor parallelism, checkpoint
quantization and LoRA come with the Llama layers. The dropouts (attention_dropout, residual_dropout) are
training-only. Refused by name: a config.json without `head_dim` whose hidden_size / num_attention_heads is
not 128 (transformers then takes 128, the KV cache would be sized by the quotient) and `sliding_window`
(transformers' SeedOss attends to the whole context). No GGUF mapping (loader/gguf_file.py refuses the
architecture by name).
"""

from __future__ import annotations

from typing import Any

import torch

from ferrox.attention.backend import AttentionBackend
from ferrox.layers.ops import DeviceOps
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM, LlamaModel

ARCHITECTURE = "SeedOssForCausalLM"
# transformers' SeedOssConfig defaults for the fields config.json may leave out.
DEFAULT_HEAD_DIM = 128
DEFAULT_ATTENTION_BIAS = True
DEFAULT_ATTENTION_OUT_BIAS = False


def _flag(config: dict[str, Any], key: str, default: bool) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ModelLoadError(f"config.json: field {key!r} must be true or false, got {value!r}")
    return value


def seed_oss_biases(config: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v bias, o_proj bias) as transformers' SeedOss reads config.json."""
    return (_flag(config, "attention_bias", DEFAULT_ATTENTION_BIAS),
            _flag(config, "attention_out_bias", DEFAULT_ATTENTION_OUT_BIAS))


def check_seed_oss_config(spec: ModelSpec) -> None:
    """The fields ferrox cannot read as transformers does (module docstring)."""
    config = spec.hf_config
    if config.get("sliding_window") is not None:
        raise UnsupportedModelError(f"config.json: sliding_window {config['sliding_window']!r} is not supported for "
                                    f"{ARCHITECTURE} (transformers' SeedOss attends to the whole context)")
    if "head_dim" not in config and spec.head_dim != DEFAULT_HEAD_DIM:
        raise UnsupportedModelError(
            f"config.json: head_dim is missing, which transformers' SeedOss reads as {DEFAULT_HEAD_DIM}, not "
            f"hidden_size / num_attention_heads = {spec.head_dim} as the rest of ferrox does; write head_dim "
            "into config.json")


class SeedOssModel(LlamaModel):
    """LlamaModel with Seed-OSS's two attention biases (the arguments LlamaForCausalLM derives from
    attention_bias alone are replaced)."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        qkv_bias, o_bias = seed_oss_biases(spec.hf_config)
        super().__init__(spec, backend, ops, dtype, device, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=False)


class SeedOssForCausalLM(LlamaForCausalLM):
    model_class = SeedOssModel

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_seed_oss_config(spec)
        super().__init__(spec, dtype, device, kernels=kernels)


__all__ = ["SeedOssForCausalLM", "SeedOssModel", "check_seed_oss_config", "seed_oss_biases"]
