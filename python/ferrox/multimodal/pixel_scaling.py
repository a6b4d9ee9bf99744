"""A processor config's pixel scaling: transformers' rescale (do_rescale, rescale_factor) and normalize
(do_normalize, image_mean, image_std), read and checked once for every image and video processor, and applied
the way each transformers path applies them:

- PIL image processors: rescale in float64, then float32; normalize in float32 (`rescale_normalize`);
- torchvision video processors: the rescale folded into the mean and std, one subtract and one divide in
  float32 over [..., C, H, W] (`PixelScaling.apply_torch`).

The two round differently, so each family's processor takes the one its transformers counterpart uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ferrox.multimodal.config_fields import flag, number, per_channel


def rescale_normalize(pixels: np.ndarray, rescale_factor: float | None,
                      mean_std: tuple[Any, Any] | None) -> np.ndarray:
    """transformers' rescale (in float64, then float32) and normalize (in float32) of HWC pixels, as every
    family's processor applies them; None skips a step."""
    if rescale_factor is not None:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    pixels = pixels.astype(np.float32, copy=False)
    if mean_std is not None:
        pixels = (pixels - np.asarray(mean_std[0], np.float32)) / np.asarray(mean_std[1], np.float32)
    return pixels


@dataclass(frozen=True, slots=True)
class PixelScaling:
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]

    @classmethod
    def read(cls, fields: Mapping[str, Any], where: str) -> PixelScaling:
        """From a processor config's fields (`where`: the file, for messages); each must be present."""
        mean = per_channel(fields["image_mean"], "image_mean", where)
        std = per_channel(fields["image_std"], "image_std", where)
        return cls(flag(fields, "do_rescale", where), number(fields["rescale_factor"], "rescale_factor", where),
                   flag(fields, "do_normalize", where), (mean[0], mean[1], mean[2]), (std[0], std[1], std[2]))

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """HWC pixels as transformers' PIL image processors scale them (module docstring)."""
        return rescale_normalize(pixels, self.rescale_factor if self.do_rescale else None,
                                 (self.image_mean, self.image_std) if self.do_normalize else None)

    def apply_torch(self, values: Any) -> Any:
        """float32 [..., C, H, W] frames as transformers' torchvision video processors scale them (module
        docstring); in place where it can."""
        import torch

        if self.do_normalize:
            scale = 1.0 / self.rescale_factor if self.do_rescale else 1.0
            mean = torch.tensor(self.image_mean) * scale
            std = torch.tensor(self.image_std) * scale
            return values.sub_(mean[:, None, None]).div_(std[:, None, None])
        if self.do_rescale:
            return values * self.rescale_factor
        return values
