"""Gemma 4's vision tower and its embedder into the language model (transformers' Gemma4VisionModel and
Gemma4MultimodalEmbedder), their maths exactly, one image at a time:

    patches [rows * cols, P*P*3] in [0, 1] (multimodal/gemma4_processing.py), patch n at (col, row) =
    (n % cols, n // cols):
    h = input_proj(2 * patches - 1) + table[0][col] + table[1][row]      a learned position per axis
    rotary: each head's first half turns by the patch's column, its second half by its row (rotate-half pairs
            within each half, frequencies theta^(-4i / head_dim)); scores unscaled (the q/k norms set their size)
    per layer (Gemma's four norms, each x * w in float32):
        h = h + post_attention_layernorm(o_proj(attention(input_layernorm(h))))   bidirectional over the image
        h = h + post_feedforward_layernorm(down(gelu_tanh(gate(x)) * up(x)))  x = pre_feedforward_layernorm(h)
    q and k RMS-normed per head (with weights) before the rotary, v per head without one
    pooled: each k x k square of patches averaged (k = pooling_kernel_size), squares row-major, then
            * sqrt(hidden) and, with `standardize`, (x - std_bias) * std_scale, in float32
    embedder: a weightless RMSNorm, then embedding_projection into the text width

transformers pads every image's patches to the processor's budget and masks the padding out; the real patches
alone give the same rows. With use_clipped_linears each projection clamps its input and output to the bounds
the checkpoint stores beside it. Parameter names are the checkpoint's under `model.vision_tower.`, except that a
projection's `.linear.weight` is its `.weight` and its bounds sit in `<name>_bounds`. Built and loaded whole;
under tensor parallelism with --mm-encoder-tp-mode weights the loader then shards its layers (`tp_blocks`,
tower_tp.py), the embedder staying whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.tower_tp import TowerBlock
from ferrox.models.vision.vit import ACTIVATIONS

# Gemma4VisionConfig's defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
    "num_key_value_heads": 12, "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
    "pooling_kernel_size": 3, "patch_size": 16, "position_embedding_size": 10 * 1024, "use_clipped_linears": False,
    "standardize": False,
}
_ROPE_THETA = 100.0  # Gemma4VisionConfig.default_theta
_CHECKPOINT_PREFIX = "model.vision_tower."
_LINEAR = re.compile(r"(.*_proj)\.linear\.weight")
_BOUND = re.compile(r"(.*_proj)\.((?:in|out)put_(?:min|max))")


def _norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' Gemma4RMSNorm: float32, scaled by the weight as stored (none: unscaled), back in x's dtype."""
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out if weight is None else out * weight.float()).to(x.dtype)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _norm(x, self.weight, self.eps)


class _Bounds(nn.Module):
    """A clipped projection's input and output bounds (transformers' Gemma4ClippableLinear buffers)."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()

        def bound(value: float) -> nn.Parameter:
            return nn.Parameter(torch.tensor(value, dtype=dtype, device=device), requires_grad=False)

        self.input_min, self.input_max = bound(-math.inf), bound(math.inf)
        self.output_min, self.output_max = bound(-math.inf), bound(math.inf)

    def clamped(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x = torch.clamp(x, self.input_min, self.input_max)
        return torch.clamp(linear(x), self.output_min, self.output_max)


class _Projections(nn.Module):
    """Holds bias-free projections by name, each clamped by its bounds when the checkpoint clips them."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], clipped: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        for name, (rows, cols) in shapes.items():
            setattr(self, name, nn.Linear(cols, rows, bias=False, dtype=dtype, device=device))
            if clipped:
                setattr(self, f"{name}_bounds", _Bounds(dtype, device))
        self.clipped = clipped

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        linear = getattr(self, name)  # (tower_tp.py may have swapped it for a parallel layer)
        return getattr(self, f"{name}_bounds").clamped(linear, x) if self.clipped else linear(x)


