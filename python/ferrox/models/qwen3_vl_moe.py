"""Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B): dense Qwen3-VL's image
side (models/qwen3_vl.py Qwen3VLImages: the vision tower, the interleaved multimodal rotary, DeepStack) on a
Qwen3-MoE decoder (models/moe.py: q/k norms, softmax top-k routing, dense layers where mlp_only_layers /
decoder_sparse_step say).

Routing: transformers' Qwen3VLMoeTextTopKRouter always renormalises the top-k weights (its config has no
norm_topk_prob); a config that sets norm_topk_prob false asks for what no reference computes and is refused.

Experts are stored fused, one tensor a layer for all of them: `mlp.experts.gate_up_proj` (gate rows, then up
rows) and `mlp.experts.down_proj`. The hub's files hold them as [E, hidden, 2 x I] / [E, I, hidden];
transformers 5 holds (and saves) the transposes, [E, 2 x I, hidden] / [E, hidden, I], and transposes on load
only what does not already have its own shape. The loader reads either the same way and hands moe.py one
expert's gate / up / down at a time, under the per-expert names Qwen3-MoE checkpoints use.

Image steps run eagerly through the general layer loop with DeepStack (qwen3_vl.deepstack_layers); text-only
steps take MoeModel's forward unchanged (the fused decode path, CUDA graphs).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.distributed.sharding import materialize
from ferrox.errors import UnsupportedModelError
from ferrox.model_spec import ModelLoadError, ModelSpec
from ferrox.models.moe import MoeModel, Qwen3MoeForCausalLM
from ferrox.models.qwen3_vl import Qwen3VLImages, deepstack_layers

_FUSED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


class Qwen3VLMoeTextModel(MoeModel):
    """The Qwen3-MoE decoder stack with DeepStack's additions after its first layers on image steps."""

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None):
        if inputs_embeds is None and deepstack is None:
            return super().forward(input_ids, positions, kv_caches, meta)
        return deepstack_layers(self, input_ids, positions, kv_caches, meta, inputs_embeds, deepstack)


def unfuse_experts(weights: Iterable[tuple[str, Any]], hidden: int,
                   intermediate: int) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors with each fused expert tensor split into one [I, hidden] gate_proj / up_proj and
    one [hidden, I] down_proj weight per expert (`<layer>.mlp.experts.<e>.<proj>.weight`). Either orientation
    (module docstring); where both have the same shape (hidden == 2 x I, or hidden == I) the tensor is read
    as transformers reads it, untransposed."""
    for name, tensor in weights:
        if not name.endswith(_FUSED):
            yield name, tensor
            continue
        value = materialize(tensor)
        gate_up = name.endswith(_FUSED[0])
        held = (2 * intermediate, hidden) if gate_up else (hidden, intermediate)  # transformers' [E, out, in]
        if value.dim() != 3 or tuple(value.shape[1:]) not in (held, held[::-1]):
            raise ModelLoadError(f"tensor {name!r}: shape {tuple(value.shape)}, expected [experts, {held[0]}, "
                                 f"{held[1]}] or [experts, {held[1]}, {held[0]}] (config.json does not match the "
                                 "weights?)")
        if tuple(value.shape[1:]) != held:
            value = value.transpose(1, 2)
        experts = name[:-len(".gate_up_proj" if gate_up else ".down_proj")]
        for e in range(value.shape[0]):
            if gate_up:
                yield f"{experts}.{e}.gate_proj.weight", value[e, :intermediate]
                yield f"{experts}.{e}.up_proj.weight", value[e, intermediate:]
            else:
                yield f"{experts}.{e}.down_proj.weight", value[e]


class Qwen3VLMoeForConditionalGeneration(Qwen3VLImages, Qwen3MoeForCausalLM):
    model_class = Qwen3VLMoeTextModel
    always_renormalize = True  # transformers' router (module docstring)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        if config.get("norm_topk_prob") is False:
            raise UnsupportedModelError("config.json: text_config.norm_topk_prob false: Qwen3-VL-MoE's router "
                                        "always renormalises its top-k weights (transformers ignores the field)",
                                        param="text_config.norm_topk_prob")
        if spec.moe is not None and spec.moe.shared_expert_intermediate_size:
            raise UnsupportedModelError("config.json: text_config.shared_expert_intermediate_size: Qwen3-VL-MoE "
                                        "has no shared expert", param="text_config.shared_expert_intermediate_size")
        super().__init__(self.language_spec(spec), dtype, device, kernels=kernels)
        self.init_images(spec, dtype, device)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings an image step starts from (worker/model_forward.py replaces the image rows)."""
        return self.model.embed_tokens(input_ids)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        assert self.spec.moe is not None  # MoeForCausalLM checked it
        super().load_weights(unfuse_experts(weights, self.spec.hidden_size, self.spec.moe.intermediate_size))
