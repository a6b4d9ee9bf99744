"""The default SamplingParams of a request that gives none, shared by `LLM` and `AsyncLLM`.

As vLLM does, the model's generation_config.json sampling fields (temperature, top_p, top_k,
min_p, repetition_penalty) become the defaults; whatever the model does not set keeps
SamplingParams' own default.
"""

from __future__ import annotations

import json
import os
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


def resolve_generation_defaults(choice: str, model_defaults: Mapping[str, Any],
                                override: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's generation_config engine argument (--generation-config): 'auto' the model's, 'vllm' none, else
    a folder's generation_config.json; then override_generation_config (--override-generation-config) on top."""
    if choice == "auto":
        defaults = dict(model_defaults)
    elif choice == "vllm":
        defaults = {}
    else:
        path = os.path.join(os.path.expanduser(choice), "generation_config.json")
        try:
            with open(path) as f:
                defaults = {k: v for k, v in json.load(f).items() if not k.startswith("_")}
        except (OSError, ValueError) as exc:
            raise ValueError(f"generation_config: expected 'auto', 'vllm' or a folder with a readable "
                             f"generation_config.json: {exc}") from None
    if override is not None and not isinstance(override, Mapping):
        raise ValueError(f"override_generation_config: must be a JSON object, got {override!r}")
    return {**defaults, **(override or {})}


def default_sampling_params(generation_defaults: Mapping[str, Any] | None) -> SamplingParams:
    """SamplingParams for a request that gives none: the model's generation defaults over SamplingParams'."""
    return SamplingParams(**generation_sampling_defaults(generation_defaults))
