"""InternVL's remote-code layout (InternVLChatModel: OpenGVLab/InternVL2.5-*, InternVL3-*, InternVL3.5-* without
"-HF", the layout most hub InternVL repos publish): the maths of InternVLForConditionalGeneration
(models/internvl.py) under other names and another config.

Config: the language model's is llm_config (loader/model_config.py reads it as the text config: Qwen2, Qwen3
or Llama; InternLM2 is refused by its model_type there), the rest is read in the native model's terms
(multimodal/internvl_chat_processing.py native_multimodal: select_layer, downsample_ratio, ps_version "v2"
only, InternVisionConfig's fields). Whether the LM head is tied is llm_config's tie_word_embeddings: the
remote code builds the language model from llm_config, which ties by it.

Weights, renamed on load to the native model's:
    vision_model.embeddings.{class_embedding, patch_embedding.*, position_embedding}
        -> vision_tower.embeddings.{cls_token, patch_embeddings.projection.*, position_embeddings}
    vision_model.encoder.layers.N.attn.qkv.*    the q, k, v rows stacked -> attention.{q,k,v}_proj.*
    vision_model.encoder.layers.N.{attn.proj, attn.q_norm, attn.k_norm, ls1, ls2, norm1, norm2, mlp.fc1/fc2}
        -> attention.projection_layer, attention.q_norm/k_norm, lambda_1, lambda_2, layernorm_before/after, mlp
    mlp1.{0, 1, 3}                              -> multi_modal_projector.{layer_norm, linear_1, linear_2}
    language_model.model.*, language_model.lm_head.*   (llava.py's CHECKPOINT_RENAMES take them)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.internvl import TEXT_MODELS, InternVLForConditionalGeneration
from ferrox.multimodal.internvl_chat_processing import native_multimodal

_EMBEDDINGS = {"class_embedding": "cls_token", "patch_embedding.weight": "patch_embeddings.projection.weight",
               "patch_embedding.bias": "patch_embeddings.projection.bias",
               "position_embedding": "position_embeddings"}
_LAYER = {"attn.proj.": "attention.projection_layer.", "attn.q_norm.": "attention.q_norm.",
          "attn.k_norm.": "attention.k_norm.", "norm1.": "layernorm_before.", "norm2.": "layernorm_after.",
          "mlp.": "mlp.", "ls1": "lambda_1", "ls2": "lambda_2"}
_PROJECTOR = {"mlp1.0.": "layer_norm.", "mlp1.1.": "linear_1.", "mlp1.3.": "linear_2."}


def native_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The remote checkpoint's tensors under the native model's names (module docstring); the fused qkv split
    by rows into its three equal parts. Other names pass through unchanged."""
    for name, tensor in weights:
        if name.startswith("mlp1."):
            for old, new in _PROJECTOR.items():
                if name.startswith(old):
                    name = "multi_modal_projector." + new + name[len(old):]
            yield name, tensor
        elif name.startswith("vision_model.embeddings."):
            rest = name[len("vision_model.embeddings."):]
            yield "vision_tower.embeddings." + _EMBEDDINGS.get(rest, rest), tensor
        elif name.startswith("vision_model.encoder.layers."):
            number, _, rest = name[len("vision_model.encoder.layers."):].partition(".")
            prefix = f"vision_tower.encoder.layer.{number}."
            if rest.startswith("attn.qkv."):
                q, k, v = materialize(tensor).chunk(3, dim=0)
                kind = rest[len("attn.qkv."):]
                yield from ((f"{prefix}attention.{part}_proj.{kind}", t.contiguous())
                            for part, t in zip("qkv", (q, k, v), strict=True))
                continue
            for old, new in _LAYER.items():
                if rest.startswith(old):
                    rest = new + rest[len(old):]
                    break
            yield prefix + rest, tensor
        else:
            yield name, tensor


class InternVLChatModel(InternVLForConditionalGeneration):
    """The native model built from the remote config, loading the remote names."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        text_type = spec.hf_config.get("model_type")
        if text_type not in TEXT_MODELS:
            raise UnsupportedModelError(f"config.json: llm_config.model_type {text_type!r} of an InternVLChatModel "
                                        f"is not supported ({', '.join(TEXT_MODELS)})")
        native = native_multimodal(spec.hf_config["multimodal"])
        native["tie_word_embeddings"] = spec.tie_word_embeddings  # llm_config's (module docstring)
        spec = dataclasses.replace(spec, hf_config={**spec.hf_config, "multimodal": native})
        super().__init__(spec, dtype, device, kernels=kernels)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(native_names(weights))
