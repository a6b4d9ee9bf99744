"""The request rules, in one place: what a request must satisfy before it is queued.

Every rule raises an `InvalidArgumentError` (or a subclass) whose `param` is the request field at
fault, spelled as users send it ("prompt", "max_tokens", "min_tokens", "stop", "logprobs",
"logit_bias", "structured_outputs", "request_id"). Callers map `param` to their own spelling where
it differs (the chat endpoint reports prompt problems as "messages").

Where the rules run (the edge: before anything is queued, so a refused request leaves no trace):
  - `SamplingParams.__post_init__`: each field on its own (ranges, stop strings, min_tokens <=
    max_tokens when both are given); it calls the helpers below.
  - `ferrox.engine.validation.validate_request(prompt, params, limits)`: what needs the engine's limits (prompt length
    against max_model_len and the KV cache, token ids against the vocabulary, logprobs against
    max_logprobs, min_tokens against the room a prompt leaves; there, too, the structured-output
    constraint, which needs llguidance).
    The offline engine calls it from `EngineCore.validate_prompt`, the async front-end from
    `AsyncLLM` before the request crosses to the engine-core process.
  - `check_request_id`: a live duplicate id is a DuplicateRequestError.

The Rust scheduler keeps its own checks of the same limits, but only as invariants that protect its
bookkeeping; a request that passes here passes there. The KV boundary is the same on both sides: a
prompt must leave room for at least one generated token, so a prompt of exactly
`kv_capacity_tokens` tokens is refused (as is one of exactly `max_model_len` tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrox._core import DuplicateRequestError, InvalidArgumentError, PromptTooLongError

if TYPE_CHECKING:
    from ferrox.sampling_params import SamplingParams

__all__ = [
    "RequestLimits",
    "check_min_tokens",
    "check_prompt",
    "check_prompt_length",
    "check_request_id",
    "check_sampling_params",
    "check_token_ids_in_vocab",
]


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine can take; the rules that need it read it from here."""

    max_model_len: int
    kv_capacity_tokens: int  # tokens the whole KV cache holds: (num_blocks - 1) * block_size
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_logprobs: int  # largest logprobs / prompt_logprobs a request may ask for
    # The reasoning parser's `</think>` (--reasoning-parser), or None: thinking_token_budget needs it.
    reasoning_end_token_id: int | None = None
    # The reasoning parser's name (None: no parser). A parser whose thinking does not end at one token
    # (gpt-oss's harmony, granite's text markers) cannot gate a grammar or force a budget's end.
    reasoning_parser: str | None = None
    # False under skip_tokenizer_init (loader/no_tokenizer.py): what needs text is refused by name.
    has_tokenizer: bool = True
    # --logits-processors' classes (ferrox/logits_processor.py): their validate_params checks each request,
    # and only with some loaded does a request's extra_args (vllm_xargs) mean anything.
    logits_processors: tuple[type, ...] = ()

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt accepted: one token short of both max_model_len and the KV cache."""
        return min(self.max_model_len, self.kv_capacity_tokens) - 1


# ---- the whole request ----------------------------------------------------------------------------


def check_prompt(
    prompt_token_ids: Sequence[int], limits: RequestLimits, *, what: str | None = None, param: str = "prompt"
) -> None:
    if len(prompt_token_ids) == 0:
        raise InvalidArgumentError(f"{param}: must not be empty{_of(what)}", param=param)
    check_prompt_length(len(prompt_token_ids), limits, what=what, param=param)
    check_token_ids_in_vocab(param, prompt_token_ids, limits.vocab_size, what=what)


def check_prompt_length(
    num_tokens: int, limits: RequestLimits, *, what: str | None = None, param: str = "prompt"
) -> None:
    """A prompt must leave room for at least one generated token, within max_model_len and within the
    whole KV cache (`>=` on both: the Rust scheduler refuses the same lengths)."""
    who = what or "the prompt"
    if num_tokens >= limits.max_model_len:
        raise PromptTooLongError(
            f"{param}: {who} has {num_tokens} tokens, which leaves no room for output within "
            f"max_model_len={limits.max_model_len}",
            param=param,
        )
    if num_tokens >= limits.kv_capacity_tokens:
        raise PromptTooLongError(
            f"{param}: {who} has {num_tokens} tokens but the whole KV cache holds {limits.kv_capacity_tokens}, "
            "and at least one more is needed for the output; raise kv_cache_memory (or gpu_memory_utilization) "
            "or shorten the prompt",
            param=param,
        )


def check_token_ids_in_vocab(param: str, ids: Sequence[int], vocab_size: int, *, what: str | None = None) -> None:
    if not ids:
        return
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidArgumentError(
            f"{param}: token id {bad} is outside the vocabulary [0, {vocab_size}){_of(what)}", param=param
        )


# ---- sampling parameters --------------------------------------------------------------------------


def check_sampling_params(params: SamplingParams, limits: RequestLimits, *, num_prompt_tokens: int) -> None:
    """The SamplingParams rules that need the engine's limits (the others ran at construction; the
    structured-output constraint is checked by ferrox.engine.validation, which needs llguidance)."""
    params.check_vocab(limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise InvalidArgumentError(
                f"{name}: at most {limits.max_logprobs} (the engine's max_logprobs), got {value}", param=name
            )
    if limits.reasoning_parser is not None and limits.reasoning_end_token_id is None:
        for field in ("structured_outputs", "thinking_token_budget"):
            if getattr(params, field) is not None:
                raise InvalidArgumentError(f"{field}: not supported with reasoning_parser {limits.reasoning_parser!r}: "
                                           "its thinking does not end at one token", param=field)
    if params.thinking_token_budget is not None:
        check_thinking_budget(params, limits.reasoning_end_token_id)
    if params.max_tokens is None:  # output up to max_model_len: min_tokens must fit in what the prompt leaves
        check_min_tokens(params.min_tokens, limits.max_model_len - num_prompt_tokens,
                         bound="the room the prompt leaves within max_model_len")


def check_thinking_budget(params: SamplingParams, end_token_id: int | None) -> None:
    """A budget ends the thinking by forcing the reasoning parser's `</think>`: it needs a parser, and a
    token the request may sample."""
    if end_token_id is None:
        raise InvalidArgumentError("thinking_token_budget: needs a reasoning parser to know where thinking ends "
                                   "(start the engine with --reasoning-parser / reasoning_parser=...)",
                                   param="thinking_token_budget")
    if params.allowed_token_ids is not None and end_token_id not in params.allowed_token_ids:
        raise InvalidArgumentError(f"thinking_token_budget: allowed_token_ids must include the end of thinking "
                                   f"(token {end_token_id}), which the budget forces", param="thinking_token_budget")


def check_min_tokens(min_tokens: int, max_tokens: int, *, bound: str = "max_tokens") -> None:
    if min_tokens > max_tokens:
        raise InvalidArgumentError(f"min_tokens: must be <= {bound} ({max_tokens}), got {min_tokens}",
                                   param="min_tokens")


# ---- request ids ----------------------------------------------------------------------------------


def check_request_id(request_id: str, is_live: Callable[[str], bool]) -> None:
    """Request ids are unique among unfinished requests (a finished request's id may be reused)."""
    if not request_id:
        raise InvalidArgumentError("request_id: must not be empty", param="request_id")
    if is_live(request_id):
        raise DuplicateRequestError(
            f"request_id: {request_id!r} is already live; request ids must be unique among unfinished requests",
            param="request_id",
        )


def _of(what: str | None) -> str:
    return f" ({what})" if what else ""
