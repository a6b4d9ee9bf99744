"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): a Qwen2
language model that rotates by multimodal positions (layers/rotary.py MRotaryEmbedding, the positions from
worker/mrope.py), and a vision transformer over an image's native-resolution patch grid whose merger gives
one row per 2x2 patches (models/vision/qwen2_vl_vision.py). An image is a variable number of tokens: its
`<|image_pad|>` becomes (t * h * w) / merge^2 of them (multimodal/qwen2_vl_processing.py), and its item
carries the (t, h, w) grid the tower and the positions need. A video is the same: its `<|video_pad|>` run takes
the tower's rows over its frames' patches (grid t > 1), and its positions space frames by second_per_grid_ts.

Checkpoint names: `model.layers.*`, `visual.*`, `lm_head.weight`, as the hub's files have them (transformers 5
saves that layout too; its in-memory `model.language_model.*` / `model.visual.*` names load as well). Whether the LM head is tied is the top-level config's
tie_word_embeddings (Qwen2-VL-2B ties). Unquantized. Under tensor parallelism the
Qwen2 is sharded; the tower loads whole on every rank, its blocks then sharded under --mm-encoder-tp-mode weights
(models/vision/encoder_setup.py; worker/rank_images.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelSpec
from ferrox.models.qwen import Qwen2ForCausalLM
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.multimodal.inputs import MultiModalItem

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    supports_tensor_parallel = True  # the tower loads whole (its blocks sharded after: encoder_setup.py)
    supports_quantized_gguf = False
    supports_quantization = False
    own_weight_prefixes = ("visual.",)
    takes_images = True
    takes_videos = True  # a video's patches go through the same tower (its grid has t > 1)
    vision_version = "qwen2_vl"

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        from ferrox.models.vision.qwen2_vl_vision import QwenVisionTower

        mm = spec.hf_config["multimodal"]
        if "tie_word_embeddings" in mm:
            spec = dataclasses.replace(spec, tie_word_embeddings=bool(mm["tie_word_embeddings"]))
        super().__init__(spec, dtype, device, kernels=kernels)
        self.visual = QwenVisionTower(mm.get("vision_config") or {}, version=self.vision_version, dtype=dtype,
                                      device=vision_device(device))
        # worker/mrope.py: requests with images rotate by positions that merge this many patches a side.
        self.mrope_merge_size = int(self.visual.spatial_merge_size)
        self.patch_values = int(mm.get("vision_config", {}).get("in_channels", mm.get("vision_config", {}).get(
            "in_chans", 3))) * int(self.visual.temporal_patch_size) * int(self.visual.patch_size) ** 2
        self._dtype = dtype
        # worker/mrope.py: Qwen2.5-VL spaces a video's temporal positions by seconds x this (Qwen2-VL: by 1).
        self.mrope_tokens_per_second = (float(mm.get("vision_config", {}).get("tokens_per_second", 4))
                                        if self.vision_version == "qwen2_5_vl" else None)

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image (or video) item for this model (worker/multimodal.py check_items), or None."""
        if item.grid is None or len(item.grid) != 3 or min(item.grid) < 1:
            return "no (t, h, w) patch grid"
        t, h, w = item.grid
        m = self.mrope_merge_size
        if h % m or w % m:
            return f"grid {item.grid}: h and w must be multiples of the merge size {m}"
        if item.length != t * h * w // (m * m):
            return f"{item.length} placeholder tokens for a {item.grid} grid (it takes {t * h * w // (m * m)})"
        if list(item.shape) != [t * h * w, self.patch_values]:
            return f"pixels {list(item.shape)}, the grid {item.grid} takes {[t * h * w, self.patch_values]}"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: the tower and merger over the image's patches."""
        assert item.grid is not None  # check_image_item
        pixels = item.pixel_values().to(device=device, dtype=self._dtype)
        grid = torch.tensor([item.grid], dtype=torch.int64, device=device)
        return self.visual(pixels, grid)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        load_with_visual(weights, super().load_weights, self.visual)


def load_with_visual(weights: Iterable[tuple[str, Any]], load_language_model: Callable[[Iterable[Any]], None],
                     visual: Any) -> None:
    """A Qwen-VL checkpoint (Qwen2-VL, 2.5-VL, 3-VL): the language model's tensors, renamed to the text class's
    names, to load_language_model as they stream; `visual.*` whole to the tower after them."""
    tower: list[tuple[str, Any]] = []

    def language_model() -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old):]
                    break
            if name.startswith("visual."):
                tower.append((name[len("visual."):], tensor))
            else:
                yield name, tensor

    load_language_model(language_model())
    visual.load_weights((name, materialize(t)) for name, t in tower)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (transformers' name)
    """Qwen2.5-VL: the same language side; its tower has RMSNorms, a SwiGLU MLP and windowed attention."""

    vision_version = "qwen2_5_vl"
