"""InternViT, InternVL's vision tower (transformers' InternVLVisionModel), its maths exactly:

    h = [cls_token, conv(pixels) as patches] + position_embeddings     patch conv with a bias
    per layer:  h = h + lambda_1 * projection_layer(attention(layernorm_before(h)))
                h = h + lambda_2 * fc2(act(fc1(layernorm_after(h))))
    forward() returns hidden_states[feature_layer] [B, 1 + patches, hidden]; the last layer's output goes
    through the final `layernorm` only when use_mean_pooling is false (it is an identity otherwise).

The norms are LayerNorm or RMSNorm (vision_config.norm_type: InternViT-300M has LayerNorm, InternViT-6B RMSNorm
and q/k norms, an RMSNorm over the whole q and k before the heads split). lambda_1 / lambda_2 are learned
per-channel layer scales. Tiles are always the tower's image_size (the processor cuts images so), so the
position embeddings are never interpolated. Module names follow transformers', so a checkpoint name is a
parameter name once the caller drops `vision_tower.`. Built and loaded whole; under tensor parallelism with
--mm-encoder-tp-mode weights the loader then shards its layers (`tp_blocks`, tower_tp.py: the q/k norms too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.load_check import load_tower_tensors
from ferrox.models.vision.tower_tp import TowerBlock
from ferrox.models.vision.vit import ACTIVATIONS, _layers_to_build
from ferrox.multimodal.internvl_processing import TOWER_GEOMETRY_DEFAULTS

# InternVLVisionConfig's defaults for the keys read here.
CONFIG_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "attention_bias": False,
    "use_qk_norm": False, "intermediate_size": 4096, "hidden_act": "gelu", "norm_type": "layer_norm",
    "layer_norm_eps": 1e-6, **TOWER_GEOMETRY_DEFAULTS, "num_channels": 3, "use_mask_token": False,
    "use_absolute_position_embeddings": True, "use_mean_pooling": True,
    # Not a transformers key: its q/k norms use 1e-6 always, InternVLChatModel's remote code layer_norm_eps
    # (multimodal/internvl_chat_processing.py native_multimodal sets it).
    "qk_norm_eps": 1e-6,
}


class RMSNorm(nn.Module):
    """InternVLVisionRMSNorm: normalized in float32, scaled in the input dtype."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(kind: str, hidden: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    if kind == "rms_norm":
        return RMSNorm(hidden, eps, dtype, device)
    return nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)


class PatchEmbeddings(nn.Module):
    def __init__(self, channels: int, hidden: int, patch: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.projection = nn.Conv2d(channels, hidden, kernel_size=patch, stride=patch, dtype=dtype, device=device)


class InternVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden = int(cfg["hidden_size"])
        self.cls_token = nn.Parameter(torch.empty(1, 1, hidden, dtype=dtype, device=device))
        self.patch_embeddings = PatchEmbeddings(int(cfg["num_channels"]), hidden, int(cfg["patch_size"]), dtype,
                                                device)
        positions = (int(cfg["image_size"]) // int(cfg["patch_size"])) ** 2 + 1
        self.position_embeddings = nn.Parameter(torch.empty(1, positions, hidden, dtype=dtype, device=device)) \
            if cfg["use_absolute_position_embeddings"] else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.patch_embeddings.projection(pixel_values).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls_token.expand(h.shape[0], -1, -1), h], dim=1)
        return h if self.position_embeddings is None else h + self.position_embeddings


class InternVisionAttention(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, bias = int(cfg["hidden_size"]), bool(cfg["attention_bias"])
        self.num_heads = int(cfg["num_attention_heads"])
        self.q_proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)
        self.k_proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)
        self.v_proj = nn.Linear(hidden, hidden, bias=bias, dtype=dtype, device=device)
        self.projection_layer = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        # The q/k norms are RMSNorms whatever norm_type says (transformers' and the remote code's alike).
        eps = float(cfg["qk_norm_eps"])
        self.q_norm = RMSNorm(hidden, eps, dtype, device) if cfg["use_qk_norm"] else None
        self.k_norm = RMSNorm(hidden, eps, dtype, device) if cfg["use_qk_norm"] else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (x.view(b, t, self.num_heads, -1).transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v)  # no mask: a tile's tokens all see each other
        return self.projection_layer(o.transpose(1, 2).reshape(b, t, -1))


