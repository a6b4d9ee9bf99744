"""LLaVA (LlavaForConditionalGeneration: llava-1.5, llava-interleave-qwen and other llava-hf checkpoints):
a vision tower (CLIP or SigLIP: models/vision), a two-layer projector, and a Llama, Mistral or Qwen2
language model that reads the projected image rows in place of the prompt's image tokens.

As transformers' Llava: the tower's hidden state after `vision_feature_layer` (-2 for llava-1.5), the
first row dropped under the "default" feature strategy (CLIP's class token), then linear_1, the
projector activation (`projector_hidden_act`, GELU), linear_2. Each image of a prompt stands on a run of
`image_token_index` tokens, one per row (multimodal/processing.py expands the placeholder), and the
language model runs as it always does over the resulting embeddings, causal attention throughout.

Checkpoint names come in two layouts: transformers < 4.52 (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`) and newer ones
(`model.language_model.*`, `lm_head.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`).
Unquantized. Under tensor parallelism the language model is sharded as its text class is; the tower and
projector load whole on every rank (the tower's blocks then sharded under --mm-encoder-tp-mode weights:
models/vision/encoder_setup.py), and each rank embeds its requests' images (worker/rank_images.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.load_check import load_whole
from ferrox.models.vision import build_vision_tower
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.vit import ACTIVATIONS
from ferrox.multimodal.processing import llava_image_tokens, llava_vision_config

PROJECTOR_ACTIVATIONS = {**ACTIVATIONS, "silu": F.silu, "relu": F.relu}


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        if act not in PROJECTOR_ACTIVATIONS:
            raise UnsupportedModelError(f"config.json: projector_hidden_act {act!r} is not supported "
                                        f"(supported: {', '.join(PROJECTOR_ACTIVATIONS)})")
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias, dtype=dtype, device=device)
        self.act = PROJECTOR_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaLayoutWeights:
    """load_weights of a checkpoint in LLaVA's layout (LLaVA, Mistral 3, Qwen2-Audio): the language model (handed to
    the text model class's loader, next in the MRO), `<tower_name>.*` to the tower's own loader (`vision_tower`, or
    Qwen2-Audio's `audio_tower`), `multi_modal_projector.*` whole; both name layouts (CHECKPOINT_RENAMES, with the
    tower's `model.<tower_name>.` prefix)."""

    tower_name = "vision_tower"
    multi_modal_projector: nn.Module
    spec: ModelSpec
    # What such a model is to the loader and the engine: unquantized (the tower and projector are not
    # quantized), its own tensors kept from the text model's loader, images taken. Any tensor_parallel_size
    # the language model takes: the tower and projector load whole (plain nn layers; the tower's blocks are
    # sharded after loading under --mm-encoder-tp-mode weights: models/vision/encoder_setup.py).
    supports_tensor_parallel = True
    supports_quantized_gguf = False
    supports_quantization = False
    own_weight_prefixes: tuple[str, ...] = ("vision_tower.", "multi_modal_projector.")
    takes_images = True

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tower: list[tuple[str, Any]] = []
        projector: dict[str, torch.Tensor] = {}

        prefix = f"{self.tower_name}."
        renames = (*CHECKPOINT_RENAMES, (f"model.{prefix}", prefix))

        def language_model() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                for old, new in renames:
                    if name.startswith(old):
                        name = new + name[len(old):]
                        break
                if name.startswith(prefix):
                    tower.append((name[len(prefix):], tensor))
                elif name.startswith("multi_modal_projector."):
                    projector[name[len("multi_modal_projector."):]] = materialize(tensor)
                else:
                    yield name, tensor

        super().load_weights(language_model())  # type: ignore[misc]  # (the text model class, next in the MRO)
        getattr(self, self.tower_name).load_weights((name, materialize(t)) for name, t in tower)
        load_whole(self.multi_modal_projector, projector, "multi_modal_projector", self.spec.architecture)


class LlavaForConditionalGeneration(LlavaLayoutWeights, LlamaForCausalLM):

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        mm = spec.hf_config["multimodal"]
        text_type = spec.hf_config.get("model_type")
        if text_type not in ("llama", "mistral", "qwen2"):
            raise UnsupportedModelError(f"config.json: text_config.model_type {text_type!r} of a LLaVA model is not "
                                        "supported (llama, mistral, qwen2)")
        # (Set before the Llama stack is built, which reads it.)
        self.qkv_bias_always = text_type == "qwen2"
        super().__init__(spec, dtype, device, kernels=kernels)
        layer = mm.get("vision_feature_layer", -2)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise UnsupportedModelError(f"config.json: vision_feature_layer {layer!r}: only one layer (an integer) "
                                        "is supported, not a list of layers")
        self.drop_first = mm.get("vision_feature_select_strategy", "default") == "default"
        self.vision_tower = build_vision_tower(llava_vision_config(mm), dtype=dtype, device=vision_device(device),
                                               feature_layer=layer)
        self.multi_modal_projector = LlavaProjector(
            self.vision_tower.hidden_size, spec.hidden_size, str(mm.get("projector_hidden_act", "gelu")),
            bool(mm.get("multimodal_projector_bias", True)), dtype, vision_device(device))
        # What worker/multimodal.py checks a request's images against.
        self.image_tokens = llava_image_tokens(mm)
        size = self.vision_tower.image_size
        self.pixel_shape = (3, size, size)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] pixels -> [B, image_tokens, hidden] rows for the language model."""
        features = self.vision_tower(pixel_values)
        if self.drop_first:
            features = features[:, 1:]
        return self.multi_modal_projector(features)


# Checkpoint prefix -> the name load_weights routes by (first match wins).
CHECKPOINT_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)  # (and the tower's own: LlavaLayoutWeights)
