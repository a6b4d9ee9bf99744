"""EngineCore: the model, its KV cache, the Rust scheduler and the model runner, stepped together.

    outputs = core.step()   # schedule (Rust) -> runner.execute (torch) -> update_from_output (Rust)

It runs in-process under `LLM` and inside the engine-core process under `AsyncLLM`. It never
raises for one bad request during `step()`: a request whose sampling fails is finished with
finish_reason "error" and the rest of the batch goes on. `add_request` validates and raises
`ValueError`/`FerroxError` naming the field before anything is queued.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ferrox import _core
from ferrox.config import EngineConfig
from ferrox.engine.protocol import EngineCoreOutput, EngineCoreRequest, Logprobs
from ferrox.sampling_params import SamplingParams
from ferrox.worker.model_runner import ModelRunner, ModelRunnerOutput, StepHandle
from ferrox.worker.model_setup import LoadedModel, load_everything

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        start = time.perf_counter()
        loaded: LoadedModel = load_everything(config)
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.spec = loaded.spec
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.generation_defaults = loaded.generation_defaults
        self.max_model_len = loaded.max_model_len
        self.num_kv_blocks = loaded.num_blocks
        self.block_size = config.block_size
        self.thread_governor = loaded.threads  # CPU: intra-op threads follow the machine's load
        self.model_name = config.served_model_name or loaded.source.name
        self.tokenizer_json: str = self.tokenizer.to_json_str()
        self.scheduler = _core.Scheduler(
            num_blocks=loaded.num_blocks,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            max_num_seqs=loaded.max_num_seqs,
            max_num_batched_tokens=loaded.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            policy=config.policy,
            tokenizer_json=self.tokenizer_json,
            eos_token_ids=self.eos_token_ids,
        )
        self.runner = ModelRunner(
            loaded.model,
            loaded.kv_caches,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            seed=config.seed,
        )
        self.cuda_graph_capture_s: float | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.cuda_graph_capture_s = self.runner.capture_cuda_graphs(
                max_num_seqs=loaded.max_num_seqs, max_model_len=self.max_model_len, block_size=config.block_size
            )
            if self.cuda_graph_capture_s is not None:
                logger.info("CUDA graphs for decode batches %s captured in %.1f s",
                            self.runner.graph_runner.batch_sizes, self.cuda_graph_capture_s)
        self.structured: Any = None  # StructuredOutputManager, created on first constrained request
        # Async scheduling: the step launched last and not yet reported (scheduler output, handle).
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda")
        self._in_flight: tuple[Any, StepHandle] | None = None
        self._pending_prompt_logprobs: dict[str, Logprobs] = {}
        logger.info(
            "engine ready in %.1f s: model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d (%d tokens)",
            time.perf_counter() - start, self.model_name, self.device, loaded.dtype, self.max_model_len,
            self.num_kv_blocks, self.kv_capacity_tokens,
        )

    # ---- properties -----------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size  # the null block holds nothing

    # ---- requests ---------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue. Raises ValueError / FerroxError naming the problem; nothing is queued then."""
        params = request.sampling_params
        prompt = request.prompt_token_ids
        self.validate_prompt(prompt, params, what=f"request {request.request_id!r}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        wait_for_grammar = False
        if params.structured_outputs is not None:
            self._structured().submit(request.request_id, params.structured_outputs)
            wait_for_grammar = True
        try:
            self.scheduler.add_request(
                request.request_id,
                prompt,
                max_tokens=max_tokens,
                min_tokens=params.min_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=params.stop_token_ids or [],
                stop=params.stop_list,
                include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens,
                detokenize=params.detokenize,
                priority=request.priority,
                # Prompt logprobs need every prompt position computed, so such a request must not
                # reuse cached blocks: a salt of its own id keeps its block hashes private.
                cache_salt=request.request_id if params.prompt_logprobs is not None else None,
                wait_for_grammar=wait_for_grammar,
            )
        except BaseException:
            if wait_for_grammar:
                self.structured.free([request.request_id])
            raise
        self.runner.add_request(request)

    def validate_prompt(self, prompt: list[int], params: SamplingParams, what: str = "prompt") -> None:
        if len(prompt) == 0:
            raise ValueError(f"prompt_token_ids: {what} has an empty prompt")
        if len(prompt) >= self.max_model_len:
            raise _core.PromptTooLongError(
                f"prompt_token_ids: {what} has {len(prompt)} prompt tokens, which leaves no room for output "
                f"within max_model_len={self.max_model_len}"
            )
        if len(prompt) > self.kv_capacity_tokens:
            raise _core.PromptTooLongError(
                f"prompt_token_ids: {what} has {len(prompt)} prompt tokens but the whole KV cache holds "
                f"{self.kv_capacity_tokens}; raise kv_cache_memory (or gpu_memory_utilization) or shorten it"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            bad = next(t for t in prompt if not 0 <= t < self.vocab_size)
            raise ValueError(f"prompt_token_ids: {what} has token id {bad} outside the vocabulary (size {self.vocab_size})")
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            # A bad schema / regex / grammar is refused before anything is queued (cached check).
            from ferrox.structured.backend import validate_params

            validate_params(params.structured_outputs)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name}: at most {self.config.max_logprobs} (max_logprobs), got {value}")

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outs = self.scheduler.abort_requests(list(request_ids))
        self.runner.remove_requests(list(request_ids))
        self._forget(request_ids)
        return [self._to_output(o, None) for o in outs]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        if self.thread_governor is not None:
            self.thread_governor.maybe_adjust()
        if self._can_overlap():
            return self._step_overlapped()
        early = self._finish_in_flight() + self._poll_structured()
        so = self.scheduler.schedule()
        if so.num_reqs == 0:
            self.runner.remove_requests(so.finished_req_ids)
            return early
        result = self.runner.execute(so, self._grammar_bitmask(so))
        return early + self._update(so, result)

    def _can_overlap(self) -> bool:
        """Async scheduling needs every live request to be plain: no grammar (its mask needs the
        previous token accepted), no penalties / min_tokens / logprobs (they read it on the host)."""
        return (self.async_scheduling and not self.runner.needs_sync_steps
                and (self.structured is None or not self.structured.has_active()))

    def _step_overlapped(self) -> list[EngineCoreOutput]:
        """Launch step N+1 (its decode inputs are step N's sampled ids, still on the device), then
        wait for step N and report it: the host's scheduling and bookkeeping overlap the GPU."""
        so = self.scheduler.schedule(keep_in_flight=True)
        prev = self._in_flight
        self._in_flight = None
        if so.num_reqs == 0:
            self.runner.remove_requests(so.finished_req_ids)
        else:
            # If this raises, the scheduler rolls back both undelivered steps at the next schedule().
            self._in_flight = (so, self.runner.launch(so, None, prev[1] if prev else None))
        if prev is None:
            return []
        return self._update(prev[0], self.runner.finish(prev[1]))

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        """Report the step left in flight by async scheduling before a synchronous step."""
        if self._in_flight is None:
            return []
        so, handle = self._in_flight
        self._in_flight = None
        return self._update(so, self.runner.finish(handle))

    def _update(self, so: Any, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        force_stop = None
        if self.structured is not None and self.structured.has_active():
            force_stop = self.structured.accept_tokens(so.req_ids, result.sampled_token_ids, so.sample_mask)
        core_outs = self.scheduler.update_from_output(result.sampled_token_ids, force_stop)
        self._pending_prompt_logprobs.update(result.prompt_logprobs)
        outputs = [self._to_output(o, result) for o in core_outs if o.request_id not in result.errors]
        if result.errors:
            outputs.extend(self._fail(result.errors))
        finished = [o.request_id for o in outputs if o.finished]
        if finished:
            self._forget(finished)
        return outputs

    def _to_output(self, o: Any, result: ModelRunnerOutput | None) -> EngineCoreOutput:
        out = EngineCoreOutput(
            request_id=o.request_id,
            new_token_ids=o.new_token_ids,
            text_delta=o.text_delta,
            finished=o.finished,
            finish_reason=o.finish_reason,
            stop_reason=o.stop_reason,
            num_prompt_tokens=o.num_prompt_tokens,
            num_cached_tokens=o.num_cached_tokens,
        )
        if result is not None:
            if out.new_token_ids:
                out.new_logprobs = result.logprobs.get(o.request_id)
            if self._pending_prompt_logprobs:
                out.prompt_logprobs = self._pending_prompt_logprobs.pop(o.request_id, None)
        if self.structured is not None and out.finished:
            error = self.structured.error_for(o.request_id)
            if error is not None:
                out.error = f"structured output: {error}"
        return out

    def _fail(self, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish failed requests with finish_reason 'error' (their blocks go back at once)."""
        self.scheduler.abort_requests(list(errors))
        self.runner.remove_requests(list(errors))
        return [
            EngineCoreOutput(request_id=rid, new_token_ids=[], finished=True, finish_reason="error", error=msg)
            for rid, msg in errors.items()
        ]

    def _forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._pending_prompt_logprobs.pop(rid, None)
        if self.structured is not None:
            self.structured.free(list(request_ids))

    # ---- structured outputs (llguidance) --------------------------------------------------------------
    def _structured(self) -> Any:
        if self.structured is None:
            from ferrox.structured.manager import StructuredOutputManager

            self.structured = StructuredOutputManager(self.tokenizer_json, self.vocab_size, self.eos_token_ids)
        return self.structured

    def _poll_structured(self) -> list[EngineCoreOutput]:
        if self.structured is None:
            return []
        if self.structured.num_pending():
            ready = self.structured.poll_ready()
            if ready:
                self.scheduler.grammar_ready(ready)
        failures = dict(self.structured.take_failures())
        if not failures:
            return []
        self._forget(list(failures))
        return self._fail({rid: f"structured output: {msg}" for rid, msg in failures.items()})

    def _grammar_bitmask(self, so: Any) -> Callable[[], torch.Tensor | None] | None:
        if self.structured is None or not self.structured.has_active():
            return None
        structured = self.structured
        # The runner calls this once the forward pass is queued: on a GPU the CPU fills the mask
        # while the device runs the model, instead of the device waiting for the mask.
        return lambda: structured.fill_bitmask(so.req_ids, so.sample_mask)

    def wait_for_work(self, timeout: float) -> None:
        """Nothing schedulable but grammars compiling: block until one is ready (no busy loop)."""
        if self.structured is not None:
            self.structured.wait_for_pending(timeout)

    # ---- admin ----------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats()
        stats = {
            name: getattr(s, name)
            for name in (
                "num_running", "num_waiting", "num_total_blocks", "num_free_blocks", "kv_cache_usage",
                "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_scheduled_tokens",
                "num_prompt_tokens", "num_generation_tokens",
            )
        }
        stats.update(
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
        )
        return stats

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()

