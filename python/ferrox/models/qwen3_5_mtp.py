"""The multi-token-prediction (MTP) layer of Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints, as a drafter.

The checkpoints carry, beside the decoder, one extra full-attention decoder layer under `mtp.*` that was
trained to predict the token after next: at position i it reads the target's last hidden state h_i (after
its final norm) and the embedding of the token t_{i+1} that followed, and its output, through the target's
own lm_head, guesses t_{i+2}:

    x = fc([pre_fc_norm_embedding(embed(t_{i+1})) | pre_fc_norm_hidden(h_i)])      (2H -> H, no bias)
    o_i = norm(layer(x))                                                          (gated attention + MLP / MoE)
    draft = argmax(lm_head(o_i))

Chained, o_i takes the place of the target's hidden state for the next draft (vLLM's MTP speculation).
The layer is the target's full-attention layer kind (models/qwen3_5.py HybridDecoderLayer, with routed experts
in the MoE models), with a KV cache of its own that worker/mtp_proposer.py keeps; the embedding, lm_head and
rotary tables are the target's. Its norms are zero-centred like the target's (+1 at load).

The config counts the layers in `mtp_num_hidden_layers` (Qwen3.5) or `num_nextn_predict_layers` (Qwen3-Next); every
release has one, and only one is taken here (vLLM cycles several by draft index).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import get_attention_backend
from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.sharding import materialize
from ferrox.layers.layernorm import RMSNorm
from ferrox.layers.linear import Linear
from ferrox.layers.quant.method import use_quant_config
from ferrox.model_spec import UnsupportedModelError
from ferrox.models.llama import LlamaMLP
from ferrox.models.moe import MoeBlock, expected_checkpoint_keys
from ferrox.models.mtp_layer import MtpLayer

_NORMS = ("norm.weight", "pre_fc_norm_hidden.weight", "pre_fc_norm_embedding.weight")


def mtp_layer_count(config: dict[str, Any]) -> int:
    """The MTP layers config.json declares; 1 where it says nothing, as vLLM reads it (the checkpoint's mtp.*
    tensors then decide: worker/mtp_proposer.py load_predictor)."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if config.get(key) is not None:
            return int(config[key])
    return 1


class Qwen3_5MultiTokenPredictor(MtpLayer):
    def __init__(self, target: Any, quant_config: Any = None, *, float_fc: bool = False):
        """target: the Qwen3_5ForCausalLM (or its MoE / Qwen3-Next / multimodal kin) whose checkpoint holds the
        layer; quant_config: the target's where the checkpoint quantized the layer (None: float); float_fc: its fc
        left float all the same (the releases may: worker/mtp_proposer.py load_predictor reads which)."""
        from ferrox.models.qwen3_5 import HybridDecoderLayer

        super().__init__(target)
        spec = target.spec
        count = mtp_layer_count(spec.hf_config)
        if count != 1:
            raise UnsupportedModelError(
                f"speculative_config.method 'mtp': config.json declares {count} multi-token-prediction layers "
                "(mtp_num_hidden_layers / num_nextn_predict_layers); ferrox drafts with exactly one")
        param = target.lm_head_weight
        dtype, device = target.model.embed_tokens.weight.dtype, param.device
        h, eps, ops = spec.hidden_size, spec.rms_norm_eps, target.ops
        # A backend of its own: the MTP step's attention metadata is not the target step's.
        self.backend = get_attention_backend(device, target.kernels)
        moe = spec.moe
        with use_quant_config(None if float_fc else quant_config):
            self.fc = Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        with use_quant_config(quant_config):
            if moe is not None and moe.is_sparse(0):
                renormalize = moe.norm_topk_prob or spec.hf_config.get("model_type") != "qwen3_next"
                mlp: nn.Module = MoeBlock(spec, moe, ops, dtype, device, renormalize=renormalize)
            else:
                mlp = LlamaMLP(spec, ops, dtype, device)
            self.layers = nn.ModuleList([HybridDecoderLayer(spec, "full_attention", mlp, self.backend, ops, dtype,
                                                            device, float_qkv=target.fp8_block is not None)])

        self.norm = RMSNorm(h, eps, dtype, device, ops)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, dtype, device, ops)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, dtype, device, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """o for each (token, hidden state, position) row (module docstring); `kv_cache` is the layer's."""
        target = self.target
        e = self.pre_fc_norm_embedding(target.embed_input_ids(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        self.backend.begin_forward(meta)
        rope = target.model.rotary(positions, x.dtype)
        no_state: Any = None  # (a full-attention layer reads no recurrent-state rows)
        x, residual = self.layers[0](x, None, rope, kv_cache, meta, no_state)
        out, _ = self.norm(x, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)

    # ---- loading --------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The checkpoint's mtp.* tensors (others skipped) through the target's own rewrites (partial-rotary row
        order, zero-centred q / k norms, FP8 attention dequantized, Qwen3-Next's fused projections)."""
        from ferrox.models.qwen3_5 import load_hybrid_tensors

        def ours() -> Iterator[tuple[str, Any]]:
            for name, tensor in self.target._rewritten(_mtp_tensors(weights)):
                if name.startswith("model.layers."):
                    yield name[len("model."):], tensor
                elif name in _NORMS:
                    yield name, materialize(tensor).float() + 1.0  # zero-centred (module docstring)
                else:
                    yield name, tensor

        load_hybrid_tensors(self, ours(), self.spec, expected_checkpoint_keys(self))



def _mtp_tensors(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The mtp.* tensors without their prefix, mtp.layers.N.* as model.layers.N.* (so that the target's per-layer
    rewrites apply); everything else (the decoder, the vision tower) dropped."""
    for name, tensor in weights:
        if name.startswith("mtp.layers."):
            yield "model." + name[len("mtp."):], tensor
        elif name.startswith("mtp."):
            yield name[len("mtp."):], tensor
