"""BERT-family sequence classifiers (cross-encoder rerankers): BertForSequenceClassification,
RobertaForSequenceClassification, XLMRobertaForSequenceClassification, transformers' maths exactly:

    h = encoder(ids, positions, token_type_ids)                 models/bert.py, every token's last hidden state
    logits = out_proj(tanh(dense(h[first token of each request])))

BERT calls the two linears `bert.pooler.dense` (its pooler) and `classifier`; RoBERTa and XLM-R call them
`classifier.dense` and `classifier.out_proj` (their encoders have no pooler). Either way the head reads the
first token (transformers' dropout between them is off at inference).

forward() returns the hidden states as an embedding encoder's does; the pooling runner then calls
classify() on them, and applies the activation (pooling/classify.py) per request on the host. A pair
prompt ([CLS] a [SEP] b [SEP]) comes with token_type_ids, 1 from b on, which the runner builds for a model
whose token-type table has more than one row (`uses_token_types`: BERT; RoBERTa's table has one).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelLoadError, ModelSpec, UnsupportedModelError
from ferrox.models.bert import BertModel, RobertaModel, XLMRobertaModel
from ferrox.models.load_check import check_all_loaded
from ferrox.pooling.classify import classifier_labels


class BertForSequenceClassification(nn.Module):
    """The encoder plus the classification head; forward() -> hidden states, classify() -> logits."""

    supports_tensor_parallel = False
    encoder_class: type[BertModel] = BertModel
    # Checkpoint name prefix -> this model's head module (longest prefixes first).
    head_names: dict[str, str] = {"bert.pooler.dense.": "dense.", "pooler.dense.": "dense.", "classifier.": "out_proj."}

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device | str, *,
                 kernels: str | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.labels = classifier_labels(spec.hf_config)
        self.num_labels = len(self.labels)
        self.encoder = self.encoder_class(spec, dtype, device, kernels=kernels)
        # A one-row table (RoBERTa, XLM-R) adds the same row to every token: no types to build.
        self.uses_token_types = int(spec.hf_config.get("type_vocab_size", 2)) > 1
        hidden = spec.hidden_size
        self.dense = nn.Linear(hidden, hidden, dtype=dtype, device=device)
        self.out_proj = nn.Linear(hidden, self.num_labels, dtype=dtype, device=device)

    @classmethod
    def max_positions(cls, spec: ModelSpec) -> int:
        return cls.encoder_class.max_positions(spec)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata, token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.encoder(input_ids, positions, kv_caches, attn_metadata, token_type_ids)

    def classify(self, hidden: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """float32 logits [num_reqs, num_labels] from the step's hidden states; starts: int [num_reqs + 1]
        row offsets of the requests (each request's first row is its [CLS] / <s>)."""
        first = hidden.index_select(0, starts[:-1].long())
        return self.out_proj(torch.tanh(self.dense(first))).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError(f"{self.spec.architecture} is a sequence classifier: it has no language-model "
                                    "head, so it cannot generate (run it with runner 'pooling')")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """The head's tensors here, the rest to the encoder (which checks its own); every head parameter
        must be set."""
        params = dict(self.named_parameters())
        head = {n for n in params if n.startswith(("dense.", "out_proj."))}
        loaded: set[str] = set()
        prefixes = sorted(self.head_names, key=len, reverse=True)

        def encoder_weights() -> Iterator[tuple[str, Any]]:
            for hf_name, tensor in weights:
                prefix = next((p for p in prefixes if hf_name.startswith(p)), None)
                if prefix is None:
                    yield hf_name, tensor
                    continue
                name = self.head_names[prefix] + hf_name[len(prefix):]
                if name not in head:
                    raise ModelLoadError(f"checkpoint has tensor {hf_name!r}, which this {self.spec.architecture} "
                                         "does not use")
                tensor = materialize(tensor)
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise ModelLoadError(f"tensor {hf_name!r}: checkpoint shape {tuple(tensor.shape)}, model "
                                         f"expects {tuple(params[name].shape)} (config.json's id2label / num_labels "
                                         "does not match the weights?)")
                params[name].data.copy_(tensor)
                loaded.add(name)

        self.encoder.load_weights(encoder_weights())
        check_all_loaded(self.spec.architecture, [], head, loaded)


class RobertaForSequenceClassification(BertForSequenceClassification):
    encoder_class = RobertaModel
    head_names = {"classifier.dense.": "dense.", "classifier.out_proj.": "out_proj."}


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    encoder_class = XLMRobertaModel
