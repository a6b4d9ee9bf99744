"""Qwen2-VL's and Qwen2.5-VL's vision transformer (transformers' Qwen2VisionTransformerPretrainedModel and
Qwen2_5_VisionTransformerPretrainedModel), their maths exactly:

    pixels [patches, C*T*P*P] (multimodal/qwen2_vl_processing.py: each merge x merge square of patches
    consecutive, squares in row-major order) -> h = patch_embed(pixels)   a Conv3d whose kernel is the
                                                                          whole patch: one matmul
    rotary: patch (row, col) -> cos/sin over the head dim laid out [row freqs, col freqs] twice
    per block:  h = h + proj(attention(norm1(h)))   bidirectional within one image (one frame), or within
                                                    one window (2.5, except fullatt_block_indexes)
                h = h + mlp(norm2(h))
    out = merger(h): ln_q, then each merge x merge square's rows concatenated -> Linear, GELU, Linear

    Qwen2-VL:    LayerNorm, fc2(quick_gelu(fc1(x))), width embed_dim, out hidden_size
    Qwen2.5-VL:  RMSNorm, down(act(gate(x)) * up(x)) (with biases), width hidden_size, out out_hidden_size,
                 window attention: windows of window_size pixels (window_size / patch / merge merged
                 squares a side, smaller at the right and bottom edges), the tokens reordered window by
                 window before the blocks and the merged rows put back in image order after the merger.

A window never straddles two images (nor two frames) and a square never straddles two windows, so the
reordering moves whole squares and keeps each image's tokens contiguous: full-attention blocks use the
images' own spans in either order. Attention runs per span with F.scaled_dot_product_attention, spans of
one length batched together (a 2.5 image's inner windows all have the same length).

Parameter names are the checkpoint's under `visual.`, except that the patch convolution's weight
[E, C, T, P, P] is kept as a [E, C*T*P*P] matrix. Built and loaded whole; under tensor parallelism with
--mm-encoder-tp-mode weights the loader then shards its blocks (`tp_blocks`, tower_tp.py; the merger stays whole).
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
from ferrox.models.vision.tower_tp import TowerBlock
from ferrox.models.vision.vit import ACTIVATIONS

# transformers' Qwen2VLVisionConfig / Qwen2_5_VLVisionConfig defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_vl": {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4,
                 "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                 "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31]},
}
# Names some configs use instead (hub configs of both families write `in_chans`; transformers' attribute_map).
_ALIASES = {"in_channels": "in_chans", "num_heads": "num_attention_heads", "depth": "num_hidden_layers"}
_ROPE_THETA = 10_000.0  # the vision rope_parameters' default
_EPS = 1e-6  # every norm of both towers
_CHECKPOINT_PREFIXES = ("model.visual.", "visual.")  # transformers 5's module names, the saved files'
_UNUSED_SUFFIXES = ("rotary_pos_emb.inv_freq",)  # a buffer some exports saved
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {**ACTIVATIONS, "silu": F.silu}


class RMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm: normalized in float32, cast back, then scaled (in the weight's dtype)."""

    def __init__(self, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _EPS)
        return self.weight * h.to(x.dtype)


class PatchEmbed(nn.Module):
    """The Conv3d of kernel = stride = one patch, as the matmul it is on flattened patches."""

    def __init__(self, patch_dim: int, width: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.proj = nn.Linear(patch_dim, width, bias=False, dtype=dtype, device=device)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


class Spans:
    """Attention spans [start, start + length) of the token sequence, grouped by length: `index[k]` holds
    the token indices [spans of length k, k] (one batched attention call each)."""

    def __init__(self, starts: list[int], lengths: list[int], device: torch.device) -> None:
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts, lengths, strict=True):
            if length:
                by_length.setdefault(length, []).append(start)
        self.index = [torch.tensor(s, device=device)[:, None] + torch.arange(n, device=device)
                      for n, s in by_length.items()]


class VisionAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(width, 3 * width, dtype=dtype, device=device)
        self.proj = nn.Linear(width, width, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor, spans: Spans, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = h.shape[0]
        q, k, v = self.qkv(h).view(n, 3, self.num_heads, -1).unbind(1)  # [n, heads, head_dim] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for index in spans.index:  # [spans, length]
            o = F.scaled_dot_product_attention(q[index].transpose(1, 2), k[index].transpose(1, 2),
                                               v[index].transpose(1, 2))
            out[index] = o.transpose(1, 2)
        return self.proj(out.reshape(n, -1))


class QuickGeluMLP(nn.Module):
    """Qwen2-VL's VisionMlp."""

    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden, dtype=dtype, device=device)
        self.fc2 = nn.Linear(hidden, width, dtype=dtype, device=device)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's vision MLP (biased projections)."""

    def __init__(self, width: int, hidden: int, act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, dtype=dtype, device=device)
        self.up_proj = nn.Linear(width, hidden, dtype=dtype, device=device)
        self.down_proj = nn.Linear(hidden, width, dtype=dtype, device=device)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class VisionBlock(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module], attn: VisionAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm()
        self.norm2 = norm()
        self.attn = attn
        self.mlp = mlp

    def forward(self, h: torch.Tensor, spans: Spans, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), spans, cos, sin)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    def __init__(self, norm: nn.Module, width: int, merge_unit: int, out: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.ln_q = norm
        self.merged = width * merge_unit
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged, dtype=dtype, device=device), nn.GELU(),
                                 nn.Linear(self.merged, out, dtype=dtype, device=device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(h).view(-1, self.merged))


