"""Qwen3-VL's vision transformer (transformers' Qwen3VLVisionModel), its maths exactly:

    pixels [patches, C*T*P*P] (multimodal/qwen2_vl_processing.py's layout: merge squares consecutive)
    h = patch_embed(pixels) + pos        a biased Conv3d over the whole patch (one matmul); pos: the learned
                                         side x side table resampled to the image's grid (bilinear, corners
                                         aligned), so any grid gets the table's corners at its corners
    per block:  h = h + proj(attention(norm1(h)))   LayerNorms; 2D rotary as Qwen2-VL's; one frame attends
                h = h + mlp(norm2(h))               within itself; mlp = fc2(gelu_tanh(fc1))
    after block deepstack_visual_indexes[i]: deepstack[i] = deepstack_merger_list[i](h)
    out = merger(h)

A merger turns each merge x merge square of rows into one row: `merger` normalizes each patch row first
(LayerNorm over the width), the DeepStack mergers normalize the concatenated square (postshuffle norm); both
then Linear, GELU (exact), Linear to out_hidden_size. The DeepStack rows are added to the language model's
hidden states at the image's tokens after its first len(deepstack) layers (models/qwen3_vl.py).

Parameter names are the checkpoint's under `model.visual.` / `visual.`, the patch convolution's weight
[E, C, T, P, P] kept as a [E, C*T*P*P] matrix. Built and loaded whole; under tensor parallelism with
--mm-encoder-tp-mode weights the loader then shards its blocks (`tp_blocks`, tower_tp.py; the mergers stay whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.qwen2_vl_vision import (
    Spans,
    VisionAttention,
    _frame_spans,
    _positive_int,
    _with_defaults,
)
from ferrox.models.vision.tower_tp import TowerBlock
from ferrox.models.vision.vit import ACTIVATIONS

# transformers' Qwen3VLVisionConfig defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304, "num_heads": 16,
    "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]}
_ROPE_THETA = 10_000.0  # the vision rope_parameters' default
_EPS = 1e-6  # every LayerNorm of the tower
_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")
_UNUSED_SUFFIXES = ("rotary_pos_emb.inv_freq", "rotary_pos_emb.original_inv_freq")


class PatchEmbed(nn.Module):
    """The biased Conv3d of kernel = stride = one patch, as the matmul it is on flattened patches."""

    def __init__(self, patch_dim: int, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, width, dtype=dtype, device=device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


class VisionMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(width, hidden, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(hidden, width, dtype=dtype, device=device)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(h)))


class VisionBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, mlp: VisionMLP, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device)
        self.attn = VisionAttention(width, num_heads, dtype, device)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, spans: Spans, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), spans, cos, sin)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """postshuffle: normalize the concatenated square (DeepStack's mergers) rather than each patch row."""

    def __init__(self, width: int, merge_unit: int, out: int, *, postshuffle: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.merged = width * merge_unit
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.merged if postshuffle else width, eps=_EPS, dtype=dtype, device=device)
        self.linear_fc1 = nn.Linear(self.merged, self.merged, dtype=dtype, device=device)
        self.linear_fc2 = nn.Linear(self.merged, out, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h.view(-1, self.merged)) if self.postshuffle else self.norm(h).view(-1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(h)))


