"""The default SamplingParams of a request that gives none, shared by `LLM` and `AsyncLLM`.

As vLLM does, the model's generation_config.json sampling fields (temperature, top_p, top_k,
min_p, repetition_penalty) become the defaults; whatever the model does not set keeps
SamplingParams' own default.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrox.sampling_params import SamplingParams

# generation_config.json fields that become default sampling parameters.
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_sampling_defaults(generation_defaults: Mapping[str, Any] | None) -> dict[str, Any]:
    """The SamplingParams keyword arguments taken from a model's generation_config (numbers only:
    a null or a malformed entry is skipped, not an error at request time)."""
    return {
        key: value for key, value in (generation_defaults or {}).items()
        if key in GENERATION_DEFAULT_KEYS and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


def default_sampling_params(generation_defaults: Mapping[str, Any] | None) -> SamplingParams:
    """SamplingParams for a request that gives none: the model's generation defaults over SamplingParams'."""
    return SamplingParams(**generation_sampling_defaults(generation_defaults))