class QwenVisionTower(nn.Module):
    """forward(pixel_values [patches, C*T*P*P], grid_thw [images, 3]) -> [patches / merge^2, out_hidden_size],
    the images' rows one after another. version: "qwen2_vl" or "qwen2_5_vl". Its parameters are unset:
    load_weights next."""

    inv_freq: torch.Tensor  # [head_dim / 4] rotary frequencies, shared by rows and columns

    def __init__(self, vision_config: Mapping[str, Any], *, version: str, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        if version not in CONFIG_DEFAULTS:
            raise UnsupportedModelError(f"Qwen vision tower version {version!r} is not one of "
                                        f"{', '.join(CONFIG_DEFAULTS)}")
        self.version = version
        cfg = _with_defaults(vision_config, CONFIG_DEFAULTS[version])
        act = _ACTIVATIONS.get(str(cfg["hidden_act"]))
        if act is None:
            raise UnsupportedModelError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(_ACTIVATIONS)})", param="vision_config.hidden_act")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: the Qwen "
                                        "vision tower's rotary embedding is axial", param="vision_config")
        qwen2 = version == "qwen2_vl"
        width = _positive_int(cfg, "embed_dim" if qwen2 else "hidden_size")
        self.out_hidden_size = _positive_int(cfg, "hidden_size" if qwen2 else "out_hidden_size")
        self.num_heads = _positive_int(cfg, "num_heads")
        if width % self.num_heads or (width // self.num_heads) % 4:
            raise UnsupportedModelError(f"vision_config: a width of {width} over {self.num_heads} heads must give a "
                                        "head size that is a multiple of 4 (rows and columns each rotate half of it)",
                                        param="vision_config.num_heads")
        self.width = width
        self.in_channels = _positive_int(cfg, "in_channels")
        self.patch_size = _positive_int(cfg, "patch_size")
        self.temporal_patch_size = _positive_int(cfg, "temporal_patch_size")
        self.spatial_merge_size = _positive_int(cfg, "spatial_merge_size")
        self.merge_unit = self.spatial_merge_size**2
        self.patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size**2
        depth = _positive_int(cfg, "depth")
        if qwen2:
            self.window = 0  # merged squares a window side; 0: no window attention
            self.full_attention_blocks = frozenset(range(depth))
        else:
            self.window = int(cfg["window_size"]) // self.spatial_merge_size // self.patch_size
            if self.window < 1:
                raise UnsupportedModelError(f"vision_config.window_size {cfg['window_size']} is smaller than one "
                                            "merged square of patches", param="vision_config.window_size")
            self.full_attention_blocks = frozenset(int(i) for i in cfg["fullatt_block_indexes"])

        def norm() -> nn.Module:
            return nn.LayerNorm(width, eps=_EPS, dtype=dtype, device=device) if qwen2 else RMSNorm(width, dtype, device)

        def mlp() -> nn.Module:
            if qwen2:
                return QuickGeluMLP(width, int(width * cfg["mlp_ratio"]), act, dtype, device)
            return GatedMLP(width, _positive_int(cfg, "intermediate_size"), act, dtype, device)

        self.patch_embed = PatchEmbed(self.patch_dim, width, dtype, device)
        self.blocks = nn.ModuleList(VisionBlock(norm, VisionAttention(width, self.num_heads, dtype, device), mlp())
                                    for _ in range(depth))
        self.merger = PatchMerger(norm(), width, self.merge_unit, self.out_hidden_size, dtype, device)
        theta = float(rope.get("rope_theta", _ROPE_THETA))
        half = width // self.num_heads // 2  # each axis rotates half the head (as pairs: half / 2 frequencies)
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = self._grids(pixel_values, grid_thw)
        device = pixel_values.device
        h = self.patch_embed(pixel_values)
        cos, sin = self._rotary(grids, device)
        frames = _frame_spans(grids)
        full = Spans(*frames, device)
        windowed = full
        order: torch.Tensor | None = None
        if self.window:
            squares, starts, lengths = self._window_order(grids)
            windowed = Spans(starts, lengths, device)
            order = torch.tensor(squares, device=device)
            h, cos, sin = (self._by_square(x, order) for x in (h, cos, sin))
        for i, block in enumerate(self.blocks):
            h = block(h, full if i in self.full_attention_blocks else windowed, cos, sin)
        out = self.merger(h)
        if order is not None:
            out = out[torch.argsort(order)]
        return out

    def _grids(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        grids = [tuple(int(x) for x in row) for row in torch.as_tensor(grid_thw).reshape(-1, 3).tolist()]
        m = self.spatial_merge_size
        for t, gh, gw in grids:
            if t < 1 or gh < 1 or gw < 1 or gh % m or gw % m:
                raise InvalidArgumentError(f"grid_thw: ({t}, {gh}, {gw}) must be positive with height and width "
                                           f"multiples of the merge size {m}", param="grid_thw")
        patches = sum(t * gh * gw for t, gh, gw in grids)
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (patches, self.patch_dim):
            raise InvalidArgumentError(f"pixel_values: expected [{patches}, {self.patch_dim}] (the grids' patches, "
                                       f"C*T*P*P values each), got {list(pixel_values.shape)}", param="pixel_values")
        return [(t, gh, gw) for t, gh, gw in grids]

    def _rotary(self, grids: list[tuple[int, int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [patches, head_dim] (float32) of each patch's (row, col), patches in merge-square order."""
        m = self.spatial_merge_size
        positions = []
        for t, gh, gw in grids:
            rows = torch.arange(gh, device=device)[:, None].expand(gh, gw)
            cols = torch.arange(gw, device=device)[None, :].expand(gh, gw)
            rc = torch.stack([rows, cols], dim=-1).reshape(gh // m, m, gw // m, m, 2).transpose(1, 2).reshape(-1, 2)
            positions.append(rc.repeat(t, 1))
        freqs = torch.cat(positions).float()[..., None] * self.inv_freq.to(device)  # [patches, 2, head_dim / 4]
        angles = freqs.flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _window_order(self, grids: list[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
        """(merged squares in window order, each window's start and length in tokens): windows row-major over
        each frame of each image, squares row-major within a window."""
        order: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        base = 0
        w = self.window
        for t, gh, gw in grids:
            sh, sw = gh // self.spatial_merge_size, gw // self.spatial_merge_size
            for frame in range(t):
                for r0 in range(0, sh, w):
                    for c0 in range(0, sw, w):
                        starts.append(len(order) * self.merge_unit)
                        order.extend(base + frame * sh * sw + r * sw + c
                                     for r in range(r0, min(r0 + w, sh)) for c in range(c0, min(c0 + w, sw)))
                        lengths.append(len(order) * self.merge_unit - starts[-1])
            base += t * sh * sw
        return order, starts, lengths

    def _by_square(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        return x.view(-1, self.merge_unit, x.shape[-1])[order].reshape(x.shape)

    def tp_blocks(self) -> list[TowerBlock]:
        """The blocks --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        qwen2 = self.version == "qwen2_vl"
        return [TowerBlock(block.attn, ("qkv",), "proj", block.mlp, ("fc1",) if qwen2 else ("gate_proj", "up_proj"),
                           "fc2" if qwen2 else "down_proj") for block in self.blocks]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names under `visual.` (the prefix, or transformers 5's `model.visual.`, optional).
        Every parameter must be set; a name the tower does not have is an error (UnsupportedModelError,
        a ValueError)."""
        def rename(name: str) -> str:
            for prefix in _CHECKPOINT_PREFIXES:
                name = name.removeprefix(prefix)
            return name

        load_tower_tensors(self, weights, f"{self.version} vision tower", rename=rename, skip=_UNUSED_SUFFIXES,
                           conv=("patch_embed.proj.weight", (self.width, self.in_channels, self.temporal_patch_size,
                                                             self.patch_size, self.patch_size)))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim] rotated in float32 (rotate-half pairs), back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos[:, None] + torch.cat([-x2, x1], dim=-1) * sin[:, None]).to(x.dtype)


def _frame_spans(grids: list[tuple[int, int, int]]) -> tuple[list[int], list[int]]:
    """(starts, lengths): each frame of each image attends within itself."""
    starts: list[int] = []
    lengths: list[int] = []
    at = 0
    for t, gh, gw in grids:
        for _ in range(t):
            starts.append(at)
            lengths.append(gh * gw)
            at += gh * gw
    return starts, lengths


def _with_defaults(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(config)
    for key, alias in _ALIASES.items():
        if cfg.get(key) is None and cfg.get(alias) is not None:
            cfg[key] = cfg[alias]
    return {**defaults, **{k: v for k, v in cfg.items() if v is not None}}


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != math.floor(value) or value < 1:
        raise UnsupportedModelError(f"vision_config.{key} must be a positive integer, got {value!r}",
                                    param=f"vision_config.{key}")
    return int(value)
