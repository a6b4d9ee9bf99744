"""`use_beam_search` on /v1/completions and /v1/chat/completions (vLLM's request field).

`n` is the beam width and the choices are the n best beams, best first; `length_penalty` is the
score's exponent, `max_tokens`, `ignore_eos`, `include_stop_str_in_output` and `temperature` (which
only picks each step's sampled token, an extra candidate; unset: the model's default, else 1.0, as
vLLM) apply. The search runs as one-token requests (ferrox.beam_search), so a field that shapes how
tokens are sampled or reported in plain decoding (top_p, penalties, stop strings, logprobs, a
grammar, tools, streaming...) would be silently dropped: given with a value other than its
default, it is refused by name instead.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from ferrox.beam_search import check_beam_search
from ferrox.entrypoints.openai.errors import bad_request, from_exception
from ferrox.outputs import RequestOutput
from ferrox.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from ferrox.entrypoints.openai.serving import ServingContext

# Request fields plain decoding honours and a beam search does not.
NOT_UNDER_BEAM_SEARCH = (
    "stream", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "seed", "stop", "stop_token_ids", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
    "allowed_token_ids", "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "tools", "tool_choice", "echo", "thinking_token_budget",
    "skip_special_tokens", "logprob_token_ids",
)


def beam_search_params(ctx: ServingContext, req: Any, prompt_len: int, max_tokens: int | None) -> BeamSearchParams | None:
    """The request's BeamSearchParams, or None without use_beam_search; a 400 naming a field beam
    search would not apply."""
    if not req.use_beam_search:
        return None
    fields = type(req).model_fields
    for name in NOT_UNDER_BEAM_SEARCH:
        if name in fields and name in req.model_fields_set and getattr(req, name) != fields[name].default:
            raise bad_request(f"{name}: not applied by beam search (use_beam_search: true), so it is refused rather "
                              "than ignored", param=name)
    temperature = req.temperature
    if temperature is None:
        temperature = float(ctx.engine.generation_defaults.get("temperature", 1.0))
    try:
        params = BeamSearchParams(
            beam_width=req.n, max_tokens=max_tokens if max_tokens is not None else ctx.max_model_len - prompt_len,
            ignore_eos=req.ignore_eos, temperature=temperature, length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output)
        check_beam_search(params, prompt_len, max_model_len=ctx.max_model_len, max_logprobs=ctx.limits.max_logprobs,
                          width_param="n")
    except ValueError as exc:
        raise from_exception(exc) from None
    return params


def generate(ctx: ServingContext, prompt: dict[str, Any], params: SamplingParams, beams: BeamSearchParams | None,
             request_id: str, **kwargs: Any) -> AsyncGenerator[RequestOutput, None]:
    """The engine's outputs for one prompt: plain decoding, or (beams given) the search's one final output."""
    if beams is None:
        return ctx.engine.generate(prompt, params, request_id, **kwargs)
    return ctx.engine.beam_search(prompt, request_id, beams, **kwargs)
