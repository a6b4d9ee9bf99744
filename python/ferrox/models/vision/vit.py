"""The ViT encoder that CLIP's and SigLIP's vision towers share (transformers' CLIPVisionModel and
SiglipVisionModel), their maths exactly:

    h = conv(pixels) as [patches, hidden] + position[...]    CLIP: the class token first, then pre_layrnorm
    per layer:  h = h + out_proj(attention(layer_norm1(h)))   bidirectional over one image's tokens
                h = h + fc2(act(fc1(layer_norm2(h))))         pre-LayerNorm
    forward() returns hidden_states[feature_layer] [B, tokens, hidden], post_layernorm'd only when asked.

The families differ in three switches, set by the subclasses (clip.py, siglip.py): a class token, a
LayerNorm before the encoder, a bias on the patch convolution. Only the layers up to feature_layer are
built (LLaVA reads the second-to-last layer, so the last one would be memory and compute thrown away),
and post_layernorm only where the caller uses it (Gemma 3 reads SigLIP's last_hidden_state, which has it;
LLaVA reads hidden_states[k], which does not).

Module names follow transformers' so that a checkpoint name is a parameter name once `vision_model.` is
dropped, except q/k/v, which fill thirds of one qkv_proj (one matmul instead of three). Built and loaded
whole; under tensor parallelism with --mm-encoder-tp-mode weights the loader then shards its blocks
(`tp_blocks`, tower_tp.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.load_check import check_tower_loaded
from ferrox.models.vision.tower_tp import TowerBlock

# vision_config.hidden_act -> the activation (transformers' ACT2FN names; LLaVA's projector reads it too).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
}
# A checkpoint stores the tower under `vision_model.` (transformers 5 drops it from the module's own
# state_dict: both are accepted). SigLIP's attention-pooling head feeds its contrastive loss, not a
# language model; position_ids is a buffer older exports saved.
_MODEL_PREFIX = "vision_model."
_UNUSED_PREFIXES = ("head.",)
_UNUSED_NAMES = ("embeddings.position_ids",)
_LAYER_NAME = re.compile(r"encoder\.layers\.(\d+)\.(.+)")
_QKV_SHARDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


class VisionEmbeddings(nn.Module):
    """Pixels [B, C, H, W] -> [B, tokens, hidden]: one token per patch (a stride-patch convolution), the
    class token first where the family has one, plus a learned position per token."""

    def __init__(self, *, hidden: int, channels: int, image_size: int, patch_size: int, class_token: bool,
                 patch_bias: bool, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(channels, hidden, kernel_size=patch_size, stride=patch_size,
                                         bias=patch_bias, dtype=dtype, device=device)
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype, device=device)) if class_token \
            else None
        num_positions = (image_size // patch_size) ** 2 + int(class_token)
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype, device=device)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        h = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.expand(h.shape[0], 1, -1), h], dim=1)
        return h + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype, device=device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv_proj(h).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v)  # no mask: every token sees the whole image
        return self.out_proj(o.transpose(1, 2).reshape(b, t, -1))


class VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, dtype=dtype, device=device)
        self.fc2 = nn.Linear(intermediate, hidden, dtype=dtype, device=device)
        self.act = act

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_heads: int, eps: float,
                 act: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.self_attn = VisionAttention(hidden, num_heads, dtype, device)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.mlp = VisionMLP(hidden, intermediate, act, dtype, device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))
        return h + self.mlp(self.layer_norm2(h))


class VisionEncoder(nn.Module):
    """Holds the layers only so that their names read `encoder.layers.N`, as in the checkpoint."""

    def __init__(self, layers: Iterable[VisionEncoderLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class VisionTower(nn.Module):
    """A ViT image encoder: forward(pixel_values [B, C, H, W]) -> [B, tokens, hidden], the hidden state
    after `feature_layer` layers (transformers' output_hidden_states indexing). Built by a family
    subclass (CLIPVisionTower, SiglipVisionTower) through build_vision_tower."""

    model_type: ClassVar[str]
    # transformers' defaults for the keys read here: hub configs write only what differs from them.
    config_defaults: ClassVar[Mapping[str, Any]]
    has_class_token: ClassVar[bool]
    has_pre_layernorm: ClassVar[bool]
    has_patch_bias: ClassVar[bool]

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype, device: torch.device | str,
                 feature_layer: int = -1, post_layernorm: bool = False) -> None:
        super().__init__()
        cfg = {**self.config_defaults, **config}
        act = ACTIVATIONS.get(cfg["hidden_act"])
        if act is None:
            raise UnsupportedModelError(f"vision_config.hidden_act {cfg['hidden_act']!r} is not supported "
                                        f"(supported: {', '.join(ACTIVATIONS)})", param="vision_config.hidden_act")
        hidden, num_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        if hidden % num_heads:
            raise UnsupportedModelError(f"vision_config.hidden_size {hidden} must split evenly into "
                                        f"num_attention_heads {num_heads}", param="vision_config.num_attention_heads")
        self.total_layers = int(cfg["num_hidden_layers"])
        self.num_layers = _layers_to_build(feature_layer, self.total_layers)
        if post_layernorm and self.num_layers != self.total_layers:
            raise UnsupportedModelError(
                f"post_layernorm applies to the last layer's output only (vision_feature_layer -1 or "
                f"{self.total_layers}), not to vision_feature_layer {feature_layer}", param="vision_feature_layer")
        self.hidden_size = hidden
        self.num_channels = int(cfg["num_channels"])
        self.image_size = int(cfg["image_size"])
        self.patch_size = int(cfg["patch_size"])
        self.num_patches = (self.image_size // self.patch_size) ** 2
        eps = float(cfg["layer_norm_eps"])

        def layer_norm() -> nn.LayerNorm:
            return nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)

        self.embeddings = VisionEmbeddings(hidden=hidden, channels=self.num_channels, image_size=self.image_size,
                                           patch_size=self.patch_size, class_token=self.has_class_token,
                                           patch_bias=self.has_patch_bias, dtype=dtype, device=device)
        self.pre_layrnorm = layer_norm() if self.has_pre_layernorm else None  # transformers' spelling
        self.encoder = VisionEncoder(
            VisionEncoderLayer(hidden, int(cfg["intermediate_size"]), num_heads, eps, act, dtype, device)
            for _ in range(self.num_layers))
        self.post_layernorm = layer_norm() if post_layernorm else None

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, image_size, image_size] (any float dtype: cast to the tower's) -> [B, tokens, hidden]."""
        expected = (self.num_channels, self.image_size, self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise InvalidArgumentError(f"pixel_values: expected [batch, {', '.join(map(str, expected))}] (this "
                                       f"{self.model_type} takes {self.image_size}x{self.image_size} images), got "
                                       f"{list(pixel_values.shape)}", param="pixel_values")
        h = self.embeddings(pixel_values.to(self.embeddings.patch_embedding.weight.dtype))
        if self.pre_layrnorm is not None:
            h = self.pre_layrnorm(h)
        for layer in self.encoder.layers:
            h = layer(h)
        if self.post_layernorm is not None:
            h = self.post_layernorm(h)
        return h

    def tp_blocks(self) -> list[TowerBlock]:
        """The blocks --mm-encoder-tp-mode weights shards (tower_tp.py)."""
        return [TowerBlock(layer.self_attn, ("qkv_proj",), "out_proj", layer.mlp, ("fc1",), "fc2")
                for layer in self.encoder.layers]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Checkpoint names as transformers' Clip/SiglipVisionModel writes them (`vision_model.` optional);
        tensors of layers not built, an unused post_layernorm and SigLIP's pooling head are skipped unread.
        Every built parameter must be set (q/k/v fill thirds of qkv_proj)."""
        params = dict(self.named_parameters())
        expected = {n for n in params if ".qkv_proj." not in n}
        expected |= {f"{n}#{s}" for n in params if ".qkv_proj." in n for s in _QKV_SHARDS}
        loaded: set[str] = set()
        unknown: list[str] = []
        for ckpt_name, tensor in weights:
            mapped = self._map_name(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            param = params.get(name)
            if param is None:
                unknown.append(ckpt_name)
                continue
            tensor = materialize(tensor)
            target = param.data if shard is None else param.data.chunk(3, dim=0)[_QKV_SHARDS[shard]]
            if tuple(target.shape) != tuple(tensor.shape):
                raise UnsupportedModelError(f"vision tensor {ckpt_name!r}: checkpoint shape {tuple(tensor.shape)}, "
                                            f"tower expects {tuple(target.shape)} (vision_config does not match "
                                            "the weights?)")
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        # UnsupportedModelError: a ModelLoadError for the loader, a ValueError for everyone else.
        check_tower_loaded(f"{self.model_type} tower", unknown, expected, loaded)

    def _map_name(self, ckpt_name: str) -> tuple[str, str | None] | None:
        """(parameter name, q/k/v shard or None) of a checkpoint tensor; None: skipped. A name with no
        parameter comes back as is, for the caller to report."""
        name = ckpt_name.removeprefix(_MODEL_PREFIX)
        if name.startswith(_UNUSED_PREFIXES) or name in _UNUSED_NAMES:
            return None
        if name.startswith("post_layernorm.") and self.post_layernorm is None:
            return None
        match = _LAYER_NAME.fullmatch(name)
        if match is None:
            return name, None
        index, rest = int(match[1]), match[2]
        if self.num_layers <= index < self.total_layers:
            return None  # beyond feature_layer: not built
        module, _, leaf = rest.rpartition(".")
        if module.startswith("self_attn.") and module.removeprefix("self_attn.") in _QKV_SHARDS:
            return f"encoder.layers.{index}.self_attn.qkv_proj.{leaf}", module.removeprefix("self_attn.")
        return name, None


def _layers_to_build(feature_layer: int, total: int) -> int:
    """How many encoder layers hidden_states[feature_layer] has gone through (hidden_states holds the
    embeddings' output, then each layer's: total + 1 entries)."""
    if not -(total + 1) <= feature_layer <= total:
        raise UnsupportedModelError(f"vision_feature_layer {feature_layer} is out of range for a {total}-layer "
                                    f"vision tower (from {-(total + 1)} to {total})", param="vision_feature_layer")
    return feature_layer if feature_layer >= 0 else total + 1 + feature_layer
