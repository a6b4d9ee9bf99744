"""Decoder sequence classifiers (reward models such as Skywork-Reward-Llama-3.1-8B, Qwen2.5-Math-RM-style
classifiers, decoder rerankers): Llama/Mistral/Qwen2/Qwen3/Gemma2 `*ForSequenceClassification`, transformers'
GenericForSequenceClassification maths:

    h = decoder(ids, positions)                        the family's causal stack and final norm (models/llama.py,
                                                       models/qwen.py, models/gemma2.py)
    logits = score(h[last token of each request])     one linear [num_labels, hidden], no bias

The checkpoint names the decoder `model.*`, as the causal LM's does, and the head `score.weight`; there is no
lm_head. So the family's causal-LM class is built as it is (its layers, its load_weights and finalize_weights:
merged projections, Gemma's norm fold) but tied, which allocates no vocab x hidden head, and only
`score.weight` is taken out of the checkpoint here. Gemma 2's final logit soft cap belongs to its LM head and
is not applied (transformers applies the score to the hidden states directly).

transformers reads the last token that is not pad_token_id, since its batches are padded; ferrox never pads,
so each request's last token is read, as vLLM reads it (the two differ only for a prompt ending in the pad
token). The head runs in float32 on the upcast hidden states, as vLLM runs a pooling model's head by default.

The pooling runner runs these with empty KV caches and the attention stays causal, as for a decoder used as
an embedder (worker/pooling_runner.py); forward() returns the hidden states and the runner calls classify().
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.gemma2 import Gemma2ForCausalLM
from ferrox.models.llama import LlamaForCausalLM, MistralForCausalLM
from ferrox.models.lm_head_conversion import TOKEN_IDS_KEY, lm_head_conversion
from ferrox.models.load_check import check_all_loaded
from ferrox.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM
from ferrox.pooling.classify import classifier_labels

_HEAD = "score.weight"
# A causal LM converted into a classifier (pooling/seq_cls_conversion.py: the original Qwen3-Reranker) has no
# score.weight: its head is made of these rows (the LM head's, or the embedding's when they are tied).
_LM_HEAD, _EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


class DecoderForSequenceClassification(nn.Module):
    """The family's decoder plus the score head; forward() -> hidden states, classify() -> logits."""

    decoder_class: type[LlamaForCausalLM] = LlamaForCausalLM
    # A pooling model runs on one rank (pooling/config.py refuses tensor_parallel_size > 1 for it).
    supports_tensor_parallel = False
    # One text or a pair read as one sequence: a decoder has no token-type table.
    uses_token_types = False

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None) -> None:
        super().__init__()
        self.conversion = lm_head_conversion(spec.hf_config)
        self.conversion_ids: list[int] = list(spec.hf_config.get(TOKEN_IDS_KEY) or [])
        if self.conversion is not None and len(self.conversion_ids) != len(self.conversion.tokens):
            raise ModelLoadError("classifier_from_token: the tokens' ids were not looked up in the tokenizer "
                                 "(pooling/seq_cls_conversion.resolve_token_ids runs at engine start-up)")
        self.spec = spec
        self.labels = classifier_labels(spec.hf_config)
        self.num_labels = len(self.labels)
        self.decoder = self.decoder_class(dataclasses.replace(spec, tie_word_embeddings=True), dtype, device,
                                          kernels=kernels)
        self.score = nn.Linear(spec.hidden_size, self.num_labels, bias=False, dtype=torch.float32, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, attn_metadata)

    def classify(self, hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_reqs, num_labels] from the step's hidden states; starts: int [num_reqs + 1]
        row offsets of the requests (each request's last row is the one the head reads)."""
        last = hidden.index_select(0, starts[1:].long() - 1)
        return F.linear(last.float(), self.score.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError(f"{self.spec.architecture} is a sequence classifier: it has no language-model "
                                    "head, so it cannot generate (run it with runner 'pooling')")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """score.weight here, every other tensor to the decoder (which checks its own: a score.bias, which
        transformers' head never has, is reported there as unused)."""
        loaded: set[str] = set()
        if self.conversion is not None:
            self._load_converted(weights)
            return

        def decoder_weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name != _HEAD:
                    yield name, tensor
                    continue
                tensor = materialize(tensor)
                if tuple(tensor.shape) != tuple(self.score.weight.shape):
                    raise ModelLoadError(f"tensor {name!r}: checkpoint shape {tuple(tensor.shape)}, model expects "
                                         f"{tuple(self.score.weight.shape)} (config.json's id2label / num_labels "
                                         "does not match the weights?)")
                self.score.weight.data.copy_(tensor)
                loaded.add(name)

        self.decoder.load_weights(decoder_weights())
        check_all_loaded(self.spec.architecture, [], {_HEAD}, loaded)

    def _load_converted(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The decoder's tensors to the decoder; the score head from the classifier tokens' LM-head rows
        (from_2_way_softmax: one row, true minus false, in float32 as vLLM computes it)."""
        head_name = _EMBEDDING if self.spec.tie_word_embeddings else _LM_HEAD
        rows: list[torch.Tensor] = []

        def decoder_weights() -> Iterator[tuple[str, Any]]:
            for name, tensor in weights:
                if name == head_name:
                    tensor = materialize(tensor)
                    rows.append(tensor[self.conversion_ids].float())
                if name != _LM_HEAD:
                    yield name, tensor

        self.decoder.load_weights(decoder_weights())
        if not rows:
            raise ModelLoadError(f"classifier_from_token: the checkpoint has no {head_name!r} to take the "
                                 "classifier's rows from")
        picked = rows[0]
        if self.conversion is not None and self.conversion.method == "from_2_way_softmax":
            picked = picked[1:2] - picked[0:1]  # [false, true]: logit(true) - logit(false)
        self.score.weight.data.copy_(picked)

    def finalize_weights(self) -> None:
        self.decoder.finalize_weights()
        # On the CPU the tied causal LM keeps a column-major copy of the embedding as its LM head; a
        # classifier never computes vocabulary logits, so the copy goes.
        self.decoder.lm_head_colmajor = None


class LlamaForSequenceClassification(DecoderForSequenceClassification):
    decoder_class = LlamaForCausalLM


class MistralForSequenceClassification(DecoderForSequenceClassification):
    decoder_class = MistralForCausalLM


class Qwen2ForSequenceClassification(DecoderForSequenceClassification):
    decoder_class = Qwen2ForCausalLM


class Qwen3ForSequenceClassification(DecoderForSequenceClassification):
    decoder_class = Qwen3ForCausalLM


class Gemma2ForSequenceClassification(DecoderForSequenceClassification):
    decoder_class = Gemma2ForCausalLM
