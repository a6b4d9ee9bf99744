"""Gemma 3 text (Gemma3ForCausalLM: gemma-3-1b, gemma-3-270m and their -it): Gemma 2's decoder
(models/gemma2.py: four (1 + w) norms a layer, GELU-tanh MLP, sqrt(hidden) embedding scale,
query_pre_attn_scalar) with three changes, as transformers' Gemma3 defines them:

- q and k are RMS-normed per head before rotary ((1 + w) norms too, folded with the rest);
- local (sliding-window) layers and global layers rotate with different RoPE: the local base frequency
  (rope_local_base_freq, 10,000) unscaled, the global rope_theta (1,000,000) with the config's
  rope_scaling (linear 8 on the 4B+ checkpoints); transformers >= 5 writes both under rope_parameters,
  keyed by layer type;
- no soft caps (attn_logit_softcapping and final_logit_softcapping are null), and five local layers
  for every global one (layer_types, or sliding_window_pattern 6), with a 512- or 1,024-token window.

The multimodal checkpoints (Gemma3ForConditionalGeneration: 4B/12B/27B with vision) add a SigLIP tower and a
projector (below); bidirectional attention (EmbeddingGemma) is refused here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.layers.ops import DeviceOps, Rope
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.gemma2 import Gemma2ForCausalLM, Gemma2Model
from ferrox.models.load_check import load_whole
from ferrox.models.vision import build_vision_tower
from ferrox.models.vision.encoder_setup import vision_device


def rope_settings(config: dict[str, Any]) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((local theta, local scaling), (global theta, global scaling)) from either config format."""
    nested = config.get("rope_parameters")
    if isinstance(nested, dict) and ("sliding_attention" in nested or "full_attention" in nested):
        def part(key: str, theta: float) -> tuple[float, dict | None]:
            params = dict(nested.get(key) or {})
            theta = float(params.pop("rope_theta", theta))
            kind = params.get("rope_type", params.get("type", "default"))
            return theta, (params if kind != "default" else None)

        return part("sliding_attention", 10_000.0), part("full_attention", 1_000_000.0)
    scaling = config.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    local = float(config.get("rope_local_base_freq", 10_000.0))
    return (local, None), (float(config.get("rope_theta", 1_000_000.0)), scaling if kind != "default" else None)


class Gemma3Model(Gemma2Model):
    gemma_qk_norm = True

    def make_rotary(self, spec: ModelSpec, device: torch.device | str, ops: DeviceOps) -> RotaryEmbedding:
        """The global layers' rotary (returned, as `rotary`); the local layers' is kept beside it."""
        (local_theta, local_scaling), (global_theta, global_scaling) = rope_settings(spec.hf_config)
        self.rotary_local = RotaryEmbedding(spec.head_dim, local_theta, local_scaling, device, ops)
        # Which layers rotate with the local RoPE: the windowed kind, whatever window is served.
        self.local = tuple(spec.sliding_layers or (False,) * spec.num_layers)
        return RotaryEmbedding(spec.head_dim, global_theta, global_scaling, device, ops,
                               max_position_embeddings=spec.max_position_embeddings,
                               long_context=spec.rope_long_context)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        rope_global = self.rotary(positions, dtype)
        rope_local = self.rotary_local(positions, dtype) if any(self.local) else rope_global
        return [rope_local if local else rope_global for local in self.local]


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_class = Gemma3Model

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        if spec.hf_config.get("use_bidirectional_attention"):
            raise UnsupportedModelError("config.json: use_bidirectional_attention (EmbeddingGemma) is not supported "
                                        "for Gemma3ForCausalLM: ferrox's attention is causal")
        super().__init__(spec, dtype, device, kernels=kernels)


# The multimodal checkpoint's tensors: its language model under one of two prefixes (transformers < 4.52
# and since), the vision tower and projector.
_LANGUAGE_PREFIXES = ("model.language_model.", "language_model.model.")
_VISION_RENAMES = (("model.vision_tower.", "vision_tower."), ("model.multi_modal_projector.", "multi_modal_projector."))