class InternVisionMLP(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, inner = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.fc1 = nn.Linear(hidden, inner, dtype=dtype, device=device)
        self.fc2 = nn.Linear(inner, hidden, dtype=dtype, device=device)
        self.act = ACTIVATIONS[cfg["hidden_act"]]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class InternVisionLayer(nn.Module):
    def __init__(self, cfg: Mapping[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden, eps = int(cfg["hidden_size"]), float(cfg["layer_norm_eps"])
        self.attention = InternVisionAttention(cfg, dtype, device)
        self.mlp = InternVisionMLP(cfg, dtype, device)
        self.layernorm_before = _norm(cfg["norm_type"], hidden, eps, dtype, device)
        self.layernorm_after = _norm(cfg["norm_type"], hidden, eps, dtype, device)
        self.lambda_1 = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))
        self.lambda_2 = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.lambda_1 * self.attention(self.layernorm_before(h))
        return h + self.lambda_2 * self.mlp(self.layernorm_after(h))


class InternVisionEncoder(nn.Module):
    """Holds the layers only so that their names read `encoder.layer.N`, as in the checkpoint."""

    def __init__(self, layers: Iterable[InternVisionLayer]) -> None:
        super().__init__()
        self.layer = nn.ModuleList(layers)


class InternVisionTower(nn.Module):
    """forward(tiles [B, C, S, S]) -> [B, 1 + patches, hidden]: hidden_states[feature_layer], the class token
    first. Only the layers up to feature_layer are built."""

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str,
                 feature_layer: int = -1) -> None:
        super().__init__()
        cfg = {**CONFIG_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
        for key in ("image_size", "patch_size"):  # InternVLVisionConfig keeps both as (height, width)
            value = cfg[key]
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or value[0] != value[1]:
                    raise UnsupportedModelError(f"vision_config.{key} {value!r}: only square tiles are supported",
                                                param=f"vision_config.{key}")
                cfg[key] = value[0]
        if cfg["hidden_act"] not in ACTIVATIONS:
            raise UnsupportedModelError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(ACTIVATIONS)})", param="vision_config.hidden_act")
        if cfg["norm_type"] not in ("layer_norm", "rms_norm"):
            raise UnsupportedModelError(f"vision_config.norm_type {cfg['norm_type']!r} is not supported "
                                        "(layer_norm, rms_norm)", param="vision_config.norm_type")
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % heads:
            raise UnsupportedModelError(f"vision_config.hidden_size {hidden} must split evenly into "
                                        f"num_attention_heads {heads}", param="vision_config.num_attention_heads")
        self.hidden_size = hidden
        self.num_channels = int(cfg["num_channels"])
        self.image_size = int(cfg["image_size"])
        self.patch_size = int(cfg["patch_size"])
        if self.image_size % self.patch_size:
            raise UnsupportedModelError(f"vision_config.image_size {self.image_size} is not a multiple of patch_size "
                                        f"{self.patch_size}", param="vision_config.patch_size")
        self.total_layers = int(cfg["num_hidden_layers"])
        num_layers = _layers_to_build(feature_layer, self.total_layers)
        self.embeddings = InternVisionEmbeddings(cfg, dtype, device)
        self.encoder = InternVisionEncoder(InternVisionLayer(cfg, dtype, device) for _ in range(num_layers))
        # transformers' last_hidden_state (vision_feature_layer -1 only) goes through `layernorm`, an identity
        # under use_mean_pooling.
        final = feature_layer == -1 and not cfg["use_mean_pooling"]
        self.layernorm = nn.LayerNorm(hidden, eps=float(cfg["layer_norm_eps"]), dtype=dtype, device=device) \
            if final else None
        self._skip_layernorm = not final

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise InvalidArgumentError(f"pixel_values: expected [tiles, {', '.join(map(str, expected))}] (this "
                                       f"InternViT takes {self.image_size}x{self.image_size} tiles), got "
                                       f"{list(pixel_values.shape)}", param="pixel_values")
        weight = self.embeddings.patch_embeddings.projection.weight
        h = self.embeddings(pixel_values.to(weight.dtype))
        for layer in self.encoder.layer:
            h = layer(h)
        return h if self.layernorm is None else self.layernorm(h)

    def tp_blocks(self) -> list[TowerBlock]:
        """The layers --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        layers: list[Any] = list(self.encoder.layer)
        return [TowerBlock(layer.attention, ("q_proj", "k_proj", "v_proj"), "projection_layer", layer.mlp, ("fc1",),
                           "fc2", qk_norms=("q_norm", "k_norm") if layer.attention.q_norm is not None else ())
                for layer in layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """transformers' InternVLVisionModel names; layers past feature_layer, an unused final layernorm and the
        mask token (masked image modelling, a training input) are skipped."""
        built = len(self.encoder.layer)

        def wanted(item: tuple[str, Any]) -> bool:
            name = item[0]
            if name == "embeddings.mask_token" or (self._skip_layernorm and name.startswith("layernorm.")):
                return False
            if name.startswith("encoder.layer."):
                return int(name.split(".")[2]) < built
            return True

        load_tower_tensors(self, filter(wanted, weights), "InternViT tower")
