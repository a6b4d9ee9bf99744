"""DeepSeek-V3's multi-token-prediction (MTP) layer layout, as a drafter (speculative_config method "mtp"): DeepSeek-V3
/ R1 (models/deepseek_v2.py) and GLM-4.5 / 4.6 / 4.7 (models/glm4_moe.py) checkpoints carry it.

The checkpoints append it after the last decoder layer (model.layers.{num_hidden_layers}.*, config.json's
num_nextn_predict_layers): a decoder layer of the model's own kind (sparse; the target builds it:
`mtp_decoder_layer`) plus

    x = eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)])           (2H -> H, no bias; the embedding zeroed at position 0)
    o_i = layer(x) + its residual stream                          (no final norm: o_i chains the next draft)
    draft = argmax(lm_head(shared_head.norm(o_i)))

as vLLM's DeepSeekMTP / Glm4MoeMTP run it. h_i is the target's last hidden state (after its final norm) at position i, t_{i+1} the
token after it (worker/mtp_proposer.py pairs them). The layer's `embed_tokens` and `shared_head.head` are copies of
the target's embedding and lm_head in the releases: the target's are used, and a checkpoint whose copies differ is
refused by name rather than drafted with the wrong head. One MTP layer is taken (the releases have one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.sharding import materialize
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear
from ferrox.layers.quant.method import use_quant_config
from ferrox.model_spec import ModelLoadError, UnsupportedModelError
from ferrox.models.moe import expected_checkpoint_keys
from ferrox.models.mtp_layer import MtpLayer

# The MTP layer's own tensors (beside its decoder layer's), and the copies of the target's it may carry.
_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_COPIES = {"embed_tokens.weight": "embedding", "shared_head.head.weight": "lm_head"}


class _SharedHead(nn.Module):
    """(The checkpoint's `shared_head`: its norm; its head is the target's lm_head.)"""

    def __init__(self, norm: RMSNorm):
        super().__init__()
        self.norm = norm


class DeepseekLayoutMtp(MtpLayer):
    def __init__(self, target: Any, quant_config: Any = None, *, float_fc: bool = False):
        """quant_config: the target's where the checkpoint quantized the layer (None: float); float_fc: eh_proj left
        float all the same (worker/mtp_proposer.py load_predictor reads which)."""
        super().__init__(target)
        spec = target.spec
        if target.num_mtp_layers != 1:
            raise UnsupportedModelError(
                f"speculative_config.method 'mtp': config.json declares {target.num_mtp_layers} multi-token-prediction "
                "layers (num_nextn_predict_layers); ferrox drafts with exactly one")
        self.index = spec.num_layers
        dtype, device = target.model.embed_tokens.weight.dtype, target.lm_head_weight.device
        h, eps, ops = spec.hidden_size, spec.rms_norm_eps, target.ops
        with use_quant_config(None if float_fc else quant_config):
            self.eh_proj = Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        with use_quant_config(quant_config):
            # (a backend of its own: the MTP step's attention metadata is not the target step's)
            self.backend, self.mtp_block = target.mtp_decoder_layer(self.index)
        self.enorm = RMSNorm(h, eps, dtype, device, ops)
        self.hnorm = RMSNorm(h, eps, dtype, device, ops)
        self.shared_head = _SharedHead(RMSNorm(h, eps, dtype, device, ops))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        target = self.target
        e = target.embed_input_ids(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        self.backend.begin_forward(meta)
        out, residual = self.mtp_block(x, None, target.model.rotary(positions, x.dtype), kv_cache, meta)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(self.shared_head.norm(hidden))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The MTP layer's tensors (the checkpoint_prefix ones), read as the target reads its layers'."""
        self.target.load_mtp_tensors(self, self._renamed(weights), expected_checkpoint_keys(self))

    def _renamed(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if not name.startswith(self.checkpoint_prefix):
                continue
            leaf = name[len(self.checkpoint_prefix):]
            if leaf in _COPIES:
                self._check_copy(name, leaf, tensor)
            elif leaf.startswith(_OWN):
                yield leaf, tensor
            else:  # (the decoder layer's, under the names MoeDecoderLayer's loader reads: model.layers.N.*)
                yield f"mtp_block.{leaf}", tensor

    def _check_copy(self, name: str, leaf: str, tensor: Any) -> None:
        target = self.target
        mine = target.model.embed_tokens.weight if leaf == "embed_tokens.weight" else target.lm_head_weight
        value = materialize(tensor)
        if tuple(value.shape) != tuple(mine.shape) or not torch.equal(value.to(mine.dtype), mine.detach().cpu()):
            raise ModelLoadError(f"tensor {name!r}: the MTP layer's {_COPIES[leaf]} differs from the model's; ferrox "
                                 "drafts with the model's own (as the releases store copies)")


class DeepseekLayoutMtpTarget:
    """The target side of this layout (DeepseekV2ForCausalLM, Glm4MoeForCausalLM): where its tensors are and the
    drafter built on it; the target itself builds the decoder layer (`mtp_decoder_layer`), loads its tensors
    (`load_mtp_tensors`) and may finish it after loading (`finalize_mtp`)."""

    spec: Any

    @property
    def mtp_checkpoint_prefix(self) -> str:
        """The checkpoint's MTP layer's tensors: the layer after the last decoder layer."""
        return f"model.layers.{self.spec.num_layers}."

    def multi_token_predictor(self, quant_config: Any = None, *, float_fc: bool = False) -> nn.Module:
        """The checkpoint's MTP layer as a drafter, built but not loaded."""
        return DeepseekLayoutMtp(self, quant_config, float_fc=float_fc)