class _NormWeight(nn.Module):
    """The projector norm's (1 + w) weight, under its checkpoint name. Not an RMSNorm: Gemma's finalize_weights
    folds the 1 into those, and this norm runs in float32 as transformers' does (Gemma3Projector.forward)."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))


class Gemma3Projector(nn.Module):
    """transformers' Gemma3MultiModalProjector: the tower's patch grid average-pooled to
    mm_tokens_per_image rows (64x64 patches -> 16x16 for the released checkpoints), a (1 + w) RMSNorm in
    float32, then one matmul into the text width."""

    def __init__(self, vision_hidden: int, text_hidden: int, *, eps: float, patches_per_side: int, tokens: int,
                 dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        side = math.isqrt(tokens)
        if side * side != tokens or patches_per_side % side:
            raise UnsupportedModelError(f"config.json: mm_tokens_per_image {tokens} does not pool the tower's "
                                        f"{patches_per_side}x{patches_per_side} patches into a square grid")
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vision_hidden, text_hidden, dtype=dtype,
                                                                   device=device))
        self.mm_soft_emb_norm = _NormWeight(vision_hidden, dtype, device)
        self.eps = eps
        self.patches_per_side = patches_per_side
        self.kernel = patches_per_side // side

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        b, _, d = features.shape
        grid = features.transpose(1, 2).reshape(b, d, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        x = pooled.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.mm_soft_emb_norm.weight.float())
        return torch.matmul(x.to(features.dtype), self.mm_input_projection_weight).type_as(features)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """gemma-3-4b/12b/27b-it: the language model of the multimodal checkpoint (config.json's text_config over
    Gemma3TextConfig's defaults: loader/model_config.py), a SigLIP tower (its last_hidden_state) and the
    projector. Each image is mm_tokens_per_image rows in place of its `<image_soft_token>` run; as in
    transformers, an image's tokens attend to each other both ways (AttentionMetadata.bidirectional, within
    the window on local layers), so the scheduler computes each image in one step. Under tensor parallelism
    the language model is sharded as Gemma 3 text is; the tower and projector load whole on every rank (the
    tower's blocks then sharded under --mm-encoder-tp-mode weights: models/vision/encoder_setup.py), and each
    rank embeds its requests' images (worker/rank_images.py)."""

    own_weight_prefixes = ("vision_tower.", "multi_modal_projector.")
    bidirectional_images = True
    takes_images = True

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        super().__init__(spec, dtype, device, kernels=kernels)
        mm = spec.hf_config.get("multimodal") or {}
        vision = {"model_type": "siglip_vision_model", **(mm.get("vision_config") or {})}
        self.vision_tower = build_vision_tower(vision, dtype=dtype, device=vision_device(device), feature_layer=-1,
                                               post_layernorm=True)
        tokens = int(mm.get("mm_tokens_per_image", 256))
        self.multi_modal_projector = Gemma3Projector(
            self.vision_tower.hidden_size, spec.hidden_size, eps=float(vision.get("layer_norm_eps", 1e-6)),
            patches_per_side=self.vision_tower.image_size // self.vision_tower.patch_size, tokens=tokens,
            dtype=dtype, device=vision_device(device))
        self.image_tokens = tokens
        size = self.vision_tower.image_size
        self.pixel_shape = (3, size, size)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] pixels -> [B, mm_tokens_per_image, hidden] (unscaled: Gemma scales only token embeddings)."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        tower: list[tuple[str, Any]] = []
        projector: dict[str, torch.Tensor] = {}

        def language_model() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                for old, new in _VISION_RENAMES:
                    if name.startswith(old):
                        name = new + name[len(old):]
                if name.startswith(self.own_weight_prefixes):
                    if name.startswith("vision_tower."):
                        tower.append((name[len("vision_tower."):], tensor))
                    else:
                        projector[name[len("multi_modal_projector."):]] = materialize(tensor)
                    continue
                prefix = next((p for p in _LANGUAGE_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    yield "model." + name[len(prefix):], tensor
                elif name in ("lm_head.weight", "language_model.lm_head.weight"):
                    continue  # tied to the embedding (some exports store the copy)
                else:
                    yield name, tensor

        super().load_weights(language_model())
        self.vision_tower.load_weights((name, materialize(t)) for name, t in tower)
        load_whole(self.multi_modal_projector, projector, "multi_modal_projector", self.spec.architecture)
