"""InternVL (InternVLForConditionalGeneration: the hub's InternVL3 / InternVL3.5 "-hf" checkpoints): the InternViT
tower over each image tile (vision/intern_vit.py), a pixel shuffle, a projector, and a Qwen2, Qwen3 or Llama
language model that reads the projected rows in place of the prompt's `<IMG_CONTEXT>` tokens, causal
attention throughout.

As transformers' InternVLModel.get_image_features, per tile:

    features = tower(tile)[vision_feature_layer] without its class token    [side^2, C]
    pixel shuffle by s = 1 / downsample_ratio                                [(side/s)^2, s^2 C]
        each s x s block of neighbouring patches becomes one row, its features ordered (row in block,
        column in block, channel); blocks in row-major order
    rows = linear_2(act(linear_1(layer_norm(x))))                            multi_modal_projector

An image is its tiles (multimodal/internvl_processing.py), one MultiModalItem whose run holds every tile's rows
in order, so the tower runs over all the image's tiles at once.

Checkpoint names: LLaVA's two layouts (models/llava.py): `model.vision_tower.*`, `model.multi_modal_projector.*`,
`model.language_model.*`, `lm_head.weight` (absent when tied), or the `vision_tower.*`, `multi_modal_projector.*`,
`language_model.model.*`, `language_model.lm_head.*` that transformers 5 saves. Whether the LM head is tied is the top-level config's
tie_word_embeddings (default true, as InternVLConfig's: transformers ties by it, not by text_config's). Unquantized;
tensor parallelism as LLaVA's.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.llama import LlamaForCausalLM
from ferrox.models.llava import PROJECTOR_ACTIVATIONS, LlavaLayoutWeights
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.models.vision.intern_vit import InternVisionTower
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.internvl_processing import internvl_tokens_per_tile, shuffle_scale

# text_config.model_type -> (q/k/v bias always, per-head q/k RMSNorm): the Llama stack's two switches (qwen.py).
TEXT_MODELS = {"qwen2": (True, False), "qwen3": (False, True), "llama": (False, False)}


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """[B, side^2, C] row-major patches -> [B, (side/s)^2, s^2 C] (transformers' InternVLModel.pixel_shuffle)."""
    b, seq, c = x.shape
    side = int(seq ** 0.5)
    x = x.view(b, side // s, s, side // s, s, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (side // s) ** 2, s * s * c)


class InternVLProjector(nn.Module):
    def __init__(self, in_features: int, text_hidden: int, act: str, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        if act not in PROJECTOR_ACTIVATIONS:
            raise UnsupportedModelError(f"config.json: projector_hidden_act {act!r} is not supported "
                                        f"(supported: {', '.join(PROJECTOR_ACTIVATIONS)})")
        self.layer_norm = nn.LayerNorm(in_features, dtype=dtype, device=device)  # torch's default eps, as theirs
        self.linear_1 = nn.Linear(in_features, text_hidden, dtype=dtype, device=device)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, dtype=dtype, device=device)
        self.act = PROJECTOR_ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(self.layer_norm(x))))


class InternVLForConditionalGeneration(LlavaLayoutWeights, LlamaForCausalLM):
    """LLaVA's checkpoint layout and load_weights (models/llava.py): unquantized, images taken, the
    language model sharded under tensor parallelism, the tower as --mm-encoder-tp-mode says."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        mm = spec.hf_config["multimodal"]
        text_type = spec.hf_config.get("model_type")
        if text_type not in TEXT_MODELS:
            raise UnsupportedModelError(f"config.json: text_config.model_type {text_type!r} of an InternVL model is not "
                                        f"supported ({', '.join(TEXT_MODELS)})")
        layer = mm.get("vision_feature_layer", -1)
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise UnsupportedModelError(f"config.json: vision_feature_layer {layer!r}: only one layer (an integer) "
                                        "is supported, not a list of layers")
        strategy = mm.get("vision_feature_select_strategy", "default")
        if strategy != "default":  # "full" keeps the class token, which leaves no square grid to shuffle
            raise UnsupportedModelError(f"config.json: vision_feature_select_strategy {strategy!r} is not supported "
                                        "(default)")
        # (Set before the Llama stack is built, which reads them.)
        self.qkv_bias_always, self.qk_norm = TEXT_MODELS[text_type]
        spec = dataclasses.replace(spec, tie_word_embeddings=bool(mm.get("tie_word_embeddings", True)))
        super().__init__(spec, dtype, device, kernels=kernels)
        self._dtype = dtype
        self.vision_tower = InternVisionTower(mm.get("vision_config") or {}, dtype=dtype, device=vision_device(device),
                                              feature_layer=layer)
        self.scale = shuffle_scale(mm)
        self.image_tokens = internvl_tokens_per_tile(mm)  # rows a tile gives
        self.multi_modal_projector = InternVLProjector(self.vision_tower.hidden_size * self.scale ** 2,
                                                       spec.hidden_size, str(mm.get("projector_hidden_act", "gelu")),
                                                       dtype, vision_device(device))
        size = self.vision_tower.image_size
        self.pixel_shape = (3, size, size)  # one tile's

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[tiles, 3, S, S] -> [tiles, image_tokens, hidden] rows for the language model."""
        features = self.vision_tower(pixel_values)[:, 1:]  # the class token dropped
        return self.multi_modal_projector(pixel_shuffle(features, self.scale))

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image item for this model (worker/multimodal.py check_items), or None."""
        if len(item.shape) != 4 or item.shape[0] < 1 or tuple(item.shape[1:]) != self.pixel_shape:
            return f"pixels {list(item.shape)}, the model takes [tiles, {', '.join(map(str, self.pixel_shape))}]"
        if item.length != item.shape[0] * self.image_tokens:
            return (f"{item.length} placeholder tokens for {item.shape[0]} tiles (they take "
                    f"{item.shape[0] * self.image_tokens})")
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: every tile of the image, in order."""
        rows = self.embed_multimodal(item.pixel_values().to(device=device, dtype=self._dtype))
        return rows.reshape(-1, rows.shape[-1])
