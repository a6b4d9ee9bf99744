"""Rotary position embedding in the NeoX / HF `rotate_half` layout (first half pairs with second half).

cos/sin are computed once per forward from the step's positions (cheap, exact, and no table sized
by max_position_embeddings), then every layer applies them to its queries and keys.
Supported `rope_type`s: default, linear, llama3 (Llama 3.1 long-context scaling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ferrox.loader.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_inv_freq(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float32) after the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Positions stretched by `factor` == frequencies divided by it.
        return inv_freq / float(scaling["factor"])  # type: ignore[index]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    if rope_type == "freq_factors":
        # GGUF files of Llama 3.1 store the llama3 scaling precomputed as per-frequency divisors
        # (tensor rope_freqs.weight); the GGUF loader puts them here.
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)  # type: ignore[index]
        if factors.shape != inv_freq.shape:
            raise UnsupportedModelError(f"rope_freqs has {factors.numel()} factors, expected {inv_freq.numel()}")
        return inv_freq / factors
    raise UnsupportedModelError(
        f"rope_scaling.rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    slow = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelen - low) / (high - low)
    blended = (1 - blend) * slow / factor + blend * slow
    in_band = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(in_band, blended, slow)


@dataclass(slots=True)
class RopeRows:
    """For the Triton kernel (kernels/rotary.py, GPU): one float32 [cos | sin] row of head_dim / 2
    each per token of the step, and each token's row index (0..T-1)."""

    rows: torch.Tensor  # [T, head_dim] float32
    index: torch.Tensor  # [T] int64


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a registered (non-persistent) buffer; declared so it types as a Tensor

    def __init__(self, head_dim: int, base: float, scaling: dict | None, device: torch.device | str | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads), in the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def kernel_rows(self, positions: torch.Tensor) -> RopeRows:
        """The same angles as cos_sin, laid out for `rotary_neox_`, which rotates q and k of every
        head in one launch per layer instead of five elementwise kernels (and in float32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        rows = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return RopeRows(rows, torch.arange(positions.shape[0], device=positions.device))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate each (i, i + head_dim/2) pair by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
