"""EngineCore: the model, its KV cache, the Rust scheduler and the model runner, stepped together.

    result = core.step()   # one StepResult (columns) per step

One step loop serves synchronous and async scheduling (depth 0 or 1 steps left in flight):

    poll grammars       compiled ones are released to the scheduler (grammar_ready)
    schedule            Rust; keep_in_flight=True under async scheduling
    launch              inputs + forward + logits of the new step, queued on the device
    finish previous     wait for the step in flight, advance grammars by its tokens
    sample              the new step's sampling; when a row needs its grammar mask (the mask must
                        see the previous token), after `finish previous`: under async scheduling
                        the mask fills on a thread while `report previous`, the return and the
                        next schedule run, and the sample is queued just before the next launch
    report previous     update_from_output (Rust: append, detokenize, stops, free)
    (sync: finish the new step now; async: leave it in flight)

Speculative decoding (`speculative_config`) rides in the same loop, with synchronous steps: the core
puts drafts (its own n-gram proposals, or a draft model's, handed to schedule()) in the step's
arrays, the runner verifies them (worker/spec_decode.py) and update_from_output takes a variable
number of tokens per request.

Every request kind (grammars, penalties, min_tokens, logprobs, n > 1) runs in the same loop:
nothing switches the engine to a slower mode. It runs in-process under `LLM` and inside the
engine-core process under `AsyncLLM`. It never raises for one bad request during `step()`: a
request whose sampling fails is finished with finish_reason "error" and the rest of the batch
goes on. `add_request` validates and raises a FerroxError naming the field before anything is
queued.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np

from ferrox import _core
from ferrox.bad_words import with_bad_words_token_ids
from ferrox.config import EngineConfig, long_prefill_threshold
from ferrox.distributed.parallel_state import TPGroup, destroy_tp_group, use_tp_group
from ferrox.engine.kv_events import ZmqEventPublisher, to_batch
from ferrox.engine.lora_state import EngineLoRAs, check_lora_config
from ferrox.engine.profiler import EngineProfiler
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import InvalidArgumentError
from ferrox.executor import Executor, start_tensor_parallel
from ferrox.executor.launch import rank_config
from ferrox.kv_events_config import parse_kv_events_config
from ferrox.loader.source import resolve_model
from ferrox.logits_processor import load_logits_processors
from ferrox.lora.manager import token_capacity
from ferrox.multimodal import prompt_embeds
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.multimodal.processing import image_prompts_for_model
from ferrox.pooling.params import PoolingParams, validate_pooling_request
from ferrox.prefix_hash_seed import prefix_hash_seed
from ferrox.reasoning import get_reasoning_parser
from ferrox.reasoning.plugin import load_reasoning_parser_plugin
from ferrox.request_rules import check_request_id
from ferrox.sampling_params import SamplingParams
from ferrox.sleep_mode import KV_CACHE, WEIGHTS, check_rpc, sleep_plan, wake_tags
from ferrox.speculative_config import SpeculativeConfig, parse_speculative_config, verify_len
from ferrox.step_types import Logprobs, StepResult, StepRow
from ferrox.structured_outputs_config import parse_structured_outputs_config, with_defaults
from ferrox.worker.cuda_graphs import decode_capture_sizes
from ferrox.worker.custom_logits import CustomLogitsProcessors
from ferrox.worker.draft_model import DraftProposer
from ferrox.worker.host_kv_tier import HostKvTier, configured_slots
from ferrox.worker.model_runner import ModelRunner, ModelRunnerOutput, StepHandle
from ferrox.worker.model_setup import LoadedModel, load_everything
from ferrox.worker.mtp_proposer import MtpProposer, mtp_proposer
from ferrox.worker.multimodal import ImageEmbeddings, check_items
from ferrox.worker.pooling_runner import PoolingRunner
from ferrox.worker.recurrent_states import StateRows
from ferrox.worker.sleep_control import SleepControl
from ferrox.worker.warmup import EngineLimits, WarmupReport, warm_up, warmup_enabled

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        """engine_index: this core's data-parallel index (its KV events' rank and endpoint offset)."""
        self.config = config
        start = time.perf_counter()
        self.speculative = _check_speculative(config)
        check_lora_config(config)
        # tensor_parallel_size > 1: ranks 1..N-1 start now and load their shards beside this one.
        config = rank_config(config)
        self.tp, self.executor = start_tensor_parallel(config)
        try:
            loaded: LoadedModel = load_everything(config, self.tp)
        except BaseException:
            self._stop_ranks(timeout_s=0)
            raise
        self.device = loaded.device
        self.tokenizer = loaded.tokenizer
        self.spec = loaded.spec
        self.vocab_size = loaded.vocab_size
        self.eos_token_ids = loaded.eos_token_ids
        self.generation_defaults = loaded.generation_defaults
        self.max_model_len = loaded.max_model_len
        self.num_kv_blocks = loaded.num_blocks
        self.block_size = config.block_size
        # vLLM's cache_config_info gauge (metrics/prometheus.py): the KV cache's settings as labels.
        swap_space = float(config.swap_space if config.swap_space is not None else 4.0)  # vLLM's default
        self._cache_config_info = {
            "block_size": config.block_size, "cache_dtype": loaded.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching and not loaded.recurrent,
            "prefix_caching_hash_algo": config.prefix_caching_hash_algo,
            "gpu_memory_utilization": config.gpu_memory_utilization, "num_gpu_blocks": loaded.num_blocks,
            "num_gpu_blocks_override": config.num_gpu_blocks_override, "cpu_offload_gb": config.cpu_offload_gb,
            "swap_space": swap_space, "swap_space_bytes": swap_space * (1 << 30),
            "calculate_kv_scales": config.calculate_kv_scales,
            "kv_offloading_size": config.kv_offloading_size, "kv_offloading_backend": config.kv_offloading_backend,
        }
        self.thread_governor = loaded.threads  # CPU: intra-op threads follow the machine's load
        # Runner "pooling" (ferrox.pooling, worker/pooling_runner.py): each request is one prompt pooled into a
        # vector. Its prompts run whole (no chunked prefill), with no KV cache to reuse (no prefix caching), and
        # end with one placeholder token, which the scheduler's length limit must leave room for.
        self.pooler_config = loaded.pooler_config
        pooling = self.pooler_config is not None
        self.model_name = (config.served_names() or [loaded.source.name])[0]
        self.tokenizer_json: str | None = self.tokenizer.to_json_str()  # None: skip_tokenizer_init
        # --reasoning-parser: the engine needs its `</think>` to start a structured output's grammar there.
        try:
            # A model that takes images: the offline LLM expands its prompts' images with these rules.
            self.image_prompts = image_prompts_for_model(
                loaded.source.path, self.spec.hf_config.get("multimodal") or {}, self.tokenizer,
                limits=config.mm_limits(), allowed_local_media_path=config.allowed_local_media_path,
                processor_kwargs=config.mm_processor_kwargs, media_io_kwargs=config.media_io_kwargs,
                processor_cache_gb=config.mm_processor_cache_gb)
            # (a config that crossed into this process did not run its plugin here: run it now)
            load_reasoning_parser_plugin(config.reasoning_parser_plugin)
            self.reasoning = (get_reasoning_parser(config.reasoning_parser, self.tokenizer.token_to_id)
                              if config.reasoning_parser else None)
            # structured_outputs_config: the JSON options' server-wide defaults, whether thinking is constrained.
            self.so_defaults = parse_structured_outputs_config(config.structured_outputs_config)
        except ValueError:
            self._stop_ranks(timeout_s=0)
            raise
        self.profiler = EngineProfiler()  # off unless VLLM_TORCH_PROFILER_DIR is set (engine/profiler.py)
        # --kv-offloading-size: the prefix cache's host tier (rust/host_tier.rs, worker/host_kv_tier.py).
        # (also vLLM's --kv-transfer-config with its OffloadingConnector: kv_transfer_config.py)
        host_slots = configured_slots(config, loaded.kv_caches)
        self.host_tier_slots = host_slots
        self.scheduler = _core.Scheduler(
            num_blocks=loaded.num_blocks,
            max_model_len=self.max_model_len + 1 if pooling else self.max_model_len,
            block_size=config.block_size,
            max_num_seqs=loaded.max_num_seqs,
            max_num_batched_tokens=loaded.max_num_batched_tokens,
            # (a hybrid model resumes a cached prefix only from a state snapshot: worker/recurrent_states.py)
            enable_prefix_caching=config.enable_prefix_caching and not pooling
            and (not loaded.recurrent or loaded.state_cache.snapshot_slots > 0),
            enable_chunked_prefill=not pooling and config.enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_threshold(config, self.max_model_len),
            max_num_partial_prefills=config.max_num_partial_prefills,
            max_long_partial_prefills=config.max_long_partial_prefills,
            prefix_caching_hash_algo=config.prefix_caching_hash_algo,
            prefix_hash_seed=prefix_hash_seed(config.prefix_caching_hash_algo),
            host_cache_blocks=host_slots,
            policy=config.policy,
            tokenizer_json=self.tokenizer_json,
            eos_token_ids=self.eos_token_ids,
            max_loras=config.max_loras if config.enable_lora else 0,
            recurrent_states=loaded.recurrent,
            mamba_block_size=loaded.state_cache.grid,
            state_snapshot_slots=loaded.state_cache.snapshot_slots,
            **_speculative_scheduler_args(self.speculative),
        )
        # vLLM's KV cache events (engine/kv_events.py): drained from the scheduler once a step, published.
        self.kv_events: ZmqEventPublisher | None = None
        self._kv_events_rank = engine_index
        events_config = parse_kv_events_config(config.kv_events_config)
        if events_config.publishes:
            self.scheduler.record_kv_events()
            self.kv_events = ZmqEventPublisher(events_config, engine_index)
        # Multi-LoRA: wraps the model's projections before CUDA graphs are captured (they read the
        # adapters' slot buffers) and hands the runner its per-step adapter index.
        self.loras: EngineLoRAs | None = None
        if config.enable_lora:
            self.loras = EngineLoRAs(loaded.model, config, device=loaded.device, dtype=loaded.dtype,
                                     max_num_tokens=token_capacity(loaded.max_num_batched_tokens, loaded.max_num_seqs,
                                                                   verify_len(config.speculative_config)))
        self.runner: ModelRunner | PoolingRunner
        # --logits-processors (ferrox/logits_processor.py): loaded before the model's memory is taken to fail fast.
        self.custom_logits_classes = load_logits_processors(config.logits_processors)
        if self.custom_logits_classes and self.pooler_config is not None:
            raise ValueError("logits_processors: a pooling model samples no tokens")
        if self.pooler_config is not None:
            config.check_graphs_for_pooling()  # (runner 'auto' resolved to pooling)
            self.runner = PoolingRunner(loaded.model, loaded.kv_caches, pooler_config=self.pooler_config,
                                        device=self.device)
        else:
            self.runner = ModelRunner(
                loaded.model,
                loaded.kv_caches,
                vocab_size=self.vocab_size,
                eos_token_ids=self.eos_token_ids,
                device=self.device,
                seed=config.seed,
                tp=self.tp,
                speculative=self.speculative is not None,
                lora=self.loras,
                logprobs_mode=config.logprobs_mode,
                custom_logits=(CustomLogitsProcessors(self.custom_logits_classes, config, self.device)
                               if self.custom_logits_classes else None),
                state_rows=(StateRows(loaded.max_num_seqs, loaded.state_cache.snapshot_slots,
                                      self.speculative.num_speculative_tokens if self.speculative else 0)
                            if loaded.recurrent else None),
            )
        # --enable-prompt-embeds: prompts of embeddings reach the model as rows of one item each, through the
        # images' path (multimodal/prompt_embeds.py), which a text model's runner then needs too.
        if host_slots and isinstance(self.runner, ModelRunner):
            tier = HostKvTier(loaded.kv_caches, host_slots)
            self.runner.forward.host_tier = tier
            logger.info("KV offloading: a host tier of %d blocks (%.2f GiB of host memory on this rank)", host_slots,
                        tier.nbytes / (1 << 30))
        if config.enable_prompt_embeds:
            self._enable_prompt_embeds(config, loaded)
        # Which CUDA graphs to capture (ferrox/compilation_config.py), for the target and a draft model alike.
        plan = config.graph_plan(log=self.device.type == "cuda")
        # Draft-model speculation: the draft model and its twin KV cache (worker/draft_model.py).
        self.drafter: DraftProposer | MtpProposer | None = None
        if self.speculative is not None and self.speculative.method == "mtp":
            self.drafter = self._mtp_proposer(config, loaded)
        if self.speculative is not None and self.speculative.method == "draft_model":
            assert self.speculative.model is not None
            self.drafter = DraftProposer(
                self.speculative.model, num_speculative_tokens=self.speculative.num_speculative_tokens,
                target_vocab_size=self.vocab_size, num_blocks=loaded.num_blocks, block_size=config.block_size,
                max_num_seqs=loaded.max_num_seqs, max_model_len=self.max_model_len, dtype=loaded.dtype,
                device=self.device, load_format=config.load_format, seed=config.seed,
                cuda_graphs=plan.decode, graph_sizes=decode_capture_sizes(plan, loaded.max_num_seqs),
                keep_quantized=config.dtype == "auto" and config.quantization is None)
        # An engine dropped without shutdown() still releases its ranks (and the process group).
        self._finalizer = weakref.finalize(self, EngineCore._release, self.runner, self.executor, self.tp)
        self.cuda_graph_capture_s: float | None = None
        if self.device.type == "cuda" and plan.any:
            self.cuda_graph_capture_s = self.runner.capture_cuda_graphs(
                max_num_seqs=loaded.max_num_seqs, max_model_len=self.max_model_len, block_size=config.block_size,
                verify_len=verify_len(config.speculative_config), max_num_batched_tokens=loaded.max_num_batched_tokens,
                plan=plan,
            )
            if self.cuda_graph_capture_s is not None:
                logger.info("CUDA graphs captured in %.1f s: decode batches %s, piecewise token counts %s",
                            self.cuda_graph_capture_s, self.runner.decode_graph_sizes(),
                            self.runner.piecewise_graph_sizes())
            if isinstance(self.drafter, MtpProposer) and plan.decode:
                # The MTP layer's pass and rounds (worker/mtp_graphs.py), after the target's on every rank.
                seconds = self.drafter.capture_cuda_graphs(decode_capture_sizes(plan, loaded.max_num_seqs))
                logger.info("MTP layer's CUDA graphs captured in %.1f s", seconds)
        # Every kernel variant a request can reach compiles now, not inside its latency (worker/warmup.py).
        self.warmup: WarmupReport | None = None
        if self.device.type == "cuda" and isinstance(self.runner, ModelRunner):
            limits = EngineLimits(max_num_seqs=loaded.max_num_seqs, max_num_batched_tokens=loaded.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, block_size=config.block_size,
                                  num_blocks=loaded.num_blocks,
                                  decode_graph_max=max(self.runner.decode_graph_sizes(), default=0))
            self.warmup = warm_up(self.runner, limits, vocab_size=self.vocab_size, seed=config.seed)
            logger.info("warm-up: %s", self.warmup.summary())
        if config.calculate_kv_scales:
            if not isinstance(self.runner, ModelRunner):
                raise ValueError("calculate_kv_scales: a pooling model keeps no KV cache to scale")
            self.runner.forward.arm_kv_scale_calibration()  # after the warm-up: the first real step measures
        self.pooling_warmup_s: float | None = None
        if isinstance(self.runner, PoolingRunner) and warmup_enabled():
            self.pooling_warmup_s = self.runner.warm_up(
                num_blocks=loaded.num_blocks, max_model_len=self.max_model_len, block_size=config.block_size,
                max_num_batched_tokens=loaded.max_num_batched_tokens, vocab_size=self.vocab_size)
            logger.info("warm-up: one pooling step in %.2f s", self.pooling_warmup_s)
        self.structured: Any = None  # StructuredOutputManager, created on first constrained request
        # Async scheduling: the step launched last and not yet reported.
        # N-gram speculation can overlap (async_scheduling=True): the core schedules the next step as
        # if every draft in flight were accepted and the runner shifts it back on the device
        # (Scheduler docs). It is not the default: a proposal made before the step in flight is
        # verified is accepted less often (H200, SmolLM2 copying code: 0.36 vs 0.54 of drafts), which
        # costs more than the overlap gains wherever drafts are accepted (benches/RESULTS.md). A draft
        # model proposes from verified tokens, so it always runs synchronous steps.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.device.type == "cuda" and self.speculative is None and not pooling
                                 and not self.custom_logits_classes)
        self._in_flight: StepHandle | None = None
        # The step in flight and its grammar mask being filled on the mask thread (async scheduling).
        self._masked: tuple[StepHandle, Future[Any]] | None = None
        self.fill_masks_in_background = True  # (benchmarks turn it off for an A/B in one process)
        # The core's request slots -> request ids (the core's outputs name slots).
        self._req_of_slot: list[str | None] = []
        self._slot_of_req: dict[str, int] = {}
        self._pending_prompt_logprobs: dict[str, Any] = {}
        # Sleep mode (ferrox/sleep_mode.py): the memory regions across the ranks, and whether scheduling is paused.
        self.sleeper: SleepControl | None = None
        if loaded.sleep_memory is not None:
            assert loaded.reload_model is not None
            self.sleeper = SleepControl(loaded.sleep_memory, loaded.reload_model,
                                        getattr(self.runner, "channel", None), self.tp)
        logger.info(
            "engine ready in %.1f s (warm-up %.1f s): model=%s device=%s dtype=%s max_model_len=%d kv_blocks=%d "
            "(%d tokens)", time.perf_counter() - start, self.warmup.seconds if self.warmup is not None else 0.0,
            self.model_name, self.device, loaded.dtype, self.max_model_len, self.num_kv_blocks, self.kv_capacity_tokens,
        )

    # ---- properties -----------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size  # the null block holds nothing

    # ---- requests ---------------------------------------------------------------------------------------
    def _atomic_spans(self, items: Any) -> list[tuple[int, int]]:
        """The prompt ranges computed whole in one step: every multimodal item's under --disable-chunked-mm-input
        (vLLM's), else the images whose tokens attend to each other both ways (audio clips stay causal, cut over
        prefill chunks as text is)."""
        if self.config.disable_chunked_mm_input:
            return [(item.offset, item.end) for item in items]
        if getattr(self.runner.model, "bidirectional_images", False):
            return [(item.offset, item.end) for item in items if item.modality != "audio"]
        return []

    def add_request(self, request: EngineCoreRequest) -> None:
        """Validate and queue. Raises ValueError / FerroxError naming the problem; nothing is queued then."""
        if self.pooler_config is not None or request.pooling_params is not None:
            self._add_pooling_request(request)
            return
        params = request.sampling_params
        prompt = request.prompt_token_ids
        self.validate_prompt(prompt, params, what=f"request {request.request_id!r}", request_id=request.request_id)
        params = self.encode_bad_words(params)  # (the fronts encode them already: then as given)
        embeds = prompt_embeds.is_embeds(request.mm_inputs)
        if embeds:
            request.mm_inputs = [self._load_prompt_embeds(request)]
        elif request.mm_inputs:
            check_items(request.mm_inputs, prompt, self.runner.model, f"request {request.request_id!r}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(prompt)
        wait_for_grammar = False
        lora_id = request.lora_int_id
        if lora_id:
            if self.loras is None:
                raise InvalidArgumentError("lora_request: LoRA is not enabled on this engine (start it with "
                                           "enable_lora=True / --enable-lora)", param="lora_request")
            self.loras.admit(request.request_id, lora_id, request.lora_name, request.lora_path)
        if params.structured_outputs is not None:
            # A reasoning model's constraint applies to its answer: from its `</think>` on, unless the
            # prompt already closed the thinking (vLLM's rule), or structured_outputs_config's
            # enable_in_reasoning constrains the thinking too.
            gate = (self.reasoning.end_token_id if self.reasoning is not None and not self.so_defaults.enable_in_reasoning
                    and not self.reasoning.prompt_ends_reasoning(prompt) else None)
            self._structured().submit(request.request_id, with_defaults(params.structured_outputs, self.so_defaults),
                                      gate_token=gate)
            wait_for_grammar = True
        if params.thinking_token_budget is not None:
            self._structured().add_budget(request.request_id, self._thinking_budget(params, prompt))
        try:
            slot = self.scheduler.add_request(
                request.request_id,
                prompt,
                max_tokens=max_tokens,
                min_tokens=params.min_tokens,
                ignore_eos=params.ignore_eos,
                stop_token_ids=params.stop_token_ids or [],
                stop=params.stop_list,
                include_stop_str_in_output=params.include_stop_str_in_output,
                repetition_detection=None if params.repetition_detection is None else params.repetition_detection.as_rule(),
                skip_special_tokens=params.skip_special_tokens,
                detokenize=params.detokenize,
                priority=request.priority,
                # Prompt logprobs need every prompt position computed, so such a request must not
                # reuse cached blocks: a salt of its own id keeps its block hashes private.
                cache_salt=request.request_id if params.prompt_logprobs is not None else request.cache_salt,
                wait_for_grammar=wait_for_grammar,
                allow_drafts=_drafts_allowed(params),
                lora_id=lora_id,
                lora_name=request.lora_name if lora_id else None,
                # Two prompts with different images have the same placeholder ids: the images' hashes
                # separate the blocks that hold them (and those after), as vLLM's extra keys do.
                mm_items=[(item.hash, item.offset, item.length) for item in request.mm_inputs or ()],
                atomic_spans=self._atomic_spans(request.mm_inputs or ()),
            )
        except BaseException:
            if wait_for_grammar or params.thinking_token_budget is not None:
                self.structured.free([request.request_id])
            if self.loras is not None:
                self.loras.release([request.request_id])
            raise
        if slot >= len(self._req_of_slot):
            self._req_of_slot.extend([None] * (slot + 1 - len(self._req_of_slot)))
        self._req_of_slot[slot] = request.request_id
        self._slot_of_req[request.request_id] = slot
        assert isinstance(self.runner, ModelRunner)  # (a pooling engine's requests went to _add_pooling_request)
        # An embeddings prompt's placeholder ids are not its tokens: the runner's penalties count none of them.
        self.runner.add_request(slot, request.request_id, [] if embeds else prompt, params, lora_id=lora_id,
                                images=request.mm_inputs)

    def _enable_prompt_embeds(self, config: EngineConfig, loaded: LoadedModel) -> None:
        problem = prompt_embeds.startup_problem(
            loaded.model, tensor_parallel_size=config.tensor_parallel_size,
            speculative=self.speculative is not None, pooling=self.pooler_config is not None)
        if problem is not None:
            self._stop_ranks(timeout_s=0)
            raise ValueError(f"enable_prompt_embeds: {problem}")
        assert isinstance(self.runner, ModelRunner)
        if self.runner.images is None:
            self.runner.images = ImageEmbeddings(loaded.model, self.device)

    def _load_prompt_embeds(self, request: EngineCoreRequest) -> MultiModalItem:
        """The request's embeddings, decoded and checked (InvalidArgumentError naming prompt_embeds)."""
        what = f"request {request.request_id!r}: prompt_embeds"
        if not self.config.enable_prompt_embeds:
            raise InvalidArgumentError(f"{what}: start the engine with enable_prompt_embeds=True / "
                                       "--enable-prompt-embeds to pass prompt embeddings", param="prompt_embeds")
        params = request.sampling_params
        if params.prompt_logprobs is not None:
            raise InvalidArgumentError(f"{what}: prompt_logprobs is not compatible with prompt embeddings (there are "
                                       "no prompt tokens to score)", param="prompt_logprobs")
        assert request.mm_inputs is not None
        if len(request.mm_inputs) != 1:
            raise InvalidArgumentError(f"{what}: one embeddings item per prompt, and no images with it",
                                       param="prompt_embeds")
        return prompt_embeds.load_item(request.mm_inputs[0], len(request.prompt_token_ids),
                                       int(self.spec.hidden_size), what)

    def _thinking_budget(self, params: SamplingParams, prompt: list[int]) -> Any:
        from ferrox.structured.thinking_budget import ThinkingBudget

        assert self.reasoning is not None and params.thinking_token_budget is not None  # validate_prompt
        # validate_prompt refused a parser without single start / end tokens (gpt-oss's harmony).
        assert self.reasoning.start_token_id is not None and self.reasoning.end_token_id is not None
        return ThinkingBudget(params.thinking_token_budget, self.reasoning.start_token_id,
                              self.reasoning.end_token_id, prompt, self.reasoning.answer_token_ids)

    def validate_prompt(
        self, prompt: list[int], params: SamplingParams, what: str | None = None, *, request_id: str | None = None
    ) -> None:
        """The request rules (ferrox.engine.validation) against this engine's limits; with request_id,
        also that no live request has that id. Raises InvalidArgumentError (param = the field)."""
        from ferrox.engine import validation

        if self.pooler_config is not None:
            raise InvalidArgumentError(f"runner: {self.model_name} runs with runner 'pooling' (an embedding model): "
                                       "it cannot generate text; use embed() / encode() or /v1/embeddings",
                                       param="runner")
        if request_id is not None:
            validation.check_request_id(request_id, self._slot_of_req.__contains__)
        limits = validation.RequestLimits(
            max_model_len=self.max_model_len,
            kv_capacity_tokens=self.kv_capacity_tokens,
            vocab_size=self.vocab_size,
            max_logprobs=self.config.max_logprobs,
            reasoning_end_token_id=self.reasoning.end_token_id if self.reasoning is not None else None,
            reasoning_parser=self.reasoning.name if self.reasoning is not None else None,
            has_tokenizer=not self.config.skip_tokenizer_init,
            logits_processors=self.custom_logits_classes,
        )
        validation.validate_request(prompt, params, limits, what=what)

    def encode_bad_words(self, params: SamplingParams) -> SamplingParams:
        """params with bad_words encoded by this engine's tokenizer (ferrox.bad_words; a 400-class error past
        their token bound); as given when there are none or they are encoded already."""
        if self.config.skip_tokenizer_init:
            from ferrox.engine import validation

            validation.check_without_tokenizer(params)  # (bad_words refused by name, not by the encoder)
        return with_bad_words_token_ids(params, lambda text: self.tokenizer.encode(text, add_special_tokens=False),
                                        self.vocab_size)

    # ---- pooling requests (runner "pooling") ------------------------------------------------------------
    def validate_pooling_prompt(self, prompt: list[int], params: PoolingParams, what: str | None = None, *,
                                request_id: str | None = None) -> None:
        """A pooling request's rules (ferrox.pooling.params) against this engine; InvalidArgumentError naming
        the field, also for a pooling request on a generation engine."""
        if self.pooler_config is None:
            raise InvalidArgumentError(f"runner: {self.model_name} runs with runner 'generate': it does not pool "
                                       "embeddings (start it with runner 'pooling' to embed with it)", param="runner")
        if request_id is not None:
            check_request_id(request_id, self._slot_of_req.__contains__)
        validate_pooling_request(prompt, params, self.pooler_config, max_model_len=self.max_model_len,
                                 vocab_size=self.vocab_size, what=what, model_name=self.model_name)

    def _add_pooling_request(self, request: EngineCoreRequest) -> None:
        """A pooling request: its prompt and one placeholder token (whatever its sampling_params say:
        ferrox.pooling.params.pooling_sampling_params), never detokenized; the runner pools the prompt in
        the step that computes it."""
        pooling = request.pooling_params
        if request.mm_inputs:
            raise InvalidArgumentError(f"request {request.request_id!r}: pooling requests take no images",
                                       param="multi_modal_data")
        if pooling is None:
            raise InvalidArgumentError(f"request {request.request_id!r}: {self.model_name} runs with runner 'pooling' "
                                       "(an embedding model): it cannot generate text", param="runner")
        prompt = request.prompt_token_ids
        self.validate_pooling_prompt(prompt, pooling, what=f"request {request.request_id!r}",
                                     request_id=request.request_id)
        slot = self.scheduler.add_request(request.request_id, prompt, max_tokens=1, ignore_eos=True, detokenize=False,
                                          priority=request.priority)
        if slot >= len(self._req_of_slot):
            self._req_of_slot.extend([None] * (slot + 1 - len(self._req_of_slot)))
        self._req_of_slot[slot] = request.request_id
        self._slot_of_req[request.request_id] = slot
        assert isinstance(self.runner, PoolingRunner)
        self.runner.add_request(slot, request.request_id, prompt, request.sampling_params, pooling_params=pooling)

    def abort_requests(self, request_ids: list[str]) -> StepResult:
        outs = self.scheduler.abort_requests(list(request_ids))
        result = self._result_of(outs)
        self._forget(result.req_ids, outs.slots)
        return result

    def _mtp_proposer(self, config: EngineConfig, loaded: Any) -> MtpProposer:
        """MTP speculation (worker/mtp_proposer.py): the checkpoint's MTP layer and its twin KV cache; the runner
        keeps each step's hidden states for it."""
        assert self.speculative is not None and isinstance(self.runner, ModelRunner)
        if self.speculative.model is not None and resolve_model(self.speculative.model).path != loaded.source.path:
            raise ValueError(f"speculative_config.model: method 'mtp' drafts with the served model's own MTP layer; "
                             f"{self.speculative.model!r} is another model (leave model out)")
        with use_tp_group(self.tp):  # (under tensor parallelism the layer is sharded as the model's)
            proposer = mtp_proposer(config, loaded, self.tp.size, self.runner.channel)
        assert proposer is not None
        self.runner.keep_hidden = True
        return proposer

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> StepResult:
        if self.paused:
            return StepResult()  # asleep: requests wait (their memory may be unmapped)
        if self.thread_governor is not None:
            self.thread_governor.maybe_adjust()
        parts = [self._poll_structured()]
        drafts = self.drafter.propose() if self.drafter is not None else {}
        so = self.scheduler.schedule(keep_in_flight=self.async_scheduling, **drafts)
        self._sample_masked()
        prev, self._in_flight = self._in_flight, None
        handle = None
        if so.num_reqs:
            # If launch raises, the scheduler rolls back the undelivered steps at the next schedule().
            handle = self.runner.launch(so, prev)
            if self.drafter is not None:
                self.drafter.shadow(so)
        elif isinstance(self.runner, ModelRunner):
            self.runner.release_unlaunched(so)  # (what it reports finished holds no hybrid state row any more)
        needs_mask = handle is not None and self._has_constrained_rows(so)
        if handle is not None:
            # prev's tokens are still on the device (not yet handed to the core): penalties and
            # min_tokens count them from there, whether this step samples now or after the mask.
            self.runner.prepare_sampling(handle, prev.in_flight() if prev is not None else None)
            if not needs_mask:
                self.runner.sample(handle)
        done = None
        if prev is not None:
            # Requests preempted by this schedule() dropped their sample of `prev` in the core:
            # their grammars must not advance by it either.
            done = self._finish(prev, skip=so.preempted_req_ids)
        if handle is not None and needs_mask:
            # The mask needs the grammars advanced by `prev` (just done), not the core's update of
            # it, which follows: the device waits for this sample, the core's bookkeeping does not.
            if self.async_scheduling and self.fill_masks_in_background and isinstance(self.runner, ModelRunner) \
                    and self.runner.can_gate_masks and handle.num_drafts is None:
                # Sampled now, behind a gate the device waits at until the mask thread has filled
                # the mask (worker/mask_gate.py): nor the fill nor this sampling's host work waits.
                self._sample_gated(handle, so)
            elif self.async_scheduling and self.fill_masks_in_background:
                # Filled on the mask thread while this thread reports `prev`, returns the step's
                # outputs and schedules the next step; sampled before the next launch.
                self._masked = (handle, self.structured.in_background(functools.partial(self._grammar_bitmask, so)))
            else:
                self.runner.sample(handle, self._grammar_bitmask(so))
        if prev is not None and done is not None:
            parts.append(self._report(prev, *done))
        if handle is not None:
            if self.async_scheduling:
                self._in_flight = handle
            else:
                parts.append(self._report(handle, *self._finish(handle)))
        return StepResult.concat(parts)

    def _sample_gated(self, handle: StepHandle, so: Any) -> None:
        """Queue the sampling of a constrained step behind a mask gate, and the mask's fill on the
        mask thread. The matchers are taken here: until `_finish` waits for the fill, only the mask
        thread touches them."""
        assert isinstance(self.runner, ModelRunner)
        constrained = self.structured.constrained_rows(so.req_ids, handle.sample_mask)
        if not constrained:  # only partial prefill chunks are constrained: nothing to mask
            self.runner.sample(handle)
            return
        matchers = [m for m, _ in constrained]
        pending = self.runner.open_mask_gate(np.array([i for _, i in constrained], dtype=np.int64),
                                             self.structured.mask_words)

        def fill() -> None:
            try:
                self.structured.fill_rows(matchers, pending.host)
            finally:
                pending.release()  # a failed fill must not hang the device: _finish fails the rows

        pending.fill = self.structured.in_background(fill)
        self.runner.sample(handle, pending)

    def _sample_masked(self) -> None:
        """Queue the sampling of the step in flight whose grammar mask was being filled (its tokens
        feed the next launch, so this comes first)."""
        if self._masked is None:
            return
        (handle, mask), self._masked = self._masked, None
        self.runner.sample(handle, mask.result())

    def _grammar_bitmask(self, so: Any) -> Any:
        """The step's allow-bits: a row per request, or (drafts to verify) a row per verified position."""
        num_drafts = np.asarray(so.num_draft_tokens, dtype=np.int32)
        if self.speculative is not None and num_drafts.any():
            return self.structured.fill_bitmask_with_drafts(so.req_ids, np.asarray(so.sample_mask), num_drafts,
                                                            np.asarray(so.draft_token_ids, dtype=np.int64))
        return self.structured.fill_bitmask(so.req_ids, so.sample_mask)

    def _has_constrained_rows(self, so: Any) -> bool:
        structured = self.structured
        return structured is not None and structured.has_active() and any(
            structured.is_constrained(r) for r in so.req_ids)

    def _finish(self, handle: StepHandle, skip: Any = ()) -> tuple[ModelRunnerOutput, Any]:
        """Wait for a launched step and advance its requests' grammars by the sampled tokens.
        Returns the runner's output and force_stop (grammar complete) for `_report`."""
        result = self.runner.finish(handle)
        if handle.pending_mask is not None:
            problem, rows = handle.pending_mask.problem(), handle.pending_mask.rows
            handle.pending_mask = None
            if problem is not None:
                logger.error("step with grammar rows: %s; failing those requests", problem)
                for row in rows.tolist():
                    result.errors.setdefault(row, problem)
        force_stop = None
        if self.structured is not None and self.structured.has_active():
            so = handle.so
            mask = handle.sample_mask
            if skip or result.errors:
                dropped = set(skip) | {so.req_ids[i] for i in result.errors}
                mask = mask & np.array([r not in dropped for r in so.req_ids], dtype=np.bool_)
            counts = result.num_sampled_tokens
            before = counts.copy() if counts is not None else None
            force_stop = self.structured.accept_tokens(so.req_ids, result.sampled_token_ids, mask, num_sampled=counts)
            if before is not None and counts is not None and (counts != before).any():
                # A grammar completed inside a run of kept drafts: its later tokens are dropped.
                starts = np.concatenate(([0], np.cumsum(before)[:-1]))
                keep = np.concatenate([np.arange(s, s + c) for s, c in zip(starts.tolist(), counts.tolist(), strict=True)])
                result.sampled_token_ids = result.sampled_token_ids[keep]
        return result, force_stop

    def _report(self, handle: StepHandle, result: ModelRunnerOutput, force_stop: Any) -> StepResult:
        """Hand a finished step's tokens to the core (append, detokenize, stops, free)."""
        failed: list[StepRow] = []
        if result.errors:
            # The failed rows' samples are garbage: end those requests before the core sees them.
            failed = self._fail({handle.so.req_ids[i]: msg for i, msg in result.errors.items()})
        outs = self.scheduler.update_from_output(result.sampled_token_ids, force_stop,
                                                 num_sampled_tokens=result.num_sampled_tokens)
        if self.kv_events is not None:
            self._publish_kv_events()
        if self.drafter is not None:
            self.drafter.record(handle, outs)
        self._pending_prompt_logprobs.update(result.prompt_logprobs)
        step = self._result_of(outs)
        if result.pooled:
            step.set_pooled(result.pooled)
        slots = outs.slots
        self.runner.append_accepted(slots, outs.token_ids, outs.token_offsets)
        if result.logprobs:
            row_of_slot = {int(s): i for i, s in enumerate(handle.slots)}
            offsets = outs.token_offsets
            for j, slot in enumerate(slots.tolist()):
                lp = result.logprobs.get(row_of_slot.get(slot, -1))
                if lp is not None:
                    # A stop inside a run of kept drafts appends fewer tokens than were scored.
                    step.logprobs[j] = _first_positions(lp, max(int(offsets[j + 1] - offsets[j]), 1))
        if self._pending_prompt_logprobs:
            for j, rid in enumerate(step.req_ids):
                plp = self._pending_prompt_logprobs.pop(rid, None)
                if plp is not None:
                    step.prompt_logprobs[j] = plp
        finished = np.flatnonzero(outs.finish_reasons)
        if finished.size:
            self._finished(step, finished, slots)
        return StepResult.concat([step, StepResult.from_rows(failed)]) if failed else step

    def _result_of(self, outs: Any) -> StepResult:
        req_of_slot = self._req_of_slot
        return StepResult.from_core(outs, [req_of_slot[s] for s in outs.slots.tolist()])  # type: ignore[misc]

    def _finished(self, step: StepResult, rows: Any, slots: Any) -> None:
        ids = [step.req_ids[i] for i in rows.tolist()]
        if self.structured is not None:
            for i, rid in zip(rows.tolist(), ids, strict=True):
                error = self.structured.error_for(rid)
                if error is not None:
                    step.errors[i] = f"structured output: {error}"
        self._forget(ids, slots[rows])

    def _fail(self, errors: dict[str, str]) -> list[StepRow]:
        """Finish failed requests with finish_reason 'error' (their blocks go back at once)."""
        outs = self.scheduler.abort_requests(list(errors))
        self._forget(list(errors), outs.slots)
        return [StepRow(request_id=rid, finish_reason="error", error=msg) for rid, msg in errors.items()]

    def _forget(self, request_ids: list[str], slots: Any) -> None:
        """A request left the core (finished, aborted, failed): free its runner row and slot."""
        self.runner.remove_requests(slots)
        for slot in slots.tolist():
            self._req_of_slot[slot] = None
        for rid in request_ids:
            self._slot_of_req.pop(rid, None)
            self._pending_prompt_logprobs.pop(rid, None)
        if self.structured is not None:
            self.structured.free(list(request_ids))
        if self.loras is not None:
            self.loras.release(list(request_ids))

    # ---- structured outputs (llguidance) --------------------------------------------------------------
    def _structured(self) -> Any:
        if self.structured is None:
            from ferrox.structured.manager import StructuredOutputManager

            if self.tokenizer_json is None:  # (validation refuses such requests first)
                raise InvalidArgumentError("structured_outputs: needs the tokenizer, which this engine runs without "
                                           "(skip_tokenizer_init)", param="structured_outputs")
            self.structured = StructuredOutputManager(self.tokenizer_json, self.vocab_size, self.eos_token_ids)
        return self.structured

    def _poll_structured(self) -> StepResult:
        """Release requests whose grammar compiled; fail those whose grammar did not."""
        if self.structured is None:
            return StepResult()
        if self.structured.num_pending():
            ready = self.structured.poll_ready()
            if ready:
                self.scheduler.grammar_ready(ready)
        failures = dict(self.structured.take_failures())
        if not failures:
            return StepResult()
        return StepResult.from_rows(self._fail({rid: f"structured output: {msg}" for rid, msg in failures.items()}))

    def wait_for_work(self, timeout: float) -> None:
        """Nothing schedulable but grammars compiling: block until one is ready (no busy loop)."""
        if self.structured is not None:
            self.structured.wait_for_pending(timeout)

    # ---- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) ----------------------------------
    def add_lora(self, lora_name: str, lora_int_id: int, lora_path: str) -> bool:
        """Load an adapter now (requests naming it later start without the read); raises
        LoRAAdapterError naming the file and field."""
        self._loras().add(lora_name, lora_int_id, lora_path)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (after the requests still using it finish); False if unknown."""
        return self._loras().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._loras().list_ids()

    def _loras(self) -> EngineLoRAs:
        if self.loras is None:
            raise InvalidArgumentError("LoRA is not enabled on this engine (start it with enable_lora=True / "
                                       "--enable-lora)", param="enable_lora")
        return self.loras

    # ---- sleep mode (vLLM's sleep / wake_up / is_sleeping / reload_weights; ferrox/sleep_mode.py) --------
    @property
    def paused(self) -> bool:
        """Asleep (at any level), or the weights discarded and not yet reloaded: step() runs nothing."""
        return self.sleeper is not None and self.sleeper.paused

    def is_sleeping(self) -> bool:
        return self.sleeper is not None and self.sleeper.sleeping

    def sleep(self, level: int = 1, mode: str = "abort", tags: list[str] | None = None) -> StepResult:
        """Stop scheduling and release the memory of the level's (or the given) tags. mode "abort" finishes
        every unfinished request with finish_reason "abort" (returned); "wait" needs none to be left (the
        core process holds new ones back until they are: engine/core_process.py); "keep" preempts the
        running ones, which recompute their tokens after the wake-up. Returns the outputs this
        produced, the last in-flight step's included."""
        release, offload = self.sleep_plan(level, mode, tags)
        assert self.sleeper is not None  # (sleep_plan refused an engine without it)
        parts = []
        unfinished = list(self._slot_of_req)
        if mode == "abort" and unfinished:
            parts.append(self.abort_requests(unfinished))
        elif mode == "wait" and unfinished:
            raise InvalidArgumentError(f"mode: 'wait' but {len(unfinished)} request(s) are unfinished", param="mode")
        # Async scheduling: the step still in flight reports now (its rows of aborted requests are dropped).
        parts.extend(self._settle_in_flight())
        if KV_CACHE in release and KV_CACHE not in self.sleeper.memory.asleep:
            if mode == "keep":
                # Their KV blocks are about to be discarded: recomputed after the wake-up (preemption by recompute).
                self.scheduler.preempt_all()
            if not self.scheduler.reset_prefix_cache():
                raise RuntimeError("sleep: the prefix cache could not be reset (KV blocks still in use)")
        self.sleeper.sleep(list(release), offload)
        logger.info("asleep (level %d%s): %s released%s", level, f", tags {list(tags)}" if tags else "",
                    "+".join(release) or "nothing", "" if offload or WEIGHTS not in release else
                    " (weights discarded: collective_rpc('reload_weights') after the wake-up)")
        return StepResult.concat(parts)

    def sleep_plan(self, level: int = 1, mode: str = "abort",
                   tags: list[str] | None = None) -> tuple[tuple[str, ...], bool]:
        """ferrox.sleep_mode.sleep_plan for this engine: also refuses discarding weights it could not reload."""
        release, offload = sleep_plan(self.sleeper is not None, level, mode, tags)
        if WEIGHTS in release and not offload:
            self._check_reloadable("tags" if tags else "level")
        return release, offload

    def _check_reloadable(self, param: str) -> None:
        assert self.sleeper is not None
        if self.loras is not None or not self.sleeper.memory.reloadable:
            raise InvalidArgumentError(
                f"{param}: discarding and reloading the weights is not supported with LoRA enabled (wrapped layers) or "
                "for a quantized GGUF on CPU (matrices packed in Rust); use level 1 (or dtype='float32')", param=param)

    def _settle_in_flight(self) -> list[StepResult]:
        """Async scheduling: finish and report the step in flight without scheduling another."""
        self._sample_masked()
        prev, self._in_flight = self._in_flight, None
        return [] if prev is None else [self._report(prev, *self._finish(prev))]

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the tags' memory again (default: all); scheduling resumes once no tag sleeps (and discarded
        weights were reloaded)."""
        which = wake_tags(self.sleeper is not None, tags)
        assert self.sleeper is not None
        woken = self.sleeper.wake(which)
        logger.info("wake-up: %s restored%s", "+".join(woken) or "nothing",
                    f"; still asleep: {'+'.join(sorted(self.sleeper.memory.asleep))}" if self.sleeper.sleeping
                    else "")

    def collective_rpc(self, method: str, args: list[Any] | None = None,
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's collective_rpc for the worker methods ferrox has: "reload_weights" (the checkpoint read
        again into the served weights, on every rank). One result per rank."""
        check_rpc(method)
        if args or kwargs:
            raise InvalidArgumentError(f"args: {method} takes no arguments", param="args")
        if self.sleeper is None:
            raise InvalidArgumentError(f"method: {method} needs enable_sleep_mode=True (ferrox serve "
                                       "--enable-sleep-mode), which keeps the weights reloadable", param="method")
        self._check_reloadable("method")
        self.sleeper.reload_weights()
        return [None] * self.tp.size

    # ---- admin ----------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        reset = self.scheduler.reset_prefix_cache()
        if self.kv_events is not None:
            self._publish_kv_events()  # (AllBlocksCleared, now: no step may follow soon)
        return reset

    def _publish_kv_events(self) -> None:
        assert self.kv_events is not None
        events = self.scheduler.take_kv_events()
        if events:
            self.kv_events.publish(to_batch(events, self.block_size, self._lora_names(), self._kv_events_rank))

    def _lora_names(self) -> dict[int, str]:
        """The loaded adapters' names by id (a stored block's lora_name)."""
        if self.loras is None:
            return {}
        ids = self.loras.list_ids()
        return dict(zip(ids, self.loras.names(ids), strict=True))

    def start_profile(self) -> None:
        """The torch profiler over this process's steps (engine/profiler.py; VLLM_TORCH_PROFILER_DIR)."""
        self.profiler.start()

    def stop_profile(self) -> None:
        self.profiler.stop()

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
        if self.host_tier_slots:  # the host tier's (rust/host_tier.rs): tokens served, blocks held
            stats.update(host_cache_hits=s.host_cache_hits, host_cache_blocks=s.host_cache_blocks,
                         host_cache_queries=s.prefix_cache_queries)  # (every lookup asks both tiers)
        if self.speculative is not None:
            # Cumulative, vLLM's spec_decode counters (metrics/prometheus.py, metrics/log_stats.py).
            stats.update(num_speculative_tokens=self.speculative.num_speculative_tokens, spec_num_drafts=s.num_drafts,
                         spec_num_draft_tokens=s.num_draft_tokens, spec_num_accepted_tokens=s.num_accepted_tokens,
                         spec_num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos))
        if self.loras is not None:  # vLLM's lora_requests_info gauge (metrics/prometheus.py)
            stats["lora_info"] = {"running": self.loras.names(s.running_lora_ids),
                                  "waiting": self.loras.names(s.waiting_lora_ids), "max_lora": self.config.max_loras}
        if self.sleeper is not None:  # vLLM's engine_sleep_state gauge (metrics/prometheus.py)
            memory = self.sleeper.memory
            stats.update(is_sleeping=self.sleeper.sleeping, discard_all=memory.weights_discarded,
                         weights_offloaded=WEIGHTS in memory.asleep and not memory.weights_discarded)
        stats.update(
            kv_capacity_tokens=self.kv_capacity_tokens,
            num_kv_blocks=self.num_kv_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            cache_config=self._cache_config_info,
        )
        return stats

    def shutdown(self) -> None:
        self._masked = None
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None
        if isinstance(self.runner, ModelRunner):
            self.runner.release_mask_gates()
        if self.structured is not None:
            self.structured.shutdown()
        self._finalizer()

    def _stop_ranks(self, timeout_s: float) -> None:
        if self.executor is not None:
            self.executor.shutdown(timeout_s=timeout_s)
            destroy_tp_group(self.tp)

    @staticmethod
    def _release(runner: ModelRunner | PoolingRunner, executor: Executor | None, tp: TPGroup) -> None:
        """Tell the other ranks to stop, wait for them, leave the process group."""
        if executor is None:
            return
        try:
            runner.shutdown()
        except Exception:  # noqa: BLE001 - a rank already gone: stop the rest below
            logger.warning("could not send SHUTDOWN to the tensor-parallel ranks", exc_info=True)
        destroy_tp_group(tp)  # with the other ranks, which leave the group on SHUTDOWN
        executor.shutdown()


