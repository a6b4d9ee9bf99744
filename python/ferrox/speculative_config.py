"""`speculative_config`: vLLM's spelling of speculative decoding settings, checked in one place.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    LLM(speculative_config={"method": "draft_model", "model": "/path/to/small", "num_speculative_tokens": 4})
    LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2})     (the checkpoint's own MTP layer)
    ferrox serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    ferrox serve --spec-method ngram --spec-tokens 4      (vLLM's shorthands for those keys)

EngineConfig keeps the user's dict (so it stays JSON for the tensor-parallel workers' config); this
module turns it into a typed SpeculativeConfig, raising ValueError naming the key at fault. It imports
no torch (the API server process reads EngineConfig too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
# vLLM's older per-family names of "mtp" for the families ferrox drafts with their MTP layer.
MTP_ALIASES = ("qwen3_next_mtp", "qwen3_5_mtp", "deepseek_mtp", "glm4_moe_mtp", "nemotron_h_mtp")
# The core's defaults (rust/ngram.rs), stated once here for the config's own checks.
DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 5
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")
# vLLM's shorthand arguments (--spec-method, --spec-model, --spec-tokens) -> the key each one sets.
SPEC_SHORTHANDS = {"spec_method": "method", "spec_model": "model", "spec_tokens": "num_speculative_tokens"}


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None  # the draft model (method "draft_model"; "mtp": the target's own path, or None)


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """None / {} -> None (off). A dict as vLLM takes it -> SpeculativeConfig; anything else, an unknown
    key or a bad value -> ValueError starting with 'speculative_config'."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a dict (JSON object), got {type(value).__name__}")
    if not value:
        return None
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(_KEYS)}")
    model = value.get("model")
    # vLLM infers the method from the model when it is left out ("ngram" was once spelled as a model).
    method = value.get("method") or ("ngram" if model in (None, "ngram", "[ngram]") else "draft_model")
    if method in MTP_ALIASES:
        method = "mtp"
    if method not in METHODS:
        raise ValueError(f"speculative_config.method: {method!r} is not one of {', '.join(METHODS)}")
    if model in ("ngram", "[ngram]"):
        model = None
    k = value.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(f"speculative_config.num_speculative_tokens: must be a positive integer, got {k!r}")
    lo: Any = value.get("prompt_lookup_min", DEFAULT_PROMPT_LOOKUP_MIN)
    hi: Any = value.get("prompt_lookup_max", max(DEFAULT_PROMPT_LOOKUP_MAX, lo) if isinstance(lo, int) else lo)
    for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"speculative_config.{name}: must be a positive integer, got {v!r}")
    if lo > hi:
        raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is larger than prompt_lookup_max ({hi})")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft model's path")
    if method == "mtp" and {"prompt_lookup_min", "prompt_lookup_max"} & set(value):
        raise ValueError("speculative_config.prompt_lookup_min / prompt_lookup_max: n-gram settings; method 'mtp' "
                         "drafts with the checkpoint's MTP layer")
    elif model is not None and method == "ngram":
        raise ValueError(f"speculative_config.model: method 'ngram' takes no model (got {model!r})")
    return SpeculativeConfig(method, k, lo, hi, model)


def with_spec_shorthands(value: Any, shorthands: dict[str, Any]) -> Any:
    """`value` (speculative_config) with vLLM's --spec-method / --spec-model / --spec-tokens (LLM(spec_method=...))
    set as its method / model / num_speculative_tokens keys, starting from {} when it is unset; a key given both
    ways is refused, as vLLM refuses it. Shorthands that are None are left out."""
    given = {name: v for name, v in shorthands.items() if v is not None}
    if not given:
        return value
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"speculative_config: must be a dict (JSON object), got {type(value).__name__}")
    merged = dict(value or {})
    for name, v in given.items():
        key = SPEC_SHORTHANDS[name]
        if key in merged:
            raise ValueError(f"{name} (--{name.replace('_', '-')}) and speculative_config[{key!r}] are mutually "
                             "exclusive")
        merged[key] = v
    return merged


def verify_len(value: Any) -> int:
    """Query tokens of a speculative verify step (k drafts + the last sampled token) for the
    speculative_config `value`, 0 without speculation: the verify CUDA graphs' shape."""
    spec = parse_speculative_config(value)
    return spec.num_speculative_tokens + 1 if spec is not None else 0
