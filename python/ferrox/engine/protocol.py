"""Messages between the front-end (LLM / AsyncLLM / server) and the engine core.

msgspec structs, so the same objects cross a ZMQ socket (msgpack) when the core runs in its
own process and are passed as-is when it runs in-process.
"""

from __future__ import annotations

import msgspec

from ferrox.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0


class Logprobs(msgspec.Struct, array_like=True):
    """Per generated (or prompt) position: the chosen token's logprob and rank, plus the top-N."""

    token_ids: list[int]  # the chosen token at each position
    logprobs: list[float]  # its logprob
    ranks: list[int]  # its 1-based rank in the distribution
    top_token_ids: list[list[int]]  # [positions][N]
    top_logprobs: list[list[float]]  # [positions][N]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    text_delta: str = ""
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: Logprobs | None = None  # for new_token_ids, when requested
    prompt_logprobs: Logprobs | None = None  # once, with the first output, when requested
    error: str | None = None  # set with finish_reason "error": the request failed, others go on