class Gemma4VisionAttention(_Projections):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float, clipped: bool,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__({"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
                          "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim)},
                         clipped, dtype, device)
        self.q_norm = _Norm(head_dim, eps, dtype, device)
        self.k_norm = _Norm(head_dim, eps, dtype, device)
        self.head_dim, self.eps = head_dim, eps
        # What tower_tp.py splits: q and k / v heads must both split, so the count it checks is their common
        # divisor (the same as the heads on every released checkpoint). The heads run are read off the
        # projections' widths, this rank's after sharding.
        self.num_heads = math.gcd(heads, kv_heads)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] of one image; cos / sin [N, head_dim]."""
        n, d = h.shape[0], self.head_dim
        q = self.project("q_proj", h).view(n, -1, d)
        k = self.project("k_proj", h).view(n, -1, d)
        v = self.project("v_proj", h).view(n, -1, d)
        q = _rotate(_norm(q, self.q_norm.weight, self.eps), cos, sin)
        k = _rotate(_norm(k, self.k_norm.weight, self.eps), cos, sin)
        v = _norm(v, None, self.eps)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=1.0,
                                           enable_gqa=True)  # no mask: every patch sees the whole image
        return self.project("o_proj", o.transpose(0, 1).reshape(n, -1))


class Gemma4VisionMLP(_Projections):
    def __init__(self, hidden: int, intermediate: int, act: Any, clipped: bool, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__({"gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
                          "down_proj": (hidden, intermediate)}, clipped, dtype, device)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project("down_proj", self.act(self.project("gate_proj", x)) * self.project("up_proj", x))


class Gemma4VisionLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], act: Any, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, eps, clipped = int(cfg["hidden_size"]), float(cfg["rms_norm_eps"]), bool(cfg["use_clipped_linears"])
        self.self_attn = Gemma4VisionAttention(hidden, int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"]),
                                               int(cfg["head_dim"]), eps, clipped, dtype, device)
        self.mlp = Gemma4VisionMLP(hidden, int(cfg["intermediate_size"]), act, clipped, dtype, device)
        self.input_layernorm = _Norm(hidden, eps, dtype, device)
        self.post_attention_layernorm = _Norm(hidden, eps, dtype, device)
        self.pre_feedforward_layernorm = _Norm(hidden, eps, dtype, device)
        self.post_feedforward_layernorm = _Norm(hidden, eps, dtype, device)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), cos, sin))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma4PatchEmbedder(nn.Module):
    def __init__(self, hidden: int, patch_size: int, positions: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.input_proj = nn.Linear(3 * patch_size**2, hidden, bias=False, dtype=dtype, device=device)
        self.position_embedding_table = nn.Parameter(torch.empty(2, positions, hidden, dtype=dtype, device=device),
                                                     requires_grad=False)

    def forward(self, patches: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = (2 * (patches.float() - 0.5)).to(self.input_proj.weight.dtype)
        table = self.position_embedding_table
        return self.input_proj(x) + (table[0][cols] + table[1][rows])


class _Layers(nn.Module):
    """Holds the layers only so that their names read `encoder.layers.N`, as in the checkpoint."""

    def __init__(self, layers: Iterable[Gemma4VisionLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class Gemma4VisionTower(nn.Module):
    """forward(patches [rows * cols, P*P*3], (rows, cols)) -> [rows * cols / k^2, hidden] pooled rows."""

    inv_freq: torch.Tensor  # a registered (non-persistent) buffer: the rotary frequencies of one axis

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        act = ACTIVATIONS.get(cfg["hidden_activation"])
        if act is None:
            raise UnsupportedModelError(f"vision_config.hidden_activation {cfg['hidden_activation']!r} is not "
                                        f"supported (supported: {', '.join(ACTIVATIONS)})",
                                        param="vision_config.hidden_activation")
        rope = dict(cfg.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise UnsupportedModelError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: Gemma 4's "
                                        "tower turns by axial RoPE only", param="vision_config.rope_parameters")
        head_dim = int(cfg["head_dim"])
        if head_dim % 4:
            raise UnsupportedModelError(f"vision_config.head_dim {head_dim} must be a multiple of 4 (a rotary pair "
                                        "per axis in each half)", param="vision_config.head_dim")
        self.hidden_size = int(cfg["hidden_size"])
        self.patch_size = int(cfg["patch_size"])
        self.pooling_kernel_size = int(cfg["pooling_kernel_size"])
        self.positions = int(cfg["position_embedding_size"])
        self.eps = float(cfg["rms_norm_eps"])
        self.patch_embedder = Gemma4PatchEmbedder(self.hidden_size, self.patch_size, self.positions, dtype, device)
        self.encoder = _Layers(Gemma4VisionLayer(cfg, act, dtype, device) for _ in range(int(cfg["num_hidden_layers"])))
        self.standardize = bool(cfg["standardize"])
        if self.standardize:
            self.std_bias = nn.Parameter(torch.zeros(self.hidden_size, dtype=dtype, device=device), requires_grad=False)
            self.std_scale = nn.Parameter(torch.ones(self.hidden_size, dtype=dtype, device=device), requires_grad=False)
        theta = float(rope.get("rope_theta", _ROPE_THETA))
        half = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32,
                                                                       device=device) / half), persistent=False)

    def check_grid(self, rows: int, cols: int) -> str | None:
        """What is wrong with an image of rows x cols patches for this tower, or None."""
        k = self.pooling_kernel_size
        if rows % k or cols % k:
            return f"grid {[rows, cols]}: rows and columns must be multiples of the pooling kernel {k}"
        if max(rows, cols) > self.positions:
            return f"grid {[rows, cols]}: more than the tower's {self.positions} patch positions a side"
        return None

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        rows, cols = grid
        n = torch.arange(rows * cols, device=patches.device)
        col, row = n % cols, torch.div(n, cols, rounding_mode="floor")
        dtype = self.patch_embedder.input_proj.weight.dtype
        h = self.patch_embedder(patches, col, row)
        cos, sin = self._rotary(col, row, dtype)
        for layer in self.encoder.layers:
            h = layer(h, cos, sin)
        k = self.pooling_kernel_size
        if k > 1:  # (transformers casts the average back to the working dtype before the scale)
            squares = h.float().view(rows // k, k, cols // k, k, -1)
            h = squares.mean(dim=(1, 3)).reshape(-1, h.shape[-1]).to(dtype)
        x = h.float() * self.hidden_size**0.5  # float32: the scale can pass float16's range
        if self.standardize:
            x = (x - self.std_bias.float()) * self.std_scale.float()
        return x.to(dtype)

    def _rotary(self, col: torch.Tensor, row: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin [N, head_dim] in the activations' dtype: [col freqs twice | row freqs twice]."""
        by_col, by_row = col.float()[:, None] * self.inv_freq, row.float()[:, None] * self.inv_freq
        angles = torch.cat([by_col, by_col, by_row, by_row], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def tp_blocks(self) -> list[TowerBlock]:
        """The blocks --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        return [TowerBlock(layer.self_attn, ("q_proj", "k_proj", "v_proj"), "o_proj", layer.mlp,
                           ("gate_proj", "up_proj"), "down_proj") for layer in self.encoder.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names under `model.vision_tower.` (the prefix optional). Every parameter must be set; a
        name the tower does not have is an UnsupportedModelError (a ValueError)."""
        def rename(name: str) -> str:
            name = name.removeprefix(_CHECKPOINT_PREFIX)
            if (match := _LINEAR.fullmatch(name)) is not None:
                return f"{match[1]}.weight"
            if (match := _BOUND.fullmatch(name)) is not None:
                return f"{match[1]}_bounds.{match[2]}"
            return name

        load_tower_tensors(self, weights, "Gemma 4 vision tower", rename=rename)


class Gemma4VisionEmbedder(nn.Module):
    """transformers' Gemma4MultimodalEmbedder for images: a weightless RMSNorm, then one matmul into the text
    width (rows unscaled: Gemma scales only the token embeddings)."""

    def __init__(self, vision_hidden: int, text_hidden: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        self.embedding_projection = nn.Linear(vision_hidden, text_hidden, bias=False, dtype=dtype, device=device)
        self.eps = eps

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(_norm(features, None, self.eps))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, head_dim]: each half turned by its own axis (rotate-half pairs within the half), in x's dtype
    (transformers' apply_multidimensional_rope)."""
    halves = []
    for part, c, s in zip(x.chunk(2, dim=-1), cos.chunk(2, dim=-1), sin.chunk(2, dim=-1), strict=True):
        a, b = part.chunk(2, dim=-1)
        halves.append(part * c[:, None] + torch.cat([-b, a], dim=-1) * s[:, None])
    return torch.cat(halves, dim=-1)
