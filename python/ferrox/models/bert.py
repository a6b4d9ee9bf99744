"""BERT-family encoders (BertModel, RobertaModel, XLMRobertaModel) for embeddings, BERT's maths exactly:

    h = LayerNorm(word[ids] + position[pos + offset] + token_type[0])
    per layer:  h = LayerNorm(h + dense(attention(h)))          bidirectional, within each request
                h = LayerNorm(h + down(act(up(h))))             post-LayerNorm, GELU by default
    forward() returns the last hidden state [T, hidden]; the pooling (mean, CLS...) is the runner's.

A step is a flat batch of whole prompts, requests concatenated (pooling runs with chunked prefill off),
so no KV cache exists: every request attends over its own rows only. The rows are laid out as a padded
[requests, longest, heads, head_dim] batch once per forward (`_PaddedBatch`), and each layer runs one
SDPA call over it with a key mask hiding the padding, as sentence-transformers' padded batches do.

token_type_ids are all 0 for an embedding prompt (one text); a cross-encoder's pair prompt passes them
(models/bert_classifier.py). RoBERTa differs from BERT only in its positions, which start after its padding
index (pad_token_id + 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.sharding import materialize
from ferrox.layers.ops import for_device
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.load_check import check_all_loaded

# config.json hidden_act -> the activation (transformers' ACT2FN names).
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# Checkpoint tensors an embedding model does not use: BERT's pooler head (sentence embeddings pool the
# last hidden state themselves), masked-LM heads, and the position-id buffer older exports save.
_UNUSED_PREFIXES = ("pooler.", "cls.", "lm_head.")
_UNUSED_NAMES = ("embeddings.position_ids",)
# A *ForMaskedLM-style folder nests the encoder under the family's name.
_MODEL_PREFIXES = ("bert.", "roberta.")
# HF module path (after encoder.layer.N.) -> this model's, per layer; q/k/v go into one merged qkv.
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_in",
    "output.dense": "ffn_out",
    "output.LayerNorm": "ffn_norm",
}
_QKV_SHARDS = {"query": 0, "key": 1, "value": 2}
_SHARD_NAMES = list(_QKV_SHARDS)


@dataclass(slots=True)
class _PaddedBatch:
    """Where each request's rows sit in a padded [B, L] layout (built once per forward)."""

    num_reqs: int
    max_len: int
    gather: torch.Tensor | None  # [B * L] flat row per padded slot (padding repeats a real row); None: no padding
    scatter: torch.Tensor | None  # [T] padded slot of each flat row
    key_mask: torch.Tensor | None  # [B, 1, 1, L] True = a real token

    @staticmethod
    def of(meta: AttentionMetadata, device: torch.device) -> _PaddedBatch:
        starts = meta.query_start_loc_cpu.tolist()
        lengths = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        num_reqs, max_len = len(lengths), max(lengths)
        if all(n == max_len for n in lengths):
            return _PaddedBatch(num_reqs, max_len, None, None, None)
        start_t = torch.tensor(starts[:-1], dtype=torch.int64)
        len_t = torch.tensor(lengths, dtype=torch.int64)
        cols = torch.arange(max_len, dtype=torch.int64)
        real = cols[None, :] < len_t[:, None]  # [B, L]
        gather = torch.where(real, start_t[:, None] + cols[None, :], start_t[:, None])
        scatter = torch.nonzero(real.flatten(), as_tuple=False).flatten()
        return _PaddedBatch(num_reqs, max_len, gather.flatten().to(device), scatter.to(device),
                            real[:, None, None, :].to(device))

    def to_padded(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [B, H, L, D]."""
        if self.gather is not None:
            x = x.index_select(0, self.gather)
        return x.view(self.num_reqs, self.max_len, *x.shape[1:]).transpose(1, 2)

    def to_flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, L, D] -> [T, H * D]."""
        x = x.transpose(1, 2).reshape(self.num_reqs * self.max_len, -1)
        return x if self.scatter is None else x.index_select(0, self.scatter)


class BertEmbeddings(nn.Module):
    def __init__(self, spec: ModelSpec, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        cfg = spec.hf_config
        self.word_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)
        self.position_embeddings = nn.Embedding(spec.max_position_embeddings, spec.hidden_size, dtype=dtype,
                                                device=device)
        self.token_type_embeddings = nn.Embedding(int(cfg.get("type_vocab_size", 2)), spec.hidden_size, dtype=dtype,
                                                  device=device)
        self.norm = nn.LayerNorm(spec.hidden_size, eps=eps, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else \
            self.token_type_embeddings(token_type_ids)
        return self.norm(h + types)


class BertLayer(nn.Module):
    def __init__(self, spec: ModelSpec, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        hidden = spec.hidden_size
        self.num_heads = spec.num_heads
        self.head_dim = hidden // spec.num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype, device=device)
        self.attn_out = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        self.attn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.ffn_in = nn.Linear(hidden, spec.intermediate_size, dtype=dtype, device=device)
        self.ffn_out = nn.Linear(spec.intermediate_size, hidden, dtype=dtype, device=device)
        self.ffn_norm = nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        self.act = _ACTIVATIONS[spec.hidden_act]
        self.ops = for_device(device)

    def forward(self, h: torch.Tensor, batch: _PaddedBatch) -> torch.Tensor:
        t = h.shape[0]
        q, k, v = self.qkv(h).view(t, 3, self.num_heads, self.head_dim).unbind(1)
        o = self.ops.masked_attention(batch.to_padded(q), batch.to_padded(k), batch.to_padded(v), batch.key_mask)
        h = self.attn_norm(h + self.attn_out(batch.to_flat(o)))
        return self.ffn_norm(h + self.ffn_out(self.act(self.ffn_in(h))))


class BertModel(nn.Module):
    """An encoder for the pooling runner: forward(...) -> the last hidden state of every token."""

    supports_tensor_parallel = False
    position_offset_from_pad = False  # RoBERTa: positions start at pad_token_id + 1

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None) -> None:
        super().__init__()
        cfg = spec.hf_config
        where = "config.json"
        if spec.hidden_act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: hidden_act {spec.hidden_act!r} is not supported (supported: "
                                        f"{', '.join(_ACTIVATIONS)})")
        kind = cfg.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise UnsupportedModelError(f"{where}: position_embedding_type {kind!r} is not supported (only absolute)")
        if spec.num_kv_heads != spec.num_heads or spec.hidden_size % spec.num_heads:
            raise ModelLoadError(f"{where}: hidden_size {spec.hidden_size} must split evenly into "
                                 f"num_attention_heads {spec.num_heads}")
        self.spec = spec
        eps = float(cfg.get("layer_norm_eps", 1e-12))
        self.position_offset = self.max_position_offset(spec)
        self.embeddings = BertEmbeddings(spec, eps, dtype, device)
        self.layers = nn.ModuleList(BertLayer(spec, eps, dtype, device) for _ in range(spec.num_layers))

    @classmethod
    def max_position_offset(cls, spec: ModelSpec) -> int:
        return int(spec.hf_config.get("pad_token_id", 1)) + 1 if cls.position_offset_from_pad else 0

    @classmethod
    def max_positions(cls, spec: ModelSpec) -> int:
        """The longest input the position table serves (pooling/config.py caps max_model_len with it)."""
        return spec.max_position_embeddings - cls.max_position_offset(spec)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[T, hidden]: every token's last hidden state. kv_caches is unused (an encoder keeps none);
        positions restart at 0 for each request (its prompt is whole in the step); token_type_ids [T]
        (None: all 0)."""
        batch = _PaddedBatch.of(attn_metadata, input_ids.device)
        h = self.embeddings(input_ids, positions + self.position_offset if self.position_offset else positions,
                            token_type_ids)
        for layer in self.layers:
            h = layer(h, batch)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError(f"{self.spec.architecture} is an encoder-only model: it has no language-model "
                                    "head, so it cannot generate (run it with runner 'pooling')")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """HF BertModel names (also under a bert./roberta. prefix, with old gamma/beta LayerNorm names);
        every parameter must be set exactly once (q/k/v fill thirds of the merged qkv)."""
        params = dict(self.named_parameters())
        expected = {n for n in params if ".qkv." not in n}
        expected |= {f"layers.{i}.qkv.{leaf}#{s}" for i in range(len(self.layers)) for leaf in ("weight", "bias")
                     for s in _QKV_SHARDS}
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            mapped = _map_name(hf_name)
            if mapped is None:
                continue
            name, shard = mapped
            param = params.get(name)
            if param is None:
                unexpected.append(hf_name)
                continue
            tensor = materialize(tensor)
            target = param.data if shard is None else param.data.chunk(3, dim=0)[shard]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelLoadError(f"tensor {hf_name!r}: checkpoint shape {tuple(tensor.shape)}, model expects "
                                     f"{tuple(target.shape)} (config.json does not match the weights?)")
            target.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{_SHARD_NAMES[shard]}")
        check_all_loaded(self.spec.architecture, unexpected, expected, loaded)


def _map_name(hf_name: str) -> tuple[str, int | None] | None:
    """(this model's parameter name, qkv shard or None) of a checkpoint tensor; None: not used."""
    name = hf_name
    for prefix in _MODEL_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.startswith(_UNUSED_PREFIXES) or name in _UNUSED_NAMES:
        return None
    module, _, leaf = name.rpartition(".")
    leaf = {"gamma": "weight", "beta": "bias"}.get(leaf, leaf)
    if module == "embeddings.LayerNorm":
        return f"embeddings.norm.{leaf}", None
    if module.startswith("embeddings."):
        return f"{module}.{leaf}", None
    parts = module.split(".")
    if len(parts) < 4 or parts[:2] != ["encoder", "layer"]:
        return name, None  # reported as unexpected by the caller
    layer, rest = parts[2], ".".join(parts[3:])
    if rest.startswith("attention.self.") and parts[-1] in _QKV_SHARDS:
        return f"layers.{layer}.qkv.{leaf}", _QKV_SHARDS[parts[-1]]
    ours = _LAYER_NAMES.get(rest)
    return (f"layers.{layer}.{ours}.{leaf}", None) if ours is not None else (name, None)


class RobertaModel(BertModel):
    """RoBERTa / XLM-RoBERTa encoders: BERT's layers, positions offset past the padding index."""

    position_offset_from_pad = True


class XLMRobertaModel(RobertaModel):
    pass