# ---- speculative decoding ------------------------------------------------------------------------
def _check_speculative(config: EngineConfig) -> SpeculativeConfig | None:
    """The parsed speculative_config, or ValueError (naming the field) for what this version cannot run:
    it fails at start-up rather than accept the setting and ignore it."""
    spec = parse_speculative_config(config.speculative_config)
    if spec is None:
        return None
    if config.async_scheduling and spec.method in ("draft_model", "mtp"):
        raise ValueError(f"async_scheduling: not supported with speculative_config method '{spec.method}' (its "
                         "drafts come from the verified tokens, so it runs synchronous steps; leave "
                         "async_scheduling unset, or use method 'ngram', which overlaps)")
    if spec.method == "mtp" and config.enable_sleep_mode:
        raise ValueError("enable_sleep_mode: not supported with speculative_config method 'mtp' in this version (the "
                         "MTP layer's weights and KV cache live outside the regions a sleep releases)")
    if spec.method == "draft_model" and config.tensor_parallel_size > 1:
        raise ValueError("speculative_config: method 'draft_model' runs with tensor_parallel_size 1 only in this "
                         "version ('ngram' and 'mtp' work with tensor parallelism)")
    return spec


def _speculative_scheduler_args(spec: SpeculativeConfig | None) -> dict[str, Any]:
    if spec is None:
        return {}
    # (The core takes an MTP layer's drafts as a draft model's: handed to schedule().)
    method = "draft_model" if spec.method == "mtp" else spec.method
    return dict(num_speculative_tokens=spec.num_speculative_tokens, speculative_method=method,
                prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max)


def _first_positions(lp: Logprobs, n: int) -> Logprobs:
    if len(lp.token_ids) <= n:
        return lp
    return Logprobs(lp.token_ids[:n], lp.logprobs[:n], lp.ranks[:n], lp.top_token_ids[:n], lp.top_logprobs[:n])


def _drafts_allowed(params: SamplingParams) -> bool:
    """Whether a request may speculate. The verifier applies a request's sampling settings at every draft
    position by repeating its row (worker/spec_decode.py); settings that depend on the tokens before
    the position are not handled per position, so their requests decode one token a step:
    penalties and min_tokens (counts change within the run), bad words of several tokens (the ban of the
    last waits for the others), and a thinking budget (its forced `</think>`
    is one row: structured/thinking_budget.py). A grammar walks each draft (the mask of
    every verified position: StructuredOutputManager.fill_bitmask_with_drafts), and logprobs are
    reported for every kept token."""
    return (params.min_tokens == 0 and params.thinking_token_budget is None
            and all(len(seq) == 1 for seq in params.bad_words_token_ids or [])
            and params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0
            and params.presence_penalty == 0.0)
