"""The causal-LM surface of the families built on a decoder stack at `model` (its embed_tokens, layers and
decode_path), an optional untied `lm_head` and an attention backend whose per-step state begins each forward: the
MoE stack (models/moe.py), DeepSeek's (models/deepseek_v2.py) and the hybrids (models/qwen3_5.py,
granitemoehybrid.py, nemotron_h.py). Each family builds those and loads its checkpoint; the forward, the logits and
the finalize step after loading are these (a family extends finalize_weights or lm_head_weight where it needs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.layers.fused_moe import FusedMoE
from ferrox.layers.linear import Linear


class DecoderStackLM(nn.Module):
    model: Any  # the decoder stack: embed_tokens, layers, decode_path
    lm_head: Any  # ParallelLMHead, or None when tied to the embedding
    backend: Any  # the attention backend

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def finalize_weights(self) -> None:
        """Quantized layers' runners (online FP8 quantized now)."""
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.finalize_quantized()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (logits: compute_logits). inputs_embeds: the step's input
        rows (embed_input_ids' with some replaced: worker/model_forward.py), else the token embeddings."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} tensors, the model has {len(self.model.layers)} layers")
        self.backend.begin_forward(attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings forward() starts from."""
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits; under tensor parallelism each rank's vocabulary rows, gathered."""
        return self.model.embed_tokens.gather_logits(self.model.decode_path.logits(hidden, self.lm_head_weight))
