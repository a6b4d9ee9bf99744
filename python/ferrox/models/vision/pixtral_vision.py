"""Pixtral's vision encoder (transformers' PixtralVisionModel: Mistral Small 3.1 / 3.2's tower, Pixtral-12B's),
its maths exactly:

    pixels [C, H, W] per image, H and W whole patches (multimodal/pixtral_processing.py)
    h = patch_conv(pixels)          a Conv2d whose kernel is the patch (one matmul), no bias; the image's
                                    patches row-major: [h * w, hidden]
    h = ln_pre(h)                   RMSNorm, eps 1e-5
    rotary: patch (row, col) -> angles over the head dim laid out [row freqs, col freqs] twice, where
            the row takes the even and the column the odd frequencies of theta^(-2i / head_dim)
    per layer:  h = h + o_proj(attention(attention_norm(h)))     bidirectional within one image
                h = h + down(act(gate(ffn_norm(h))) * up(ffn_norm(h)))

An image is a variable number of patches. The output is hidden_states[feature_layer] as transformers
counts them (0: ln_pre's output; -1 or num_hidden_layers: the last layer's), each image's rows in
order; only the layers it needs run. Parameter names are the checkpoint's (under `vision_tower.`), except
that the convolution's weight [E, C, P, P] is kept as a [E, C*P*P] matrix. Built and loaded whole; under tensor
parallelism with --mm-encoder-tp-mode weights the loader then shards its layers (`tp_blocks`, tower_tp.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.tower_tp import TowerBlock
from ferrox.models.vision.vit import ACTIVATIONS

# transformers' PixtralVisionConfig defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                   "num_attention_heads": 16, "num_channels": 3, "patch_size": 16,
                                   "hidden_act": "gelu", "rope_theta": 10_000.0}
_EPS = 1e-5  # ln_pre and every layer's norms
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {**ACTIVATIONS, "silu": F.silu}
_UNUSED_SUFFIXES = ("patch_positional_embedding.inv_freq",)  # a buffer some exports saved


class RMSNorm(nn.Module):
    """PixtralRMSNorm (Mistral3RMSNorm too): normalized in float32, cast back, then scaled."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class PixtralAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = nn.Linear(width, width, bias=False, dtype=dtype, device=device)
        self.k_proj = nn.Linear(width, width, bias=False, dtype=dtype, device=device)
        self.v_proj = nn.Linear(width, width, bias=False, dtype=dtype, device=device)
        self.o_proj = nn.Linear(width, width, bias=False, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, spans: Sequence[tuple[int, int]], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        q = _rotate(self.q_proj(h).view(n, self.num_heads, -1), cos, sin)
        k = _rotate(self.k_proj(h).view(n, self.num_heads, -1), cos, sin)
        v = self.v_proj(h).view(n, self.num_heads, -1)
        out = torch.empty_like(q)
        for start, stop in spans:  # each image attends within itself
            o = F.scaled_dot_product_attention(q[start:stop].transpose(0, 1), k[start:stop].transpose(0, 1),
                                               v[start:stop].transpose(0, 1))
            out[start:stop] = o.transpose(0, 1)
        return self.o_proj(out.reshape(n, -1))


class PixtralMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(width, hidden, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class PixtralLayer(nn.Module):
    def __init__(self, width: int, num_heads: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(width, _EPS, dtype, device)
        self.attention = PixtralAttention(width, num_heads, dtype, device)
        self.ffn_norm = RMSNorm(width, _EPS, dtype, device)
        self.feed_forward = PixtralMLP(width, hidden, act, dtype, device)

    def forward(self, h: torch.Tensor, spans: Sequence[tuple[int, int]], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), spans, cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class PixtralTransformer(nn.Module):
    def __init__(self, layers: list[PixtralLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class PixtralVisionTower(nn.Module):
    """forward(images: [C, H, W] tensors) -> [patches of all images, hidden_size]: hidden_states[feature_layer],
    the images' rows one after another (row-major patches). Its parameters are unset: load_weights next."""

    inv_freq: torch.Tensor  # [head_dim / 2]: the row's frequencies, then the column's

    def __init__(self, vision_config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str,
                 feature_layer: int = -1) -> None:
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **{k: v for k, v in vision_config.items() if v is not None}}
        act = _ACTIVATIONS.get(str(cfg["hidden_act"]))
        if act is None:
            raise UnsupportedModelError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(_ACTIVATIONS)})", param="vision_config.hidden_act")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise UnsupportedModelError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: Pixtral's "
                                        "rotary embedding is axial", param="vision_config")
        self.hidden_size = _positive_int(cfg, "hidden_size")
        self.num_heads = _positive_int(cfg, "num_attention_heads")
        head_dim = self.hidden_size // self.num_heads
        if self.hidden_size % self.num_heads or head_dim % 4:
            raise UnsupportedModelError(f"vision_config: hidden_size {self.hidden_size} over {self.num_heads} heads "
                                        "must give a head size that is a multiple of 4", param="vision_config")
        if cfg.get("head_dim") not in (None, head_dim):
            raise UnsupportedModelError(f"vision_config.head_dim {cfg['head_dim']} differs from hidden_size / "
                                        f"num_attention_heads = {head_dim} (transformers uses the latter)",
                                        param="vision_config.head_dim")
        self.num_channels = _positive_int(cfg, "num_channels")
        self.patch_size = _positive_int(cfg, "patch_size")
        depth = _positive_int(cfg, "num_hidden_layers")
        if isinstance(feature_layer, bool) or not isinstance(feature_layer, int) or not (
                -depth - 1 <= feature_layer <= depth):
            raise UnsupportedModelError(f"vision_feature_layer {feature_layer!r}: one layer index of the tower's "
                                        f"{depth + 1} hidden states is supported", param="vision_feature_layer")
        self.num_layers_run = feature_layer % (depth + 1)
        self.patch_conv = nn.Linear(self.num_channels * self.patch_size**2, self.hidden_size, bias=False,
                                    dtype=dtype, device=device)
        self.ln_pre = RMSNorm(self.hidden_size, _EPS, dtype, device)
        hidden = _positive_int(cfg, "intermediate_size")
        # Every layer is built (and loaded) so that a checkpoint's names all match; the ones past the feature
        # layer never run.
        self.transformer = PixtralTransformer([PixtralLayer(self.hidden_size, self.num_heads, hidden, act, dtype,
                                                            device) for _ in range(depth)])
        theta = float(rope.get("rope_theta", cfg["rope_theta"]))
        freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", torch.cat([freqs[0::2], freqs[1::2]]).to(device), persistent=False)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        return height // self.patch_size, width // self.patch_size

    def forward(self, images: Sequence[torch.Tensor]) -> torch.Tensor:
        p = self.patch_size
        patches: list[torch.Tensor] = []
        positions: list[torch.Tensor] = []
        spans: list[tuple[int, int]] = []
        at = 0
        for k, image in enumerate(images):
            if image.dim() != 3 or image.shape[0] != self.num_channels or image.shape[1] % p or image.shape[2] % p \
                    or min(image.shape[1:]) < p:
                raise InvalidArgumentError(f"image {k}: pixels {list(image.shape)}, the tower takes "
                                           f"[{self.num_channels}, H, W] with H and W multiples of {p}",
                                           param="pixel_values")
            rows, cols = self.grid(int(image.shape[1]), int(image.shape[2]))
            x = image.reshape(self.num_channels, rows, p, cols, p).permute(1, 3, 0, 2, 4)
            patches.append(x.reshape(rows * cols, -1))
            r = torch.arange(rows, device=image.device)[:, None].expand(rows, cols)
            c = torch.arange(cols, device=image.device)[None, :].expand(rows, cols)
            positions.append(torch.stack([r, c], dim=-1).reshape(-1, 2))
            spans.append((at, at + rows * cols))
            at += rows * cols
        h = self.ln_pre(self.patch_conv(torch.cat(patches).to(self.patch_conv.weight.dtype)))
        cos, sin = self._rotary(torch.cat(positions))
        for layer in self.transformer.layers[:self.num_layers_run]:
            h = layer(h, spans, cos, sin)
        return h

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] (float32): the row turns the first quarter of each half, the column
        the second."""
        quarter = self.inv_freq.shape[0] // 2
        inv = self.inv_freq.to(positions.device)
        angles = torch.cat([positions[:, :1].float() * inv[:quarter], positions[:, 1:].float() * inv[quarter:]], -1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def tp_blocks(self) -> list[TowerBlock]:
        """The layers --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        return [TowerBlock(layer.attention, ("q_proj", "k_proj", "v_proj"), "o_proj", layer.feed_forward,
                           ("gate_proj", "up_proj"), "down_proj") for layer in self.transformer.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names under `vision_tower.` (the caller strips it). Every parameter must be set; a name
        the tower does not have is an error (UnsupportedModelError, a ValueError)."""
        load_tower_tensors(self, weights, "Pixtral vision tower", skip=_UNUSED_SUFFIXES, conv=(
            "patch_conv.weight", (self.hidden_size, self.num_channels, self.patch_size, self.patch_size)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated (rotate-half pairs); cos/sin cast to x's dtype first, as transformers
    does."""
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != math.floor(value) or value < 1:
        raise UnsupportedModelError(f"vision_config.{key} must be a positive integer, got {value!r}",
                                    param=f"vision_config.{key}")
    return int(value)
