"""GPT-NeoX (EleutherAI/pythia-*, gpt-neox-20b: GPTNeoXForCausalLM), as transformers' GPTNeoX defines it: the decoder
behind the Pythia suite researchers run batch generation with.

- LayerNorm with a bias (`layer_norm_eps`) before attention and MLP; with `use_parallel_residual` (Pythia's) one
  block h = h + attn(ln1(h)) + mlp(ln2(h)), else h = h + attn(ln1(h)); h = h + mlp(ln2(h));
- a fused query_key_value [heads * 3 * head_dim] laid out per head (q, k, v of head 0, then head 1...), cut into
  q, k and v at load; q/k/v and the output projection carry biases (`attention_bias`, default on);
- partial rotary: the first `rotary_pct` (Pythia 0.25; transformers >= 5: rope_parameters.partial_rotary_factor) of
  each head rotates in half-split pairs, rows reordered at load into whole-head pairs (layers/rotary.py
  partial_rotary_order); base `rotary_emb_base` (or rope_theta);
- an ungated MLP, dense_h_to_4h -> GELU (`hidden_act`: exact "gelu", or the tanh forms) -> dense_4h_to_h, with biases
  (models/ungated_mlp.py);
- untied `embed_out` as the LM head (tied when tie_word_embeddings says so).

Decoding takes the general path. Tensor parallelism comes with Llama's projections. Refused by name: another
hidden_act. GGUF files load dequantized (loader/gguf_families.py).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.backend import AttentionBackend
from ferrox.distributed.sharding import materialize
from ferrox.layers.ops import DeviceOps
from ferrox.layers.rotary import RotaryEmbedding, partial_rotary_order
from ferrox.model_spec import ModelSpec, UnsupportedModelError
from ferrox.models.glm4 import reorder_rotary_rows
from ferrox.models.layer_stack import PerLayerRopeStack
from ferrox.models.llama import LlamaAttention, LlamaForCausalLM
from ferrox.models.ungated_mlp import UngatedMLP

_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}
_RENAMES = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
            ("embed_out.", "lm_head."), ("gpt_neox.layers.", "model.layers."), (".attention.dense.", ".self_attn.o_proj."),
            (".mlp.dense_h_to_4h.", ".mlp.up_proj."), (".mlp.dense_4h_to_h.", ".mlp.down_proj."))
_QKV = re.compile(r"^(?P<prefix>.+)\.attention\.query_key_value\.(?P<leaf>weight|bias)$")
# Buffers some checkpoints carry (the causal mask, the rotary's frequencies): nothing to load.
_SKIPPED = re.compile(r"\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")


def check_gelu(spec: ModelSpec) -> str:
    """The GELU approximation the config's hidden_act names (nn.GELU's `approximate`), or UnsupportedModelError."""
    if spec.hidden_act not in _GELU:
        raise UnsupportedModelError(f"config.json: hidden_act {spec.hidden_act!r} is not supported for "
                                    f"{spec.architecture} (one of {', '.join(_GELU)})")
    return _GELU[spec.hidden_act]


def neox_spec(spec: ModelSpec) -> ModelSpec:
    """The spec with GPT-NeoX's own names: rotary_pct and rotary_emb_base (the hub's configs), attention_bias (default
    on in transformers), use_bias for nothing else."""
    config = spec.hf_config
    changes: dict[str, Any] = {"attention_bias": bool(config.get("attention_bias", True)), "mlp_bias": True}
    pct = config.get("rotary_pct")
    if pct is not None and spec.rotary_dim is None:
        if isinstance(pct, bool) or not isinstance(pct, (int, float)) or not 0 < pct <= 1:
            raise UnsupportedModelError(f"config.json: rotary_pct must be in (0, 1], got {pct!r}")
        dim = int(spec.head_dim * pct)
        changes["rotary_dim"] = dim if dim < spec.head_dim else None
    if config.get("rotary_emb_base") is not None and config.get("rope_theta") is None:
        changes["rope_theta"] = float(config["rotary_emb_base"])
    return dataclasses.replace(spec, **changes)


class BiasedLayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class GPTNeoXLayer(nn.Module):
    """LayerNorm (with bias) before attention and before the ungated MLP (`act`), parallel or sequential residual:
    GPT-NeoX's layer, GPT-2's and OPT's (sequential)."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, *, window: int, eps: float, parallel: bool, act: nn.Module):
        super().__init__()
        self.parallel = parallel
        self.input_layernorm = BiasedLayerNorm(spec.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(spec, backend, ops, dtype, device, qkv_bias=spec.attention_bias,
                                        o_bias=spec.attention_bias, qk_norm=False, window=window)
        self.post_attention_layernorm = BiasedLayerNorm(spec.hidden_size, eps, dtype, device)
        self.mlp = UngatedMLP(spec, act, dtype, device)

    def forward(self, x: torch.Tensor, rope: Any, kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        if self.parallel:
            return x + attn + self.mlp(self.post_attention_layernorm(x))
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """A checkpoint tensor's name in Llama's words: each (old, new) substring replaced in turn (the GPT-2-shaped
    families: GPT-NeoX, GPT-2, OPT, Phi, StarCoder2)."""
    for old, new in renames:
        name = name.replace(old, new)
    return name


class GPTNeoXModel(PerLayerRopeStack):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, ops: DeviceOps, dtype: torch.dtype,
                 device: torch.device | str, **_: Any):
        config = spec.hf_config
        eps = float(config.get("layer_norm_eps", 1e-5))
        parallel = bool(config.get("use_parallel_residual", True))
        layers: list[nn.Module] = [GPTNeoXLayer(spec, backend, ops, dtype, device, window=spec.window_of(i), eps=eps,
                                                parallel=parallel, act=nn.GELU(approximate=_GELU[spec.hidden_act]))
                                   for i in range(spec.num_layers)]
        super().__init__(spec, backend, dtype, device, layers, BiasedLayerNorm(spec.hidden_size, eps, dtype, device),
                         RotaryEmbedding.for_spec(spec, device, ops))


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoXModel
    reorders_partial_rotary = True
    supports_quantized_gguf = False  # (a GGUF file loads dequantized: loader/gguf_families.py)

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None):
        check_gelu(spec)
        spec = neox_spec(spec)
        super().__init__(spec, dtype, device, kernels=kernels)
        self.rotary_order = (None if spec.rotary_dim is None else
                             partial_rotary_order(spec.head_dim, spec.rotary_dim))

    def _hf_names(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint in Llama's names, its fused per-head query_key_value cut into q, k and v."""
        heads, d = self.spec.num_heads, self.spec.head_dim
        for name, tensor in weights:
            if _SKIPPED.search(name):
                continue
            name = renamed(name, _RENAMES)
            fused = _QKV.match(name)
            if fused is None:
                yield name, tensor
                continue
            value = materialize(tensor)
            per_head = value.reshape(heads, 3, d, *value.shape[1:])
            for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                yield f"{fused['prefix']}.self_attn.{proj}.{fused['leaf']}", per_head[:, i].reshape(heads * d,
                                                                                                  *value.shape[1:])

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self.lora_rewrite(weights))

    def lora_rewrite(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint in Llama's names, query_key_value cut per head, q/k rows in the partial rotary's order: the
        load path, row-only, so an adapter's (module.weight, lora_B) pairs take it too (lora/rewrite.py)."""
        return reorder_rotary_rows(self._hf_names(pairs), self.spec.head_dim, self.rotary_order)


__all__ = ["GPTNeoXForCausalLM", "renamed"]
