"""Rotary position embedding in the NeoX / HF `rotate_half` layout (first half pairs with second half).

The angles are computed once per forward from the step's positions (cheap, exact, and no table
sized by max_position_embeddings), then every layer applies them to its queries and keys.
`RotaryEmbedding(positions, dtype)` returns the step's `Rope` in the layout of the op set chosen
when the model was built (layers/ops.py): cos/sin for the torch formula, float32 [cos | sin] rows
for the Triton kernel. Supported `rope_type`s: default, linear, llama3 (Llama 3.1 long-context
scaling), freq_factors (GGUF).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ferrox.layers.ops import DeviceOps, Rope, apply_rotary, for_device
from ferrox.model_spec import UnsupportedModelError

__all__ = ["SUPPORTED_ROPE_TYPES", "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]

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


class RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a registered (non-persistent) buffer; declared so it types as a Tensor

    def __init__(self, head_dim: int, base: float, scaling: dict | None, device: torch.device | str | None = None,
                 ops: DeviceOps | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, base, scaling).to(device), persistent=False)
        self.ops = ops if ops is not None else for_device(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """This step's rotary, for every layer to apply to its q and k."""
        return self.ops.rope(self, positions, dtype)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads), in the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rope_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The same angles as cos_sin as float32 rows [T, head_dim] = [cos | sin] (head_dim / 2
        each), the layout of the Triton kernels (`rotary_neox_`, and the one-token qkv kernel)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)
