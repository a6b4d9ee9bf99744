"""A causal LM's LM-head rows as a classifier head: the settings (vLLM's keys in config.json).

See pooling/seq_cls_conversion.py for the whole conversion (it looks the tokens up in the tokenizer);
models/decoder_classifier.py builds the score head from the rows while loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("from_2_way_softmax", "no_post_processing")
# Where resolve_token_ids leaves the ids in the spec's config (not a transformers key).
TOKEN_IDS_KEY = "classifier_from_token_ids"


@dataclass(frozen=True, slots=True)
class LmHeadConversion:
    method: str
    tokens: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.tokens)


def lm_head_conversion(hf_config: dict[str, Any], where: str = "config.json") -> LmHeadConversion | None:
    """The conversion config.json asks for, None for none; a malformed one is a ValueError naming its field."""
    tokens = hf_config.get("classifier_from_token")
    method = hf_config.get("method")
    if hf_config.get("is_original_qwen3_reranker"):
        if not (isinstance(tokens, list) and len(tokens) == 2):
            raise ValueError(f"{where}: is_original_qwen3_reranker needs classifier_from_token with the two tokens "
                             "[false, true] (Qwen3-Reranker's: [\"no\", \"yes\"])")
        method = "from_2_way_softmax"
    if tokens is None:  # (a lone top-level "method" is some other config's field)
        return None
    if method not in METHODS:
        raise ValueError(f"{where}: classifier_from_token: converting an LM head into a classifier needs method "
                         f"{' or '.join(METHODS)} (or is_original_qwen3_reranker true), got {method!r}")
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) and t for t in tokens)):
        raise ValueError(f"{where}: classifier_from_token must be a non-empty list of vocabulary tokens, "
                         f"got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"{where}: method 'from_2_way_softmax' takes two classifier_from_token entries "
                         f"[false, true], got {len(tokens)}")
    return LmHeadConversion(method, tuple(tokens))
