"""Beam search over the engine's one-token steps (vLLM's algorithm and scores).

Beam search keeps the `beam_width` most likely continuations of a prompt. ferrox runs it as vLLM
does, above the engine rather than inside it: every step, each live beam is a request for one token
with the top `2 * beam_width` logprobs (prompt = the original prompt + the beam's tokens so far). The
prefix cache holds every beam's earlier tokens, so a step computes little more than one new token
per beam. The candidates are each beam's reported tokens (the top 2 * beam_width, plus the sampled
one when it is not among them); each scores its beam's cumulative logprob plus its own. A candidate
that is an end-of-sequence token (unless ignore_eos) finishes its beam; of the others, the
beam_width best by score go on. The search ends after max_tokens steps or when no beam is left,
and returns the beam_width best of the finished and the live beams.

The score is vLLM's (after transformers'): cumulative logprob / length ** length_penalty, where the
length counts the prompt and the beam's tokens, less a final end-of-sequence token. length_penalty
> 1 favours longer sequences, < 1 shorter ones. The logprobs are the model's raw ones (before
temperature), as the engine reports them; temperature only changes which token a step samples, and
so which extra candidate it may add.

`BeamSearch` is one prompt's search: it holds the beams, says what to run next (`step_prompts`, each
with `one_token_params`) and takes each beam's step output (`advance`). The offline LLM and the
async engine drive it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ferrox.errors import InvalidArgumentError
from ferrox.outputs import CompletionOutput, Logprob, RequestOutput
from ferrox.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["BeamSearch", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_score"]


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` are the prompt's and the beam's (vLLM's shape); `logprobs` the reported
    logprobs of each step; `text` is filled when the search ends."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best beam_width sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: Sequence[int], cum_logprob: float, eos_token_ids: Collection[int],
               length_penalty: float = 1.0) -> float:
    length = len(tokens)
    if tokens and tokens[-1] in eos_token_ids:
        length -= 1
    return cum_logprob / (max(length, 1) ** length_penalty)


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int],
                 lora_request: Any = None) -> None:
        self.params = params
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids), lora_request=lora_request)]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def step_prompts(self) -> list[list[int]]:
        """The token ids of each live beam's next request, in beam order."""
        return [beam.tokens for beam in self.beams]

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_score(beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty)

    def advance(self, step_logprobs: Sequence[dict[int, Logprob] | None]) -> None:
        """Each live beam's reported logprobs of its one step (None: the request ended without a token)."""
        if len(step_logprobs) != len(self.beams):
            raise ValueError(f"advance: {len(step_logprobs)} step outputs for {len(self.beams)} beams")
        candidates: list[BeamSearchSequence] = []
        for beam, logprobs in zip(self.beams, step_logprobs, strict=True):
            for token_id, logprob in (logprobs or {}).items():
                new = BeamSearchSequence(tokens=[*beam.tokens, token_id], logprobs=[*beam.logprobs, logprobs or {}],
                                         cum_logprob=beam.cum_logprob + logprob.logprob,
                                         lora_request=beam.lora_request)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    candidates.append(new)
        candidates.sort(key=self._score, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best sequences, finished or not (those cut by max_tokens end with "length")."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(self.completed + self.beams, key=self._score, reverse=True)
        return ranked[: self.params.beam_width]

    def text_of(self, ids: Sequence[int], decode: Callable[[Sequence[int], bool], str]) -> str:
        """A beam's text (decode(ids, skip_special_tokens)): a final end-of-sequence token's text only with
        include_stop_str_in_output (as a stop's text in plain decoding)."""
        if ids and ids[-1] in self.eos_token_ids and not self.params.ignore_eos:
            text = decode(ids[:-1], True)
            return text + decode(ids[-1:], False) if self.params.include_stop_str_in_output else text
        return decode(ids, True)

    def request_output(self, request_id: str, prompt: str | None,
                       decode: Callable[[Sequence[int], bool], str]) -> RequestOutput:
        """The search's result in the engine's output shape (the API routes'): one output per beam, best
        first, with the beam's own tokens and text, as vLLM's server reports it."""
        outputs = []
        for i, beam in enumerate(self.best()):
            ids = beam.tokens[self.prompt_len:]
            outputs.append(CompletionOutput(index=i, text=self.text_of(ids, decode), token_ids=ids,
                                            cumulative_logprob=beam.cum_logprob, logprobs=None,
                                            finish_reason=beam.finish_reason, stop_reason=beam.stop_reason))
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
                             prompt_logprobs=None, outputs=outputs, finished=True)


def one_token_params(params: BeamSearchParams) -> SamplingParams:
    """A beam's step: one token, its top 2 * beam_width logprobs (EOS may be one of them: the search,
    not the engine, ends beams), no text (the search decodes its results once)."""
    return SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                          ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)


def step_logprobs(out: RequestOutput) -> dict[int, Logprob] | None:
    """A beam's one-token step: the logprobs it reported (None if it produced no token)."""
    comp = out.outputs[0]
    return comp.logprobs[0] if comp.logprobs else None


def check_beam_search(params: BeamSearchParams, prompt_len: int, *, max_model_len: int, max_logprobs: int,
                      width_param: str = "beam_width", what: str = "") -> None:
    """What the engine's limits allow: every step asks for 2 * beam_width logprobs, and the longest beam
    (prompt + max_tokens) must fit in max_model_len. InvalidArgumentError naming the field."""
    if 2 * params.beam_width > max_logprobs:
        raise InvalidArgumentError(
            f"{width_param}: beam search asks each step for the top 2 * beam width logprobs, and the engine returns "
            f"at most {max_logprobs} (its max_logprobs), so the beam width is at most {max_logprobs // 2}, got "
            f"{params.beam_width}", param=width_param)
    if prompt_len + params.max_tokens > max_model_len:
        raise InvalidArgumentError(
            f"max_tokens: {what}prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) is more than "
            f"max_model_len ({max_model_len})", param="max_tokens")
