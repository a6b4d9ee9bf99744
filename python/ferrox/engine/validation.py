"""The whole request check the engine runs before queueing a request: the rules of
`ferrox.request_rules` (a base module, so SamplingParams can use them too) plus the
structured-output constraint, which needs llguidance (ferrox.structured)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ferrox._core import InvalidArgumentError
from ferrox.request_rules import (
    RequestLimits,
    check_min_tokens,
    check_prompt,
    check_prompt_length,
    check_request_id,
    check_sampling_params,
    check_token_ids_in_vocab,
)

if TYPE_CHECKING:
    from ferrox.sampling_params import SamplingParams
    from ferrox.structured.params import StructuredOutputsParams

__all__ = [
    "RequestLimits",
    "check_min_tokens",
    "check_prompt",
    "check_prompt_length",
    "check_request_id",
    "check_sampling_params",
    "check_structured_outputs",
    "check_without_tokenizer",
    "check_custom_logits_params",
    "check_token_ids_in_vocab",
    "validate_request",
]


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    limits: RequestLimits,
    *,
    what: str | None = None,
    prompt_param: str = "prompt",
) -> None:
    """Every rule that needs the engine's limits. `what` names the request in messages ("prompts[2]",
    "request 'abc'"); `prompt_param` is the field the prompt came in as."""
    check_prompt(prompt_token_ids, limits, what=what, param=prompt_param)
    check_sampling_params(params, limits, num_prompt_tokens=len(prompt_token_ids))
    if not limits.has_tokenizer:
        check_without_tokenizer(params)
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs)
    check_custom_logits_params(params, limits)


def check_custom_logits_params(params: SamplingParams, limits: RequestLimits) -> None:
    """extra_args are read only by custom logits processors: refused when none is loaded; each loaded
    processor's validate_params may refuse the request (vLLM's contract: a ValueError)."""
    if params.extra_args and not limits.logits_processors:
        raise InvalidArgumentError("extra_args: only custom logits processors (--logits-processors) read them, and this "
                                   "engine loads none", param="extra_args")
    for cls in limits.logits_processors:
        try:
            cls.validate_params(params)  # type: ignore[attr-defined]  # (a LogitsProcessor subclass: base module types)
        except ValueError as exc:
            raise InvalidArgumentError(f"extra_args: {cls.__name__}: {exc}", param="extra_args") from None


def check_without_tokenizer(params: SamplingParams) -> None:
    """Under skip_tokenizer_init the engine has no text to match or constrain: the fields that need it are
    refused by name (vLLM's engine would fail on them without a tokenizer)."""
    for name, value in (("stop", params.stop), ("bad_words", params.bad_words),
                        ("structured_outputs", params.structured_outputs)):
        if value:
            raise InvalidArgumentError(f"{name}: needs the tokenizer, which this engine runs without "
                                       "(skip_tokenizer_init); use stop_token_ids for stops", param=name)


def check_structured_outputs(constraint: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """A schema / regex / grammar llguidance rejects is refused here (the check is cached by the
    constraint's text). `param` is the request field it came in as (response_format, guided_json...)."""
    from ferrox.structured.backend import validate_params  # llguidance: only for constrained requests

    try:
        validate_params(constraint, None if param == "structured_outputs" else param)
    except InvalidArgumentError:
        raise
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), param=param) from None
