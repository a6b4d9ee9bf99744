"""AsyncLLM: the asyncio front-end of an engine core running in its own process.

    engine = AsyncLLM()                       # or AsyncLLM(model="path", max_model_len=2048, ...)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)
    await engine.abort("req-1"); engine.shutdown()

Tokenization happens here (the front-end), so the core process spends its GIL on stepping. Long
prompts go to a small thread pool (`run_in_prompt_pool`), never the event loop: a 200k-character
prompt takes tens of milliseconds to encode (and chat rendering is pure Python), which must not
stall other requests' streams or /health. The tokenizer's encode releases the GIL. Short ones
(`prompt_work`) run inline: while the loop is busy streaming, a pool thread waits for the GIL to
start and for the loop to take its result back, which cost a burst of short requests 5-7 ms each
at the median (benches/bench_prompt_admission.py) while encoding a few hundred characters takes a
fraction of a millisecond.
The shared `OutputProcessor` (also used by the offline LLM) fans n > 1 out into n engine
requests and folds the core's outputs into RequestOutputs; the single output-reader task
hands each to its request's `_Stream`, which wakes the consumer. The n samples of a request go
to the core together: it registers a prompt's full blocks in the prefix cache when it allocates
them, so the samples scheduled after the first in the same step already hit them (computing the
prompt once); holding the siblings back until the first has output would only delay them.

`abort(request_id)` ends the request's generator with a final output whose unfinished choices
say finish_reason "abort".

Admission and time limits (off unless set; `ferrox serve` sets them from its flags):
`max_num_queued_reqs` caps the samples in flight here (waiting + running, n > 1 counting n; vLLM's
--max-num-queued-reqs): past it `generate` raises EngineOverloadedError before anything is queued,
so an overloaded server refuses at once instead of growing its queue without bound. The count is
taken and released in `generate` itself, with no await between the check and the count, so a burst
cannot slip past it. `max_num_queued_tokens` (vLLM's --max-num-queued-tokens, a TTFT bound) refuses the
same way while the prompts still in prefill (admitted, no output yet; n > 1 counting each sample's
prompt, as vLLM does) hold that many tokens or more: their whole prompt length, prefix-cache hits and
chunks already computed included, which errs towards refusing early. `request_timeout` aborts a
request that is still unfinished that many seconds after it arrived (a timer, so it fires even while
its consumer is blocked writing to a slow client): the core frees its KV blocks and the generator
raises RequestTimeoutError.

Closing the generator early (a client disconnect cancels the handler task) aborts the
request in the core, which frees its KV blocks on its next loop iteration.

With `data_parallel_size=N` the same front-end drives N engine cores (ferrox.engine.dp_client):
each request goes to one of them, chosen by load and prompt prefix; stats and metrics are kept per
core and merged; the death of any core is the engine's death.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import uuid
import weakref
from collections.abc import AsyncGenerator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ferrox.bad_words import with_bad_words_token_ids
from ferrox.beam_search import BeamSearch, check_beam_search, one_token_params, step_logprobs
from ferrox.config import MM_MODALITIES, EngineConfig
from ferrox.engine import validation
from ferrox.engine.core_process import EngineCoreOutputs
from ferrox.engine.defaults import default_sampling_params, resolve_generation_defaults
from ferrox.engine.dp_client import DPCoreClient
from ferrox.engine.input_processor import (
    INLINE_PROMPT_SIZE,
    ProcessedPrompt,
    attach_images,
    process_prompt,
    prompt_size,
    refuse_images,
)
from ferrox.engine.lora_state import check_lora_request, lora_fields
from ferrox.engine.output_log import OutputLog
from ferrox.engine.output_processor import OutputProcessor
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import EngineDeadError, EngineStartupError, InvalidArgumentError, RequestError
from ferrox.logits_processor import load_logits_processors
from ferrox.metrics.log_stats import LoggingStatLogger
from ferrox.metrics.request_stats import (
    IterationStats,
    RequestTiming,
    StatLogger,
    finished_stats,
    observe,
    request_timing,
)
from ferrox.metrics.tracing import RequestTracer, check_tracing_available, trace_headers_var
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.shm_items import ShmItemSender
from ferrox.outputs import AnyRequestOutput, PoolingRequestOutput, RequestOutput
from ferrox.pooling.params import (
    PoolerConfig,
    PoolingParams,
    pooling_sampling_params,
    validate_pooling_request,
)
from ferrox.reasoning import get_reasoning_parser
from ferrox.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ferrox.sleep_mode import check_rpc, sleep_plan, wake_tags

__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "EngineStartupError", "RequestError",
           "RequestTimeoutError", "StatLogger"]

if TYPE_CHECKING:
    from ferrox.lora.request import LoRARequest

logger = logging.getLogger("ferrox.engine.async_llm")

PromptType = str | Mapping[str, Any]
P = ParamSpec("P")
T = TypeVar("T")

# Threads for prompt processing (chat rendering + encoding). Two keep one long prompt from
# queueing every short one behind it; more buy little, as rendering holds the GIL.
PROMPT_THREADS = 2


class EngineOverloadedError(RuntimeError):
    """More requests in flight than `max_num_queued_reqs` allows, or more prompt tokens waiting for their
    first output than `max_num_queued_tokens`: retry later (HTTP 503). Not a RequestError: nothing is
    wrong with the request itself."""


class RequestTimeoutError(RequestError):
    """The request ran past `request_timeout` and was aborted (its KV blocks are freed)."""


# ---- per-request stream -----------------------------------------------------------------------


class _Stream:
    """Hands one request's RequestOutputs from the output reader to its consumer.

    DELTA outputs that pile up while the consumer is busy are merged into one, so a slow
    client costs one pending object, not a queue that grows with every step. With a stream
    interval N > 1 (vLLM's stream_interval) a DELTA output is held until some choice has N new
    tokens: the first output and the last go at once, the ones between carry N tokens or more."""

    __slots__ = ("request_id", "kind", "pending", "error", "finished", "waiter", "interval", "sent")

    def __init__(self, request_id: str, kind: RequestOutputKind, interval: int = 1) -> None:
        self.request_id = request_id
        self.kind = kind
        self.pending: AnyRequestOutput | None = None
        self.error: BaseException | None = None
        self.finished = False
        # The consumer's future while it waits in get(): a bare future rather than an asyncio.Event,
        # whose set/wait/clear cost ~1 us more per output (each streamed token of each request).
        self.waiter: asyncio.Future[None] | None = None
        self.interval = interval
        self.sent = False  # an output has gone to the consumer

    def _ready(self) -> bool:
        """Whether the pending output may go now (the stream interval's rule, class doc)."""
        pending = self.pending
        if pending is None:
            return False
        if (self.interval <= 1 or not self.sent or self.finished or self.kind != RequestOutputKind.DELTA
                or not isinstance(pending, RequestOutput)):
            return True
        return any(len(c.token_ids) >= self.interval for c in pending.outputs)

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def put(self, out: AnyRequestOutput) -> None:
        if (self.pending is None or self.kind != RequestOutputKind.DELTA or not isinstance(self.pending, RequestOutput)
                or not isinstance(out, RequestOutput)):
            self.pending = out
        else:
            _merge_delta(self.pending, out)
        self.finished = out.finished
        if self._ready():
            self._wake()

    def fail(self, error: BaseException) -> None:
        if not self.finished:
            self.error = error
            self.finished = True
            self._wake()

    def end(self) -> None:
        """Finish without a further output (the request was aborted by the caller)."""
        self.finished = True
        self._wake()

    async def get(self) -> AnyRequestOutput | None:
        """The next output; None once the stream has ended."""
        while not self._ready():
            if self.pending is None and self.error is not None:
                raise self.error
            if self.pending is None and self.finished:
                return None
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        out, self.pending = self.pending, None
        self.sent = True
        return out


def _check_stream_interval(value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"stream_interval must be a positive integer, got {value!r}", param="stream_interval")


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            into.outputs.append(comp)
            by_index[comp.index] = comp
            continue
        old.text += comp.text
        old.token_ids = old.token_ids + comp.token_ids
        if comp.logprobs is not None:
            old.logprobs = (old.logprobs or []) + comp.logprobs
        old.cumulative_logprob = comp.cumulative_logprob
        old.finish_reason, old.stop_reason = comp.finish_reason, comp.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.error = new.error
    into.num_cached_tokens = new.num_cached_tokens
    into.prompt_logprobs = into.prompt_logprobs or new.prompt_logprobs


# ---- the engine --------------------------------------------------------------------------------


class AsyncLLM:
    # Runner "pooling" (an embedding model; from the core's handshake): how it pools. None: generation.
    pooler_config: PoolerConfig | None = None
    # --otlp-traces-endpoint (metrics/tracing.py): spans of finished requests. None: off.
    tracer: RequestTracer | None = None

    def __init__(self, model: str | None = None, *, log_level: str | None = None, stream_interval: int = 1,
                 generation_config: str = "auto", override_generation_config: dict[str, Any] | None = None,
                 **engine_args: Any) -> None:
        """stream_interval, generation_config, override_generation_config: vLLM's engine arguments of those
        names (`stream_interval` below; the requests' default sampling parameters, engine/defaults.py)."""
        _check_stream_interval(stream_interval)
        resolve_generation_defaults(generation_config, {}, override_generation_config)  # a bad one fails first
        config = engine_args.pop("config", None)
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **engine_args)
        elif engine_args or model is not None:
            raise ValueError("pass either config= or engine arguments, not both")
        self.config: EngineConfig = config
        log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())

        from ferrox.loader.no_tokenizer import NoTokenizer
        from ferrox.loader.source import resolve_tokenizer
        from ferrox.loader.tokenizer import load_tokenizer
        from ferrox.multimodal.media import allow_media_domains

        # Fail fast on a bad path before spawning anything.
        source = resolve_tokenizer(config.tokenizer, config.model, config.revision, config.tokenizer_revision)
        allow_media_domains(config.allowed_media_domains)  # (the images and videos this process fetches)
        self._prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="ferrox-prompt")
        self.client = DPCoreClient(config, log_level=str(log_level))
        # Whoever reads the measurements: the periodic log line here; the server adds Prometheus.
        # vLLM's --enable-log-outputs (engine/output_log.py): set by `ferrox serve`; None logs nothing.
        self.output_log: OutputLog | None = None
        self._unlogged: set[str] = set()  # request ids whose outputs it does not log (beam search's steps)
        self.stat_loggers: list[StatLogger] = []
        if not config.disable_log_stats:
            self.stat_loggers.append(LoggingStatLogger())
        # --otlp-traces-endpoint (metrics/tracing.py): a span per finished request; its name is known once ready.
        check_tracing_available(config.otlp_traces_endpoint)
        self.tracer = RequestTracer(config.otlp_traces_endpoint, "") if config.otlp_traces_endpoint else None
        if self.tracer is not None:
            self.stat_loggers.append(self.tracer)
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self._prompt_pool, list(self.stat_loggers))
        try:
            # The tokenizer loads here while the core process loads the model (none under
            # skip_tokenizer_init: its stand-in refuses text; EOS ids and vocabulary come from the core).
            self.tokenizer = (NoTokenizer(source.name, 0, []) if config.skip_tokenizer_init
                              else load_tokenizer(source, config.tokenizer_mode))
            # A model that takes images: its prompt rules (multimodal/processing.py), from config.json.
            self.image_prompts = _image_prompts(config, self.tokenizer)
            limits = config.mm_limits() or {}
            if self.image_prompts is not None and any(limits.get(m, 1) for m in MM_MODALITIES):
                # --mm-processor-cache-type shm: the images' pixels go to the cores through shared memory.
                self.client.mm_store = ShmItemSender.for_config(config, self.client.size)
            info = self.client.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.model_name: str = (config.served_names() or [info.model_name])[0]
        if self.tracer is not None:
            self.tracer.model_name = self.model_name
        self.max_model_len: int = info.max_model_len
        self.kv_capacity_tokens: int = info.kv_capacity_tokens
        # The request rules' limits (ferrox.engine.validation), checked here before a request
        # crosses to the core process, exactly as the offline engine checks them.
        reasoning = (get_reasoning_parser(config.reasoning_parser, self.tokenizer.token_to_id)
                     if config.reasoning_parser else None)
        self.limits = validation.RequestLimits(
            max_model_len=info.max_model_len,
            kv_capacity_tokens=info.kv_capacity_tokens,
            vocab_size=info.vocab_size or self.tokenizer.vocab_size,
            max_logprobs=config.max_logprobs,
            # The core checked at start-up that the tokenizer has the parser's tags as tokens.
            reasoning_end_token_id=reasoning.end_token_id if reasoning is not None else None,
            reasoning_parser=config.reasoning_parser,
            has_tokenizer=not config.skip_tokenizer_init,
            logits_processors=load_logits_processors(config.logits_processors),
        )
        self.device: str = info.device
        # Runner "pooling" (an embedding model): requests come through encode(), generate() is refused.
        self.pooler_config = info.pooler_config
        self.eos_token_ids: list[int] = list(info.eos_token_ids)
        self.generation_defaults: dict[str, Any] = resolve_generation_defaults(
            generation_config, info.generation_defaults, override_generation_config)
        self.chat_template: str | None = _read_template(config.chat_template)
        # The engine's latest stats: totals over its cores, each core's own under "engines"; this process's
        # multimodal processor cache counters (mm_cache_queries / mm_cache_hits) at the top level.
        self.last_stats: dict[str, Any] = {**info.stats, **self._front_end_stats()}
        self.dead_callbacks: list[Any] = []
        self.processor = OutputProcessor(None if config.skip_tokenizer_init else self.tokenizer)
        self._streams: dict[str, _Stream] = {}
        # Requests whose prompt is in the prompt threads (not yet in the core) -> aborted meanwhile.
        self._tokenizing: dict[str, bool] = {}
        self._timing: dict[str, RequestTiming] = {}  # engine request id -> its clock readings
        self.max_num_queued_reqs: int | None = None
        self.max_num_queued_tokens: int | None = None
        self.request_timeout: float | None = None
        # Tokens a streamed (DELTA) output gathers before it goes out (vLLM's --stream-interval; a
        # request's own stream_interval wins): fewer, larger chunks for many concurrent streams.
        self.stream_interval = stream_interval
        self._num_in_flight = 0  # samples between generate()'s admission and its end
        self._prefill_tokens = 0  # prompt tokens of the admitted requests that have no output yet (x samples)
        self.client.on_outputs = self._on_outputs
        self.client.on_dead = self._on_dead

    @classmethod
    def from_engine_args(cls, engine_args: EngineConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> AsyncLLM:
        """From an EngineConfig, a mapping of LLM() arguments, or keyword arguments."""
        if isinstance(engine_args, EngineConfig):
            return cls(config=engine_args, **kwargs)
        return cls(**{**dict(engine_args or {}), **kwargs})

    # ---- public API -------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def is_running(self) -> bool:
        return self.client.is_alive()

    @property
    def num_in_flight(self) -> int:
        """Samples admitted by `generate` and not yet ended (tokenizing, waiting or running)."""
        return self._num_in_flight

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead

    async def get_stats(self) -> dict[str, Any]:
        """Fresh scheduler stats (running/waiting requests, KV usage, counters), summed over the
        engine cores; each core's own snapshot is under "engines"; with a multimodal processor cache,
        this process's mm_cache_queries / mm_cache_hits."""
        for engine, stats in enumerate(await self.client.call_utility("stats")):
            self.client.update_stats(engine, stats)
        self._record_stats()
        return self.last_stats

    async def reset_prefix_cache(self) -> bool:
        """Empty every core's prefix cache; False if any core refused (blocks still in use)."""
        return all(await self.client.call_utility("reset_prefix_cache"))

    # ---- sleep mode (vLLM's; enable_sleep_mode: ferrox/sleep_mode.py) ----------------------------------------
    async def sleep(self, level: int = 1, mode: str = "abort", tags: list[str] | None = None) -> None:
        """Stop scheduling and give the device memory back (level 1: weights to host memory, KV cache
        discarded). mode: what happens to the requests in flight: "abort" them (finish_reason "abort"),
        "wait" for them to finish (this returns then), or "keep" them (they recompute their tokens after
        the wake-up and go on). Requests submitted while asleep wait for wake_up."""
        sleep_plan(self.config.enable_sleep_mode, level, mode, tags)  # a bad argument fails here, by name
        await self.client.call_utility("sleep", level, mode, list(tags) if tags is not None else None,
                                       timeout_s=None)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory again (default: all; tags=["weights"] / ["kv_cache"] one part) and resume
        scheduling once nothing sleeps."""
        which = wake_tags(self.config.enable_sleep_mode, tags)
        await self.client.call_utility("wake_up", list(which) if which is not None else None, timeout_s=None)

    async def is_sleeping(self) -> bool:
        return any(await self.client.call_utility("is_sleeping"))

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's, for the worker methods ferrox has: "reload_weights" (after sleep(level=2) and
        wake_up(tags=["weights"]), the checkpoint read again into the weights). Every engine core's
        ranks' results, in order."""
        check_rpc(method)
        if not self.config.enable_sleep_mode:
            raise InvalidArgumentError(f"method: {method} needs enable_sleep_mode=True (ferrox serve "
                                       "--enable-sleep-mode), which keeps the weights reloadable", param="method")
        # timeout bounds the wait, as vLLM's (asyncio.TimeoutError past it).
        results = await self.client.call_utility("collective_rpc", method, list(args), kwargs or {}, timeout_s=timeout)
        return [r for core in results for r in core]

    async def start_profile(self) -> None:
        """vLLM's: the torch profiler over every engine core's steps (VLLM_TORCH_PROFILER_DIR: engine/profiler.py)."""
        await self.client.call_utility("start_profile")

    async def stop_profile(self) -> None:
        """Stop it; each core writes its trace to the folder."""
        await self.client.call_utility("stop_profile")

    # ---- LoRA adapters (vLLM's AsyncLLM.add_lora / remove_lora / list_loras) -------------------------
    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter on every engine core now. Raises InvalidArgumentError naming the file and
        field for a bad adapter (nothing is loaded anywhere then)."""
        check_lora_request(lora_request)
        try:
            await self.client.call_utility("add_lora", lora_request.lora_name, lora_request.lora_int_id,
                                           lora_request.lora_path)
        except RuntimeError as e:
            # A core's refusal comes back as "TypeName: message"; the message names file and field.
            await self.client.call_utility("remove_lora", lora_request.lora_int_id)
            raise InvalidArgumentError(str(e).split(": ", 1)[-1], param="lora_path") from None
        return True

    async def remove_lora(self, lora_int_id: int) -> bool:
        return any(await self.client.call_utility("remove_lora", lora_int_id))

    async def list_loras(self) -> set[int]:
        return {i for ids in await self.client.call_utility("list_loras") for i in ids}

    async def check_health(self) -> None:
        if not self.is_running:
            raise EngineDeadError(self.dead_reason or "engine is shut down")

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) for a text prompt, {"prompt": text} or
        {"prompt_token_ids": [...]}; the same rules as the offline LLM (input_processor).
        Blocking: from a coroutine, go through `run_in_prompt_pool`."""
        processed = self.process_prompt(prompt)
        if processed.mm_items:
            raise InvalidArgumentError("multi_modal_data: tokenize_prompt returns ids only; pass a prompt with "
                                       "images to generate()", param="multi_modal_data")
        return processed.prompt, processed.prompt_token_ids

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """tokenize_prompt's work, images included (vLLM's multi_modal_data: decoded, and the prompt's
        placeholders expanded). Blocking."""
        return attach_images(process_prompt(self.tokenizer, prompt), self.image_prompts, "prompt",
                             model_name=self.model_name)

    async def prompt_work(self, size: int, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` for prompt work of `size` (prompt_size's units): inline when small,
        else in the prompt threads (see the module docs)."""
        if size <= INLINE_PROMPT_SIZE:
            return fn(*args, **kwargs)
        return await self.run_in_prompt_pool(fn, *args, **kwargs)

    async def run_in_prompt_pool(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """`fn(*args, **kwargs)` in the prompt threads, off the event loop; for tokenizer work on
        the request path (chat rendering, encoding). Its exceptions reach the caller unchanged."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._prompt_pool, functools.partial(fn, *args, **kwargs))
        except RuntimeError:  # the pool is shut down
            raise EngineDeadError(self.client.dead or "engine is shut down") from None
        return await future

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        prompt_cache_key: str | None = None,
        stream_interval: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream RequestOutputs for one request: cumulative unless `sampling_params.output_kind` is
        DELTA or FINAL_ONLY. stream_interval (DELTA only; default: the engine's `stream_interval`):
        each output but the first and the last carries at least that many new tokens. Raises RequestError for a request the engine rejects or fails,
        EngineDeadError if the core dies. After `abort()` the last output has finished=True and
        finish_reason "abort" on every choice that had not finished. cache_salt: the prompt reuses
        cached KV blocks only of requests that gave the same salt (vLLM's meaning). lora_request: the
        LoRA adapter to run with (the engine needs enable_lora=True). prompt_cache_key (OpenAI's): with
        several engine cores (data parallel), requests with one key go to the core it last went to
        among the least loaded, where their shared prefix is cached (dp_router.py). trace_headers (vLLM's): the
        W3C trace context (`traceparent`, `tracestate`) its span continues with --otlp-traces-endpoint
        (metrics/tracing.py; default: the HTTP request's, which the server sets).
        """
        if stream_interval is not None:
            _check_stream_interval(stream_interval)
        outputs = self._run(prompt, sampling_params, request_id, priority=priority, arrival_time=arrival_time,
                            cache_salt=cache_salt, lora_request=lora_request, prompt_cache_key=prompt_cache_key,
                            stream_interval=stream_interval, trace_headers=trace_headers)
        async with contextlib.aclosing(outputs):  # closing this generator aborts the request at once
            async for out in outputs:
                assert isinstance(out, RequestOutput)
                yield out

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str,
        params: BeamSearchParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        prompt_cache_key: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's beam search on the async engine (ferrox.beam_search): each step runs every live beam as a
        one-token request (ids `{request_id}-{step}-{beam}`, sharing the prompt's cached blocks); yields
        one final RequestOutput whose outputs are the beam_width best beams, best first. The request
        timeout runs from the search's start; closing the generator aborts the step in flight."""
        arrival = time.time()
        processed = refuse_images(await self._tokenize(prompt), "prompt", "beam search")
        prompt_text, prompt_ids = processed.prompt, processed.prompt_token_ids
        check_beam_search(params, len(prompt_ids), max_model_len=self.max_model_len,
                          max_logprobs=self.limits.max_logprobs)
        search = BeamSearch(prompt_ids, params, self.eos_token_ids, lora_request)
        step_params = one_token_params(params)

        async def one(ids: list[int], rid: str) -> RequestOutput:
            final: RequestOutput | None = None
            self._unlogged.add(rid)  # (a beam's one-token step: the search's result is what --enable-log-outputs logs)
            try:
                async with contextlib.aclosing(self.generate({"prompt_token_ids": ids}, step_params, rid,
                                                             priority=priority, arrival_time=arrival,
                                                             cache_salt=cache_salt, lora_request=lora_request,
                                                             prompt_cache_key=prompt_cache_key)) as gen:
                    async for out in gen:
                        final = out
            finally:
                self._unlogged.discard(rid)
            assert final is not None
            if final.error is not None or final.outputs[0].finish_reason == "abort":
                raise RequestError(final.error or f"request {request_id!r}: a beam step was aborted")
            return final

        while not search.done:
            # A TaskGroup: one failed beam cancels (aborts) its siblings.
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(ids, f"{request_id}-{search.steps}-{i}"))
                         for i, ids in enumerate(search.step_prompts())]
            search.advance([step_logprobs(t.result()) for t in tasks])
        result = search.request_output(request_id, prompt_text,
                                       lambda ids, skip: self.tokenizer.decode(list(ids), skip_special_tokens=skip))
        if self.output_log is not None:
            self.output_log.observe(result, delta=False)
        yield result

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling model's vector for one prompt (vLLM's AsyncLLM.encode): one final PoolingRequestOutput.
        Raises InvalidArgumentError naming the field for a request the model refuses (too long, dimensions
        it does not support, a generation model), RequestError if the engine fails it."""
        outputs = self._run(prompt, pooling_sampling_params(), request_id, priority=priority,
                            arrival_time=arrival_time, pooling_params=pooling_params or PoolingParams())
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                assert isinstance(out, PoolingRequestOutput)
                yield out

    async def _run(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None,
        request_id: str | None,
        *,
        priority: int,
        arrival_time: float | None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        prompt_cache_key: str | None = None,
        stream_interval: int | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[AnyRequestOutput, None]:
        """One request from admission to its last output (generate and encode): the queue limit, the
        prompt threads, the request timeout, and the abort when the consumer stops early."""
        if self.client.dead is not None:
            raise EngineDeadError(self.client.dead)
        request_id = request_id or uuid.uuid4().hex
        validation.check_request_id(request_id, lambda rid: rid in self._streams or rid in self._tokenizing)
        samples = sampling_params.n if sampling_params is not None else 1
        limit = self.max_num_queued_reqs
        if limit is not None and self._num_in_flight + samples > limit:
            raise EngineOverloadedError(
                f"the server is at capacity ({self._num_in_flight} requests in flight, max_num_queued_reqs={limit}); "
                "retry later")
        token_limit = self.max_num_queued_tokens
        if token_limit is not None and self._prefill_tokens >= token_limit:
            raise EngineOverloadedError(
                f"the server is at its prefill backlog limit ({self._prefill_tokens} prompt tokens waiting for a "
                f"first output, max_num_queued_tokens={token_limit}); retry later")
        if arrival_time is None:
            arrival_time = time.time()  # before tokenizing: the latency metrics include it
        if trace_headers is None:
            trace_headers = trace_headers_var.get()  # the HTTP request's (metrics/tracing.py)
        if trace_headers and self.tracer is None:
            _warn_untraced()
        self._num_in_flight += samples
        timer: asyncio.TimerHandle | None = None
        try:
            self._tokenizing[request_id] = False
            try:
                processed = await self._tokenize(prompt)
            finally:
                aborted = self._tokenizing.pop(request_id)
            if pooling_params is not None:
                refuse_images(processed, "prompt", "pooling")
            # No await from here to the registration: the id cannot be taken in between.
            stream = self._add_request(processed.prompt, processed.prompt_token_ids, sampling_params, request_id,
                                       priority, arrival_time, cache_salt, lora_request, pooling_params,
                                       prompt_cache_key, processed.mm_items, trace_headers)
            stream.interval = stream_interval or self.stream_interval
            if self.request_timeout is not None:
                timer = asyncio.get_running_loop().call_later(
                    max(0.0, arrival_time + self.request_timeout - time.time()), self._expire, stream)
            prefill = samples * len(processed.prompt_token_ids)  # (max_num_queued_tokens: until the first output)
            self._prefill_tokens += prefill
            try:
                if aborted:  # abort() came while the prompt was in the prompt threads: end it the usual way
                    await self.abort(request_id)
                while (out := await stream.get()) is not None:
                    self._prefill_tokens -= prefill
                    prefill = 0
                    if out.error is not None and (isinstance(out, PoolingRequestOutput)
                                                  or not any(c.token_ids for c in out.outputs)):
                        raise RequestError(out.error)
                    if (self.output_log is not None and isinstance(out, RequestOutput)
                            and stream.request_id not in self._unlogged):
                        self.output_log.observe(out, delta=stream.kind == RequestOutputKind.DELTA)
                    yield out
                    if out.finished:
                        return
            finally:
                self._prefill_tokens -= prefill
                if not stream.finished:
                    self._abort_ids([stream.request_id])
                self._streams.pop(stream.request_id, None)
                if self.output_log is not None:
                    self.output_log.forget(stream.request_id)
        finally:
            self._num_in_flight -= samples
            if timer is not None:
                timer.cancel()

    @property
    def runner(self) -> str:
        """vLLM's runner of the served model: "pooling" (embeddings) or "generate"."""
        return "generate" if self.pooler_config is None else "pooling"

    def _check_runner(self, prompt_ids: list[int], pooling_params: PoolingParams | None) -> None:
        """A generation request on a pooling model, or the reverse, is refused naming `runner`; a pooling
        request is checked against the model's pooling rules (ferrox.pooling.params)."""
        if self.pooler_config is None:
            if pooling_params is not None:
                raise InvalidArgumentError(f"runner: {self.model_name} runs with runner 'generate': it does not pool "
                                           "embeddings (serve it with --runner pooling to embed with it)",
                                           param="runner")
            return
        if pooling_params is None:
            raise InvalidArgumentError(f"runner: {self.model_name} runs with runner 'pooling' (an embedding model): "
                                       "it cannot generate text", param="runner")
        validate_pooling_request(prompt_ids, pooling_params, self.pooler_config, max_model_len=self.max_model_len,
                                 vocab_size=self.limits.vocab_size, model_name=self.model_name)

    def _expire(self, stream: _Stream) -> None:
        """`request_timeout` passed: free the request in the core and fail its generator."""
        if stream.finished or self._streams.get(stream.request_id) is not stream:
            return
        logger.warning("request %s aborted: still unfinished after request_timeout=%gs", stream.request_id,
                       self.request_timeout)
        self._abort_ids([stream.request_id])
        stream.fail(RequestTimeoutError(
            f"request aborted: it ran longer than the server's request timeout ({self.request_timeout:g} s)"))

    async def _tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        return await self.prompt_work(prompt_size(prompt), self.process_prompt, prompt)

    def _add_request(
        self,
        prompt_text: str | None,
        prompt_ids: list[int],
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int,
        arrival_time: float,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        prompt_cache_key: str | None = None,
        mm_items: list[MultiModalItem] | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> _Stream:
        """Validate a tokenized request and send it to the core (synchronously: errors raise here)."""
        if self.client.dead is not None:
            raise EngineDeadError(self.client.dead)
        # No params: the model's generation_config defaults, exactly as LLM.generate uses.
        params = sampling_params if sampling_params is not None else default_sampling_params(
            self.generation_defaults)
        self._check_runner(prompt_ids, pooling_params)
        if pooling_params is None:
            validation.validate_request(prompt_ids, params, self.limits)
            # Encoded here, so that a word list past the token bound is this call's error (the core takes them as given).
            params = with_bad_words_token_ids(params, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                              self.limits.vocab_size)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling_params=params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            **lora_fields(lora_request),
            pooling_params=pooling_params,
            mm_inputs=mm_items,
        )
        core_requests = self.processor.add_request(request, prompt_text)
        stream = _Stream(request_id, params.output_kind)
        self._streams[request_id] = stream
        try:
            queued_time = time.time()
            for core_request in core_requests:
                timing = self._timing[core_request.request_id] = request_timing(request, self.max_model_len,
                                                                                queued_time)
                if self.tracer is not None and pooling_params is None:
                    self.tracer.track(core_request.request_id, request_id, params, trace_headers, timing.max_tokens)
            # The first sample picks the core; its siblings follow it there, to share the prompt's blocks.
            engine = self.client.add_request(core_requests[0], cache_key=prompt_cache_key)
            for sibling in core_requests[1:]:
                self.client.add_request(sibling, engine)
        except BaseException:
            self._abort_ids([request_id])
            self._streams.pop(request_id, None)
            raise
        return stream

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort request(s) by id: the core frees their KV blocks; each generator yields a final
        output (finished, finish_reason "abort" on the choices still running) and ends."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid in self._tokenizing:
                self._tokenizing[rid] = True  # generate() aborts it once it is registered
        engine_ids, final_outputs = self.processor.finish_aborted(ids)
        self._abort_engine_ids(engine_ids)
        for out in final_outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None and not stream.finished:
                stream.end()  # unknown to the processor (already finished): nothing more to say

    def shutdown(self, reason: str = "engine is shutting down") -> None:
        """Stop the engine-core processes, the prompt threads and the stats log line (idempotent;
        also runs at GC and interpreter exit). Unfinished requests fail with EngineDeadError(reason)."""
        for stream in list(getattr(self, "_streams", {}).values()):
            stream.fail(EngineDeadError(reason))
        if hasattr(self, "_finalizer"):
            self._finalizer()

    # ---- output routing (runs in the client's reader tasks) -----------------------------------
    def _on_outputs(self, engine: int, batch: EngineCoreOutputs) -> None:
        now = time.time()
        if batch.stats is not None:
            self._record_stats()
        iteration = IterationStats(engine)
        for result in batch.results:
            observe(self._timing, engine, result, batch.step_start, now, iteration)
        for stat_logger in self.stat_loggers:
            stat_logger.on_iteration(iteration)
        for request_output in self.processor.process_outputs(batch.results):
            stream = self._streams.get(request_output.request_id)
            if stream is not None:
                stream.put(request_output)

    def _front_end_stats(self) -> dict[str, Any]:
        """Counters of what this process does itself: the multimodal processor cache's, when it has one (the
        cores never see images before they are processed)."""
        cache = getattr(self.image_prompts, "processor_cache", None)
        return cache.stats() if cache is not None else {}

    def _on_dead(self, reason: str) -> None:
        for stream in list(self._streams.values()):
            stream.fail(EngineDeadError(reason))
        for callback in self.dead_callbacks:
            callback(reason)

    def _record_stats(self) -> None:
        self.last_stats = {**self.client.aggregate_stats(), **self._front_end_stats()}
        for stat_logger in self.stat_loggers:
            stat_logger.on_scheduler_stats(self.last_stats)

    def _abort_ids(self, request_ids: list[str]) -> None:
        self._abort_engine_ids(self.processor.abort_requests(request_ids))

    def _abort_engine_ids(self, engine_ids: list[str]) -> None:
        now = time.time()
        by_engine: dict[int, IterationStats] = {}
        for engine_id in engine_ids:
            timing = self._timing.pop(engine_id, None)
            engine = self.client.engine_of(engine_id)
            if timing is not None and engine is not None:
                iteration = by_engine.setdefault(engine, IterationStats(engine))
                iteration.finished.append(finished_stats(timing, engine, "abort", now, engine_id))
        self.client.abort(engine_ids)
        for iteration in by_engine.values():
            for stat_logger in self.stat_loggers:
                stat_logger.on_iteration(iteration)

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@functools.cache
def _warn_untraced() -> None:
    logger.warning("a request came with trace headers (traceparent), but tracing is off: start with "
                   "--otlp-traces-endpoint to export spans")


def _shutdown(client: DPCoreClient, prompt_pool: ThreadPoolExecutor, stat_loggers: list[StatLogger]) -> None:
    # No wait: prompts already handed to the threads finish on their own, and their requests then
    # fail with EngineDeadError (a cancelled future would surface as a bare CancelledError instead).
    prompt_pool.shutdown(wait=False)
    client.shutdown()
    for stat_logger in stat_loggers:
        close = getattr(stat_logger, "close", None)
        if close is not None:
            close()


def _read_template(chat_template: str | None) -> str | None:
    """--chat-template is either the template text or a path to a file holding it."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    return chat_template


def _image_prompts(config: EngineConfig, tokenizer: Any) -> Any:
    """The served model's image prompt rules (None: a text-only model), from its config.json (or Mistral's
    params.json: --config-format) as the core reads it (hf_overrides applied)."""
    import os

    from ferrox.loader.config_file import CONFIG_FILE, read_model_config, resolve_config_format
    from ferrox.loader.mistral_config import PARAMS_FILE
    from ferrox.loader.source import resolve_model
    from ferrox.multimodal.processing import image_prompts_for_model

    source = resolve_model(config.model, config.revision)
    if source.format != "hf":
        return None
    name = PARAMS_FILE if resolve_config_format(source.path, config.config_format) == "mistral" else CONFIG_FILE
    if not os.path.isfile(os.path.join(source.path, name)):
        return None
    hf_config = {**read_model_config(source.path, config.config_format)[0], **(config.hf_overrides or {})}
    return image_prompts_for_model(source.path, hf_config, tokenizer, limits=config.mm_limits(),
                                   allowed_local_media_path=config.allowed_local_media_path,
                                   processor_kwargs=config.mm_processor_kwargs,
                                   media_io_kwargs=config.media_io_kwargs,
                                   processor_cache_gb=config.mm_processor_cache_gb)
