"""Front-end bookkeeping: StepResults (per step, one row per engine request) -> RequestOutputs.

Shared by the offline `LLM` and `AsyncLLM`. It owns:
- per-request state: text and token ids so far, logprobs, finish reason, timing;
- n > 1 fan-out: a user request with n samples becomes n engine requests with ids
  `f"{i}_{request_id}"` (seed + i when seeded, so samples differ); the user request finishes when
  all its samples have;
- output kinds: CUMULATIVE (everything so far), DELTA (what is new: streaming), FINAL_ONLY;
- abort: a user request id maps to the engine ids to abort (and, for AsyncLLM, a final output
  whose unfinished samples say finish_reason "abort").

Typical use:
    core_requests = processor.add_request(request, prompt_text)   # send these to the core
    for out in processor.process_outputs(core.step()): ...         # RequestOutputs with news

Engine results arrive as `StepResult` columns (one per step); rows become RequestOutputs here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from ferrox.engine.protocol import EngineCoreRequest
from ferrox.outputs import (
    AnyRequestOutput,
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ferrox.sampling_params import RequestOutputKind
from ferrox.step_types import FINISH_REASONS, Logprobs, StepResult


@dataclass(slots=True)
class _Sample:
    """One engine request: one of the n samples of a user request."""

    index: int
    want_logprobs: bool
    # The alternatives are the request's logprob_token_ids: their rank in the distribution is not
    # computed (Logprob.rank None; the sampled token's own rank always is).
    named_logprobs: bool = False
    text: str = ""  # DELTA mode: only the text not sent yet (appending to the whole would copy it each step)
    token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # how much of token_ids was already sent (DELTA mode)
    sent_tokens: int = 0
    sent_finish: bool = False

    def __post_init__(self) -> None:
        if self.want_logprobs:
            self.logprobs = []
            self.cumulative_logprob = 0.0


@dataclass(slots=True)
class _Request:
    """A user request and its samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    samples: dict[str, _Sample]  # engine request id -> sample
    metrics: RequestMetrics
    want_prompt_logprobs: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    num_finished: int = 0
    error: str | None = None
    pooling: bool = False  # a pooling model's request: one PoolingRequestOutput, when it finishes
    pooled: npt.NDArray[np.float32] | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None = None) -> None:
        # The tokenizer is only used to decode logprob alternatives into text.
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}
        self._engine_to_user: dict[str, str] = {}
        self._token_text: dict[int, str] = {}

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, prompt: str | None = None) -> list[EngineCoreRequest]:
        """Register a user request; returns the engine requests to send (n of them when n > 1)."""
        if request.request_id in self._requests:
            raise ValueError(f"request_id: {request.request_id!r} is already in use")
        params = request.sampling_params
        if params.n == 1:
            core_requests = [request]
        else:
            core_requests = []
            for i in range(params.n):
                child_params = msgspec.structs.replace(
                    params, n=1, seed=None if params.seed is None else params.seed + i
                )
                core_requests.append(
                    msgspec.structs.replace(request, request_id=f"{i}_{request.request_id}", sampling_params=child_params)
                )
        samples = {
            r.request_id: _Sample(index=i, want_logprobs=params.num_logprobs is not None,
                                     named_logprobs=bool(params.logprob_token_ids))
            for i, r in enumerate(core_requests)
        }
        self._requests[request.request_id] = _Request(
            request_id=request.request_id,
            prompt=prompt,
            prompt_token_ids=list(request.prompt_token_ids),
            output_kind=params.output_kind,
            samples=samples,
            metrics=RequestMetrics(arrival_time=request.arrival_time or time.time()),
            want_prompt_logprobs=params.prompt_logprobs is not None,
            pooling=request.pooling_params is not None,
        )
        for r in core_requests:
            self._engine_to_user[r.request_id] = request.request_id
        return core_requests

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Forget user requests; returns the engine request ids the caller must abort in the core."""
        engine_ids: list[str] = []
        for request_id in request_ids:
            req = self._requests.pop(request_id, None)
            if req is None:
                continue
            for engine_id, sample in req.samples.items():
                self._engine_to_user.pop(engine_id, None)
                if sample.finish_reason is None:
                    engine_ids.append(engine_id)
        return engine_ids

    def finish_aborted(self, request_ids: Iterable[str]) -> tuple[list[str], list[AnyRequestOutput]]:
        """Abort user requests and say so: every unfinished sample ends with finish_reason "abort".
        Returns the engine ids to abort in the core and one final RequestOutput per known request
        (per its output kind: the last delta, or everything so far), as vLLM yields on abort."""
        engine_ids: list[str] = []
        outputs: list[AnyRequestOutput] = []
        now = time.time()
        for request_id in request_ids:
            req = self._requests.get(request_id)
            if req is None:
                continue
            for engine_id, sample in req.samples.items():
                if sample.finish_reason is None:
                    engine_ids.append(engine_id)
                    sample.finish_reason = "abort"
                    req.num_finished += 1
            req.metrics.finished_time = now
            ro = self._make_output(req)
            if ro is not None:
                outputs.append(ro)
            del self._requests[request_id]
            for engine_id in req.samples:
                self._engine_to_user.pop(engine_id, None)
        return engine_ids, outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- outputs --------------------------------------------------------------------------------------
    def process_outputs(self, results: StepResult | Iterable[StepResult]) -> list[AnyRequestOutput]:
        """Fold step results (columns) into request state; returns a RequestOutput for each user
        request with something to report (per its output kind), finished ones last removed."""
        now = time.time()
        touched: dict[str, _Request] = {}
        for result in [results] if isinstance(results, StepResult) else results:
            self._apply(result, now, touched)
        out: list[AnyRequestOutput] = []
        for req in touched.values():
            ro = self._make_output(req)
            if ro is not None:
                out.append(ro)
            if req.finished:
                req.metrics.finished_time = now
                del self._requests[req.request_id]
                for engine_id in req.samples:
                    self._engine_to_user.pop(engine_id, None)
        return out

    def _apply(self, result: StepResult, now: float, touched: dict[str, _Request]) -> None:
        if not len(result):
            return
        token_ids = result.token_ids.tolist()
        tok_off = result.token_offsets.tolist()
        text, txt_off = result.text, result.text_offsets.tolist()
        finish = result.finish_reasons.tolist()
        cached = result.num_cached_tokens.tolist()
        for i, engine_id in enumerate(result.req_ids):
            user_id = self._engine_to_user.get(engine_id)
            if user_id is None:
                continue  # aborted by the front-end meanwhile
            req = self._requests[user_id]
            sample = req.samples[engine_id]
            touched[user_id] = req
            if tok_off[i + 1] > tok_off[i]:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.last_token_time = now
                sample.token_ids.extend(token_ids[tok_off[i] : tok_off[i + 1]])
            if txt_off[i + 1] > txt_off[i]:
                sample.text += text[txt_off[i] : txt_off[i + 1]]
            if cached[i]:
                req.num_cached_tokens = max(req.num_cached_tokens, cached[i])
            lp = result.logprobs.get(i) if result.logprobs else None
            if lp is not None and sample.logprobs is not None:
                self._append_logprobs(sample, lp)
            plp = result.prompt_logprobs.get(i) if result.prompt_logprobs else None
            if plp is not None and req.want_prompt_logprobs and req.prompt_logprobs is None:
                req.prompt_logprobs = [None] + self._logprob_dicts(plp)
            if finish[i] and sample.finish_reason is None:
                sample.finish_reason = FINISH_REASONS[finish[i]] or "stop"
                sample.stop_reason = result.stop_reasons.get(i)
                req.num_finished += 1
                error = result.errors.get(i)
                if error is not None:
                    req.error = error
            if req.pooling and result.pooled:
                vector = result.pooled_vector(i)
                if vector is not None:
                    req.pooled = vector

    def _append_logprobs(self, sample: _Sample, lp: Logprobs) -> None:
        assert sample.logprobs is not None and sample.cumulative_logprob is not None
        sample.logprobs.extend(self._logprob_dicts(lp, ranked=not sample.named_logprobs))
        sample.cumulative_logprob += sum(lp.logprobs)

    def _logprob_dicts(self, lp: Logprobs, *, ranked: bool = True) -> list[dict[int, Logprob]]:
        """Per position {token id: Logprob}: the alternatives in order (ranked: the top-N, rank = place;
        else named ids, rank None), then the sampled token with its own rank."""
        dicts: list[dict[int, Logprob]] = []
        for tok, logprob, rank, top_ids, top_lps in zip(
            lp.token_ids, lp.logprobs, lp.ranks, lp.top_token_ids, lp.top_logprobs, strict=True
        ):
            d = {t: Logprob(v, r if ranked else None, self._decode(t))
                 for r, (t, v) in enumerate(zip(top_ids, top_lps, strict=True), start=1)}
            d[tok] = Logprob(logprob, rank, self._decode(tok))
            dicts.append(d)
        return dicts

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _make_output(self, req: _Request) -> AnyRequestOutput | None:
        if req.pooling:
            return self._pooling_output(req)
        kind = req.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not req.finished:
            return None
        completions: list[CompletionOutput] = []
        for sample in req.samples.values():
            if kind == RequestOutputKind.DELTA:
                new_text = sample.text
                new_tokens = sample.token_ids[sample.sent_tokens :]
                newly_finished = sample.finish_reason is not None and not sample.sent_finish
                if not new_tokens and not new_text and not newly_finished:
                    continue
                logprobs = None
                if sample.logprobs is not None:
                    logprobs = sample.logprobs[sample.sent_tokens :]
                completions.append(
                    CompletionOutput(
                        sample.index, new_text, new_tokens, sample.cumulative_logprob, logprobs,
                        sample.finish_reason, sample.stop_reason,
                    )
                )
                sample.text = ""
                sample.sent_tokens = len(sample.token_ids)
                sample.sent_finish = sample.finish_reason is not None
            else:
                completions.append(
                    CompletionOutput(
                        sample.index, sample.text, list(sample.token_ids), sample.cumulative_logprob,
                        list(sample.logprobs) if sample.logprobs is not None else None,
                        sample.finish_reason, sample.stop_reason,
                    )
                )
        if not completions and not req.finished:
            return None
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs,
            outputs=completions,
            finished=req.finished,
            num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics,
            error=req.error,
        )

    @staticmethod
    def _pooling_output(req: _Request) -> PoolingRequestOutput | None:
        """Only the final output: a vector is whole or absent (an error or abort leaves it empty)."""
        if not req.finished:
            return None
        data = req.pooled if req.pooled is not None else np.zeros(0, dtype=np.float32)
        error = req.error
        if req.pooled is None and error is None:
            aborted = any(s.finish_reason == "abort" for s in req.samples.values())
            error = "request aborted" if aborted else "the engine returned no vector"
        return PoolingRequestOutput(request_id=req.request_id, outputs=PoolingOutput(data),
                                    prompt_token_ids=req.prompt_token_ids, finished=True,
                                    num_cached_tokens=req.num_cached_tokens, error=error)
