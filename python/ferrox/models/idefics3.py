"""Idefics3 and SmolVLM (Idefics3ForConditionalGeneration: HuggingFaceM4/Idefics3-8B-Llama3, SmolVLM-256M/500M/
2.2B-Instruct; SmolVLMForConditionalGeneration: SmolVLM2): a SigLIP-like tower over each image tile
(vision/idefics3_vision.py), a connector, and a Llama that reads the connector's rows in place of the
prompt's image tokens, causal attention throughout.

As transformers' Idefics3Model: the tower's post_layernorm'd last hidden state [patches, hidden] is pixel
shuffled (each scale_factor x scale_factor block of neighbouring patches becomes one row of
scale_factor^2 * hidden features), then projected by `modality_projection` (one linear, no bias) to the
language model's width: image_seq_len rows per tile. The front-end cuts each image into tiles and makes
each tile one item of image_seq_len tokens (multimodal/idefics3_processing.py).

Checkpoint names: `model.vision_model.*`, `model.connector.modality_projection.proj.weight`,
`model.text_model.*`, `lm_head.weight` (absent when tied). Whether the LM head is tied is the top-level
config's tie_word_embeddings (transformers ties by it, not by text_config's). Unquantized. Under tensor parallelism the
Llama is sharded; the tower and connector load whole on every rank, the tower's blocks then sharded under
--mm-encoder-tp-mode weights (models/vision/encoder_setup.py; worker/rank_images.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.load_check import load_whole
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.idefics3_vision import Idefics3VisionTower
from ferrox.multimodal.idefics3_processing import idefics3_image_tokens


class ModalityProjection(nn.Module):
    """transformers' Idefics3SimpleMLP: one linear, no bias (its name gives the checkpoint's `.proj.`)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    """Pixel shuffle by `scale`, then modality_projection.proj: [B, side^2, hidden] -> [B, (side/scale)^2, text]."""

    def __init__(self, vision_hidden: int, text_hidden: int, scale: int, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.scale = scale
        self.modality_projection = ModalityProjection(vision_hidden * scale * scale, text_hidden, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, seq, hidden = x.shape
        side, s = int(seq ** 0.5), self.scale
        # transformers' pixel_shuffle: rows of the grid keep their order, s neighbouring columns merge, then
        # s neighbouring rows of those merge; the features of a block are ordered (row, column, hidden).
        x = x.view(b, side, side // s, hidden * s).permute(0, 2, 1, 3)
        x = x.reshape(b, side // s, side // s, hidden * s * s).permute(0, 2, 1, 3)
        return self.modality_projection(x.reshape(b, seq // (s * s), hidden * s * s))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    supports_tensor_parallel = True  # the tower and connector load whole (the tower's blocks sharded after)
    supports_quantized_gguf = False
    supports_quantization = False
    own_weight_prefixes = ("vision_model.", "connector.")
    takes_images = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        mm = spec.hf_config["multimodal"]
        text_type = spec.hf_config.get("model_type")
        if text_type != "llama":
            raise UnsupportedModelError(f"config.json: text_config.model_type {text_type!r} of an Idefics3 / SmolVLM "
                                        "model is not supported (llama)")
        spec = dataclasses.replace(spec, tie_word_embeddings=bool(mm.get("tie_word_embeddings", False)))
        super().__init__(spec, dtype, device, kernels=kernels)
        self.vision_model = Idefics3VisionTower(mm.get("vision_config") or {}, dtype=dtype,
                                                device=vision_device(device))
        self.image_tokens = idefics3_image_tokens(mm)  # checks that scale_factor divides the patch grid
        self.connector = Idefics3Connector(self.vision_model.hidden_size, spec.hidden_size,
                                           int(mm.get("scale_factor", 2)), dtype, vision_device(device))
        # What worker/multimodal.py checks a request's images (here: tiles) against.
        size = self.vision_model.image_size
        self.pixel_shape = (3, size, size)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] tiles -> [B, image_tokens, hidden] rows for the language model."""
        return self.connector(self.vision_model(pixel_values))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tower: list[tuple[str, Any]] = []
        connector: dict[str, torch.Tensor] = {}

        def language_model() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name.startswith("model.vision_model."):
                    tower.append((name[len("model.vision_model."):], tensor))
                elif name.startswith("model.connector."):
                    connector[name[len("model.connector."):]] = materialize(tensor)
                elif name.startswith("model.text_model."):
                    yield "model." + name[len("model.text_model."):], tensor
                else:
                    yield name, tensor

        super().load_weights(language_model())
        self.vision_model.load_weights((name, materialize(t)) for name, t in tower)
        load_whole(self.connector, connector, "model.connector", self.spec.architecture)


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM2's class name: the same model (its video inputs are not supported)."""
