"""GPT-2 (openai-community/gpt2, -medium, -large, -xl, distilgpt2: GPT2LMHeadModel), as transformers' GPT2 defines it:
the classic baseline of research batch generation.

- learned absolute position embeddings (`wpe`, n_positions rows) added to the token embeddings; no rotary (every
  layer takes NoRope);
- pre-norm layers with biased LayerNorms (GPT-NeoX's, models/gpt_neox.py), sequential residual;
- checkpoints store Conv1D weights [in, out] (transposed here) and a fused c_attn whose columns are [q | k | v], cut
  at load; biases everywhere;
- an ungated MLP c_fc -> GELU (`activation_function`, "gelu_new" in the releases) -> c_proj;
- the LM head tied to the token embedding (unless config.json's tie_word_embeddings is false: lm_head.weight).

Refused by name: `scale_attn_by_inverse_layer_idx` and `reorder_and_upcast_attn` (scores scaled per layer),
`add_cross_attention` (an encoder-decoder's decoder half),
`scale_attn_weights` false, another activation. GGUF files load through loader/gguf_families.py (dequantized).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.sharding import materialize
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.gpt_neox import _GELU, BiasedLayerNorm, GPTNeoXLayer, renamed
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaForCausalLM

_RENAMES = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
            ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."), (".ln_1.", ".input_layernorm."),
            (".ln_2.", ".post_attention_layernorm."), (".attn.c_proj.", ".self_attn.o_proj."),
            (".mlp.c_fc.", ".mlp.up_proj."), (".mlp.c_proj.", ".mlp.down_proj."))
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_C_ATTN = re.compile(r"^(?P<prefix>.+)\.attn\.c_attn\.(?P<leaf>weight|bias)$")
_SKIPPED = re.compile(r"\.attn\.(bias|masked_bias)$")


class LearnedPositionsModel(PerLayerRopeStack):
    """Sequential LayerNorm layers with the activation `act`, learned absolute positions added to the inputs (row
    position + `position_offset`: OPT's 2), no rotary in any layer: GPT-2's and OPT's decoder."""

    position_offset = 0

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, eps: float, act: type[nn.Module] | Any, **_: Any):
        layers: list[nn.Module] = [GPTNeoXLayer(spec, backend, ops, dtype, device, window=spec.window_of(i), eps=eps,
                                                parallel=False, act=act())
                                   for i in range(spec.num_layers)]
        # (the rotary is only the decode path's position table here: every layer takes no rotary)
        super().__init__(spec, backend, dtype, device, layers, BiasedLayerNorm(spec.hidden_size, eps, dtype, device),
                         RotaryEmbedding.for_spec(spec, device, ops), (False,) * spec.num_layers)
        rows = spec.max_position_embeddings + self.position_offset
        self.embed_positions = nn.Embedding(rows, spec.hidden_size, dtype=dtype, device=device)
        self.embed_positions.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = h + self.embed_positions(positions + self.position_offset if self.position_offset else positions)
        return super().forward(input_ids, positions, kv_caches, meta, inputs_embeds=h)


class GPT2Model(LearnedPositionsModel):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        approximate = _GELU[spec.hidden_act]
        super().__init__(spec, backend, ops, dtype, device, eps=float(spec.hf_config.get("layer_norm_epsilon", 1e-5)),
                         act=lambda: nn.GELU(approximate=approximate))


class GPT2LMHeadModel(LlamaForCausalLM):
    model_class = GPT2Model
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        config = spec.hf_config
        # (add_cross_attention: an encoder-decoder's GPT-2 half, with cross-attention layers a causal LM never runs)
        for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
            if config.get(key):
                raise UnsupportedModelError(f"config.json: {key} is not supported for GPT2LMHeadModel")
        if config.get("scale_attn_weights", True) is False:
            raise UnsupportedModelError("config.json: scale_attn_weights false is not supported for GPT2LMHeadModel")
        if spec.hidden_act not in _GELU:  # (GPT-2 names the field activation_function)
            raise UnsupportedModelError(f"config.json: activation_function {spec.hidden_act!r} is not supported for "
                                        f"GPT2LMHeadModel (one of {', '.join(_GELU)})")
        # (the LM head is the embedding unless the config unties it, as transformers' GPT2Config says: default true;
        # a GGUF file with its own output.weight; biases on every projection)
        tie = bool(config.get("tie_word_embeddings", True))
        spec = dataclasses.replace(spec, tie_word_embeddings=tie, attention_bias=True, mlp_bias=True)
        super().__init__(spec, dtype, device, kernels=kernels)

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint in Llama's names: Conv1D weights transposed, c_attn cut into q, k and v."""
        hidden = self.spec.hidden_size
        for name, tensor in weights:
            if _SKIPPED.search(name):
                continue
            if not name.startswith(("transformer.", "lm_head.")):
                name = "transformer." + name  # (the bare GPT2Model checkpoints: wte.weight, h.0...)
            if _CONV1D.search(name):
                tensor = materialize(tensor).t()
            fused = _C_ATTN.match(name)
            if fused is not None:
                value = materialize(tensor)
                prefix = renamed(fused["prefix"], _RENAMES)
                for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                    yield f"{prefix}.self_attn.{proj}.{fused['leaf']}", value[i * hidden:(i + 1) * hidden]
                continue
            yield renamed(name, _RENAMES), tensor

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._hf_names(weights))


__all__ = ["GPT2LMHeadModel"]
