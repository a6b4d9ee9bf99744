"""What the front-end measures per request, from the step results as they arrive.

The engine core reports tokens, not times; the front-end stamps them. For each engine request it
keeps a `RequestTiming` (added when the request is sent to its core) and, per output batch of one
core, fills an `IterationStats`: whole prompts of requests whose first token came (vLLM counts a
prompt once, cached part included, when its prefill completes; the cached part is counted apart),
new tokens, time to first token, inter-token gaps, and the requests that finished.

The phases follow vLLM's definitions: queue = handed to the core -> first scheduled; prefill =
first scheduled -> first token; decode = first token -> last token; inference = prefill + decode.
"First scheduled" is the start of the core step that produced the request's first token
(`EngineCoreOutputs.step_start`): exact when the prompt fits one step's token budget; for a prompt
prefilled in several chunks it is the last chunk's step, so queue time then includes the earlier
chunks and prefill time leaves them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ferrox.step_types import FINISH_REASONS, StepResult


@dataclass(slots=True)
class RequestTiming:
    """One engine request's clock readings (seconds since the epoch) and token counts."""

    arrival_time: float  # the user request arrived (before its prompt was tokenized)
    num_prompt_tokens: int = 0
    queued_time: float | None = None  # sent to its engine core
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0
    n: int = 1  # the user request's n (its samples are engine requests of their own)
    max_tokens: int | None = None  # the request's max_tokens, resolved (None: a pooling request)


def request_timing(request: Any, max_model_len: int, queued_time: float) -> RequestTiming:
    """A fresh clock for one engine request of the user `request` (an EngineCoreRequest as the user sent it,
    before n > 1 split it): its arrival, prompt length, n and max_tokens resolved against the context
    (None for a pooling request)."""
    params, prompt_len = request.sampling_params, len(request.prompt_token_ids)
    if request.pooling_params is not None:
        max_tokens = None
    else:
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - prompt_len
    return RequestTiming(request.arrival_time, prompt_len, queued_time, n=params.n, max_tokens=max_tokens)


@dataclass(slots=True)
class FinishedRequestStats:
    engine: int
    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float
    n: int = 1
    max_tokens: int | None = None
    queue_time: float | None = None  # None: the request never produced a token
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None
    time_per_output_token: float | None = None  # decode time per token after the first
    time_to_first_token: float | None = None  # arrival -> first token
    request_id: str = ""  # the engine request's id
    arrival_time: float = 0.0  # seconds since the epoch, as finish_time
    finish_time: float = 0.0


@dataclass(slots=True)
class IterationStats:
    """What one output batch of one engine core brought."""

    engine: int
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Of num_cached_tokens, those loaded from the host tier (vLLM's external KV transfer).
    num_external_cached_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    # (gap per token, tokens): a gap that brought several tokens is shared evenly between them
    inter_token_latencies: list[tuple[float, int]] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives what the front-end measures (Prometheus metrics, the periodic log line)."""

    def on_scheduler_stats(self, stats: dict[str, Any]) -> None:
        """The engine's latest stats (ferrox.engine.dp_client.aggregate_stats: totals, plus each
        core's own snapshot under "engines")."""

    def on_iteration(self, stats: IterationStats) -> None: ...


def observe(timings: dict[str, RequestTiming], engine: int, result: StepResult, step_start: float,
            now: float, iteration: IterationStats) -> None:
    """Fold one StepResult of core `engine` into `iteration`; finished requests leave `timings`."""
    if not len(result):
        return
    num_tokens = np.diff(result.token_offsets).tolist()
    finish = result.finish_reasons.tolist()
    cached = result.num_cached_tokens.tolist()
    external = result.num_external_cached_tokens.tolist()
    for rid, n, code, num_cached, num_external in zip(result.req_ids, num_tokens, finish, cached, external,
                                                      strict=True):
        timing = timings.get(rid)
        if timing is None:
            continue
        if n:
            if timing.first_token_time is None:
                timing.first_token_time = now
                timing.scheduled_time = step_start
                iteration.time_to_first_tokens.append(now - timing.arrival_time)
                iteration.num_prompt_tokens += timing.num_prompt_tokens
                iteration.num_cached_tokens += num_cached
                iteration.num_external_cached_tokens += num_external
            elif timing.last_token_time is not None:
                iteration.inter_token_latencies.append(((now - timing.last_token_time) / n, n))
            timing.last_token_time = now
            timing.num_generation_tokens += n
            iteration.num_generation_tokens += n
        if code:
            del timings[rid]
            iteration.finished.append(finished_stats(timing, engine, FINISH_REASONS[code] or "stop", now, rid))


def finished_stats(timing: RequestTiming, engine: int, finish_reason: str, now: float,
                   request_id: str = "") -> FinishedRequestStats:
    stats = FinishedRequestStats(
        engine=engine,
        finish_reason=finish_reason,
        num_prompt_tokens=timing.num_prompt_tokens,
        num_generation_tokens=timing.num_generation_tokens,
        e2e_latency=max(0.0, now - timing.arrival_time),
        n=timing.n,
        max_tokens=timing.max_tokens,
        request_id=request_id,
        arrival_time=timing.arrival_time,
        finish_time=now,
    )
    first, last, scheduled = timing.first_token_time, timing.last_token_time, timing.scheduled_time
    if first is not None:
        stats.time_to_first_token = max(0.0, first - timing.arrival_time)
    if first is not None and last is not None and scheduled is not None:
        stats.queue_time = max(0.0, scheduled - (timing.queued_time or timing.arrival_time))
        stats.prefill_time = max(0.0, first - scheduled)
        stats.decode_time = max(0.0, last - first)
        stats.inference_time = max(0.0, last - scheduled)
        if timing.num_generation_tokens > 1:
            stats.time_per_output_token = stats.decode_time / (timing.num_generation_tokens - 1)
    return stats