class Qwen3VisionTower(nn.Module):
    """forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3]) -> (rows [patches / merge^2,
    out_hidden_size], one such tensor per DeepStack layer), the images' rows one after another. Its parameters
    are unset: load_weights next."""

    inv_freq: torch.Tensor  # [head_dim / 4] rotary frequencies, shared by rows and columns

    def __init__(self, vision_config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = _with_defaults(vision_config, CONFIG_DEFAULTS)
        act = ACTIVATIONS.get(str(cfg["hidden_act"]))
        if act is None:
            raise UnsupportedModelError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(ACTIVATIONS)})", param="vision_config.hidden_act")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: the Qwen3-VL "
                                        "vision tower's rotary embedding is axial", param="vision_config")
        width = self.width = _positive_int(cfg, "hidden_size")
        self.num_heads = _positive_int(cfg, "num_heads")
        if width % self.num_heads or (width // self.num_heads) % 4:
            raise UnsupportedModelError(f"vision_config: a width of {width} over {self.num_heads} heads must give a "
                                        "head size that is a multiple of 4 (rows and columns each rotate half of it)",
                                        param="vision_config.num_heads")
        self.out_hidden_size = _positive_int(cfg, "out_hidden_size")
        self.in_channels = _positive_int(cfg, "in_channels")
        self.patch_size = _positive_int(cfg, "patch_size")
        self.temporal_patch_size = _positive_int(cfg, "temporal_patch_size")
        self.spatial_merge_size = _positive_int(cfg, "spatial_merge_size")
        self.merge_unit = self.spatial_merge_size**2
        self.patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size**2
        depth = _positive_int(cfg, "depth")
        positions = _positive_int(cfg, "num_position_embeddings")
        self.side = math.isqrt(positions)
        if self.side**2 != positions:
            raise UnsupportedModelError(f"vision_config.num_position_embeddings {positions} is not a square number "
                                        "(the table is side x side)", param="vision_config.num_position_embeddings")
        self.deepstack_indexes = [int(i) for i in cfg["deepstack_visual_indexes"]]
        if any(not 0 <= i < depth for i in self.deepstack_indexes) or len(set(self.deepstack_indexes)) != len(
                self.deepstack_indexes):
            raise UnsupportedModelError(f"vision_config.deepstack_visual_indexes {self.deepstack_indexes} must be "
                                        f"distinct blocks of the {depth}", param="vision_config.deepstack_visual_indexes")

        self.patch_embed = PatchEmbed(self.patch_dim, width, dtype, device)
        self.pos_embed = nn.Embedding(positions, width, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(
            VisionBlock(width, self.num_heads,
                        VisionMLP(width, _positive_int(cfg, "intermediate_size"), act, dtype, device), dtype, device)
            for _ in range(depth))
        self.merger = PatchMerger(width, self.merge_unit, self.out_hidden_size, postshuffle=False, dtype=dtype,
                                  device=device)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(width, self.merge_unit, self.out_hidden_size, postshuffle=True, dtype=dtype, device=device)
            for _ in self.deepstack_indexes)
        theta = float(rope.get("rope_theta", _ROPE_THETA))
        half = width // self.num_heads // 2  # each axis rotates half the head (as pairs: half / 2 frequencies)
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        grids = self._grids(pixel_values, grid_thw)
        device = pixel_values.device
        h = self.patch_embed(pixel_values)
        h = h + self._positions(grids, device).to(h.dtype)
        cos, sin = self._rotary(grids, device)
        spans = Spans(*_frame_spans(grids), device)
        deepstack: list[torch.Tensor] = []
        for i, block in enumerate(self.blocks):
            h = block(h, spans, cos, sin)
            if i in self.deepstack_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_indexes.index(i)](h))
        return self.merger(h), deepstack

    def _merge_order(self, gh: int, gw: int, device: torch.device) -> torch.Tensor:
        """[gh * gw, 2] (row, col) of each patch in the pixels' order: merge squares row-major, patches
        row-major within one."""
        m = self.spatial_merge_size
        rows = torch.arange(gh, device=device)[:, None].expand(gh, gw)
        cols = torch.arange(gw, device=device)[None, :].expand(gh, gw)
        return torch.stack([rows, cols], dim=-1).reshape(gh // m, m, gw // m, m, 2).transpose(1, 2).reshape(-1, 2)

    def _positions(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """[patches, width] float32: the position table resampled bilinearly to each grid (align_corners: a
        grid's first and last rows and columns sit on the table's), in the pixels' patch order, every frame
        the same."""
        side = self.side
        table = self.pos_embed.weight
        out = []
        for t, gh, gw in grids:
            rc = self._merge_order(gh, gw, device).float()
            sizes = torch.tensor([gh, gw], device=device, dtype=torch.float32)
            src = rc * (side - 1) / (sizes - 1).clamp(min=1)  # [n, 2] coordinates in the table
            low = src.floor()
            frac = src - low  # the weight of the upper neighbour
            lo = low.long().clamp(0, side - 1)
            hi = (lo + 1).clamp(max=side - 1)
            taps = torch.stack([lo[:, 0] * side + lo[:, 1], lo[:, 0] * side + hi[:, 1],
                                hi[:, 0] * side + lo[:, 1], hi[:, 0] * side + hi[:, 1]], dim=1)
            fr, fc = frac[:, 0], frac[:, 1]
            weights = torch.stack([(1 - fr) * (1 - fc), (1 - fr) * fc, fr * (1 - fc), fr * fc], dim=1)
            out.append((table[taps] * weights[:, :, None]).sum(1).float().repeat(t, 1))
        return torch.cat(out)

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] (float32) of each patch's (row, col): [row freqs, col freqs] twice."""
        rc = torch.cat([self._merge_order(gh, gw, device).repeat(t, 1) for t, gh, gw in grids])
        angles = (rc.float()[..., None] * self.inv_freq.to(device)).flatten(1)  # [patches, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _grids(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        grids = [(int(t), int(gh), int(gw)) for t, gh, gw in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
        m = self.spatial_merge_size
        for t, gh, gw in grids:
            if t < 1 or gh < 1 or gw < 1 or gh % m or gw % m:
                raise InvalidArgumentError(f"grid_thw: ({t}, {gh}, {gw}) must be positive with height and width "
                                           f"multiples of the merge size {m}", param="grid_thw")
        patches = sum(t * gh * gw for t, gh, gw in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, self.patch_dim):
            raise InvalidArgumentError(f"pixel_values: expected [{patches}, {self.patch_dim}] (the grids' patches, "
                                       f"C*T*P*P values each), got {list(pixel_values.shape)}", param="pixel_values")
        return grids

    def tp_blocks(self) -> list[TowerBlock]:
        """The blocks --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        return [TowerBlock(block.attn, ("qkv",), "proj", block.mlp, ("linear_fc1",), "linear_fc2")
                for block in self.blocks]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names under `visual.` (the prefix, or transformers 5's `model.visual.`, optional). Every
        parameter must be set; a name the tower does not have is an error (UnsupportedModelError)."""
        def rename(name: str) -> str:
            for prefix in _CHECKPOINT_PREFIXES:
                name = name.removeprefix(prefix)
            return name

        load_tower_tensors(self, weights, "Qwen3-VL vision tower", rename=rename, skip=_UNUSED_SUFFIXES,
                           conv=("patch_embed.proj.weight", (self.width, self.in_channels, self.temporal_patch_size,
                                                             self.patch_size, self.patch_size)))
