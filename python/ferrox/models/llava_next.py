"""LLaVA-NeXT (LlavaNextForConditionalGeneration: llava-v1.6-mistral / vicuna, llama3-llava-next): LLaVA's tower
and projector (models/llava.py) over "anyres" images. An image comes as its base tile (the whole image squashed to
the tower's size) and a rows x cols grid of tiles cut from it resized to a grid pinpoint
(multimodal/llava_next_processing.py); as transformers' LlavaNextModel.pack_image_features:

    f = projector(tower(tiles))                         [1 + rows * cols, p * p, hidden] (p: patches a tile side)
    map = f[1:] laid out as [rows * p, cols * p]         tile rows then patch rows, tile columns then patch columns
    map = unpad(map, image H x W)                        the zero padding's feature rows or columns cropped
    image rows = f[0], then each map row followed by image_newline

so an image takes p * p + h * (w + 1) rows for its h x w unpadded map, a number that depends on its size; its item
carries its (H, W) (`grid`), from which the layout is rebuilt. The language model (Llama, Mistral or Qwen2) runs as
it always does over the resulting embeddings.

Checkpoint names: LLaVA's two layouts, plus `image_newline` (`model.image_newline` in transformers 5's). Unquantized;
tensor parallelism as LLaVA's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.llava import LlavaForConditionalGeneration
from ferrox.models.vision.encoder_setup import vision_device
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.llava_next_processing import AnyresLayout, unpadded_grid

_NEWLINE_NAMES = ("image_newline", "model.image_newline")


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(spec, dtype, device, kernels=kernels)
        self.layout = self.anyres_layout(spec.hf_config["multimodal"])
        if self.vision_tower.image_size != self.layout.tile:
            raise UnsupportedModelError(f"config.json: the vision tower's image size {self.vision_tower.image_size} "
                                        f"is not the tile size {self.layout.tile}")
        # A buffer, not a parameter: the language model's loader (which expects every parameter) never sees it.
        self.image_newline: torch.Tensor
        self.register_buffer("image_newline", torch.zeros(spec.hidden_size, dtype=dtype, device=vision_device(device)))
        self._dtype = dtype

    @staticmethod
    def anyres_layout(multimodal: dict[str, Any]) -> AnyresLayout:
        """The images' geometry by config.json (a subclass adds its family's rules)."""
        return AnyresLayout.from_config(multimodal)

    def check_image_item(self, item: MultiModalItem) -> str | None:
        """What is wrong with an image item for this model (worker/multimodal.py check_items), or None."""
        if item.grid is None or len(item.grid) != 2 or min(item.grid) < 1:
            return "no (height, width) image size"
        height, width = item.grid
        rows, cols = self.layout.grid(height, width)
        tokens = self.layout.image_tokens(height, width)
        if item.length != tokens or item.embed_positions is not None:
            return f"{item.length} placeholder tokens for a {width}x{height} image (it takes {tokens})"
        side = self.layout.tile
        want = [1 + rows * cols, self.vision_tower.num_channels, side, side]
        if list(item.shape) != want:
            return f"pixels {list(item.shape)}, a {width}x{height} image takes {want}"
        return None

    def embed_image_item(self, item: MultiModalItem, device: torch.device) -> torch.Tensor:
        """[item.length, hidden]: the base tile's rows, then the unpadded grid map's rows, each ending in
        image_newline."""
        assert item.grid is not None  # check_image_item
        height, width = item.grid
        rows, cols = self.layout.grid(height, width)
        p = self.layout.patches
        features = self.embed_multimodal(item.pixel_values().to(device=device, dtype=self._dtype))
        hidden = features.shape[-1]
        grid = features[1:].view(rows, cols, p, p, hidden).permute(0, 2, 1, 3, 4).reshape(rows * p, cols * p, hidden)
        top, bottom, left, right = unpadded_grid(height, width, rows * p, cols * p)
        grid = grid[top:bottom, left:right]
        size = self.layout.scaled(bottom - top, right - left)
        if size != (bottom - top, right - left):  # OneVision's anyres_max: a large map scaled down
            grid = F.interpolate(grid.permute(2, 0, 1)[None], size=size, mode="bilinear")[0].permute(1, 2, 0)
        newline = self.image_newline.to(grid.dtype).expand(grid.shape[0], 1, hidden)
        return torch.cat([features[0], torch.cat([grid, newline], dim=1).reshape(-1, hidden)])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        newline: list[torch.Tensor] = []

        def others() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name in _NEWLINE_NAMES:
                    newline.append(materialize(tensor))
                else:
                    yield name, tensor

        super().load_weights(others())
        if len(newline) != 1 or tuple(newline[0].shape) != tuple(self.image_newline.shape):
            found = [list(t.shape) for t in newline]
            raise ModelLoadError(f"{self.spec.architecture}: the checkpoint must hold one image_newline of "
                                        f"[{self.image_newline.shape[0]}] (found {found})")
        with torch.no_grad():
            self.image_newline.copy_(newline[0])
