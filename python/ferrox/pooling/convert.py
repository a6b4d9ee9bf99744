"""vLLM's --convert: how a model is adapted to run for pooling.

- "embed": a causal LM embeds with its last token's hidden state (the pooling runner's way with a decoder);
  encoders embed as they are. A sequence classifier has no embedding to give: refused.
- "classify": a causal LM of a family that has a sequence classifier in ferrox becomes it
  (Qwen3ForCausalLM -> Qwen3ForSequenceClassification); its score head is the checkpoint's score.weight, or
  rows of its LM head named by classifier_from_token (seq_cls_conversion.py: the original Qwen3-Reranker).
  Classifiers stay as they are; other architectures are refused by name.
- "none": no adaptation, so a causal LM cannot run for pooling.
- "auto": as the architecture says (encoders embed, classifiers classify, causal LMs embed under runner
  "pooling"), ferrox's behaviour before the flag.
"embed" and "classify" mean runner "pooling" (runner "auto" resolves so; "generate" is refused by the config).
"""

from __future__ import annotations

import dataclasses

from ferrox.model_spec import ModelSpec
from ferrox.models.registry import (
    CLASSIFIER_ARCHITECTURES,
    DECODER_CLASSIFIER_ARCHITECTURES,
    POOLING_ONLY_ARCHITECTURES,
)


def runner_for(runner: str, convert: str) -> str:
    """The runner the engine resolves: "embed" / "classify" under runner "auto" pool."""
    return "pooling" if runner == "auto" and convert in ("embed", "classify") else runner


def apply_convert(convert: str, runner: str, spec: ModelSpec) -> ModelSpec:
    """The spec of the model to build for this convert type (the architecture a classify conversion names);
    a conversion ferrox cannot make is a ValueError naming convert and the architecture."""
    arch = spec.architecture
    if convert == "classify":
        if arch in CLASSIFIER_ARCHITECTURES:
            return spec
        target = arch.removesuffix("ForCausalLM") + "ForSequenceClassification"
        if not arch.endswith("ForCausalLM") or target not in DECODER_CLASSIFIER_ARCHITECTURES:
            raise ValueError(f"convert: 'classify' turns a causal LM into its family's sequence classifier; "
                             f"{arch} has none here (families: "
                             f"{', '.join(sorted(a.removesuffix('ForSequenceClassification') for a in DECODER_CLASSIFIER_ARCHITECTURES))})")
        hf_config = {**spec.hf_config, "architectures": [target]}
        return dataclasses.replace(spec, architecture=target, hf_config=hf_config)
    if convert == "embed" and arch in CLASSIFIER_ARCHITECTURES:
        raise ValueError(f"convert: 'embed': {arch} is a sequence classifier (its pooling classifies); use "
                         "convert 'auto' or 'classify'")
    if convert == "none" and runner == "pooling" and arch not in POOLING_ONLY_ARCHITECTURES:
        raise ValueError(f"convert: 'none' keeps {arch} as it is, a causal LM, which pools only through the "
                         "'embed' conversion (use convert 'auto' or 'embed')")
    return spec
