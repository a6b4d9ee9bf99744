"""A causal LM served as a sequence classifier from rows of its LM head (vLLM's online conversion).

Rerankers trained as chat models answer a fixed question with a token: the original Qwen3-Reranker writes
"yes" or "no", bge-reranker-v2-gemma "Yes". Their checkpoints are causal LMs with no score head, and vLLM
serves them as classifiers by reading the head off the LM head (its documented command for Qwen3-Reranker):

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

config.json (with the overrides) says how, in vLLM's keys:
- `classifier_from_token`: vocabulary entries (token strings, looked up as they are, not encoded);
- `method` "from_2_way_softmax" (two tokens [false, true]): one label whose logit is
  lm_head[true] - lm_head[false], so its sigmoid is the softmax of the two tokens' logits, P(true);
  `is_original_qwen3_reranker` true means this method;
- `method` "no_post_processing": one label per token, each the token's own LM-head row.
The token strings become ids here, where the tokenizer is at hand (resolve_token_ids); the classifier
(models/decoder_classifier.py) builds its score head from those rows while loading.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ferrox.model_spec import ModelSpec
from ferrox.models.lm_head_conversion import TOKEN_IDS_KEY, lm_head_conversion
from ferrox.models.registry import DECODER_CLASSIFIER_ARCHITECTURES


def resolve_token_ids(spec: ModelSpec, tokenizer: Any) -> ModelSpec:
    """The spec with the conversion's token ids in its config (TOKEN_IDS_KEY) and its label count (so the
    pooler's activation follows: one label, sigmoid); unchanged without a conversion."""
    conversion = lm_head_conversion(spec.hf_config)
    if conversion is None:
        return spec
    if spec.architecture not in DECODER_CLASSIFIER_ARCHITECTURES:
        raise ValueError(f"classifier_from_token: converts a causal LM into a sequence classifier, but the "
                         f"architecture is {spec.architecture}; name the family's classifier as vLLM's command "
                         "does (--hf-overrides '{\"architectures\": [\"Qwen3ForSequenceClassification\"], ...}'), one of "
                         f"{', '.join(sorted(DECODER_CLASSIFIER_ARCHITECTURES))}")
    if tokenizer is None:
        raise ValueError("classifier_from_token: the tokens are looked up in the tokenizer's vocabulary, so "
                         "skip_tokenizer_init must be off")
    ids = []
    for token in conversion.tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of this tokenizer's vocabulary "
                             "(entries are looked up as they are, not encoded)")
        ids.append(int(token_id))
    hf_config = {k: v for k, v in spec.hf_config.items() if k not in ("id2label", "label2id")}
    return dataclasses.replace(spec, hf_config={**hf_config, TOKEN_IDS_KEY: ids, "num_labels": conversion.num_labels})
