"""`LLM`: the offline batch API. The engine core runs in this process.

    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ferrox.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    check_beam_search,
    one_token_params,
    step_logprobs,
)
from ferrox.config import EngineConfig
from ferrox.engine.defaults import default_sampling_params, resolve_generation_defaults
from ferrox.engine.engine_core import EngineCore
from ferrox.engine.input_processor import (
    ProcessedPrompt,
    PromptInput,
    attach_images,
    is_conversation_list,
    normalize_prompts,
    process_prompt,
    refuse_images,
    render_chat,
)
from ferrox.engine.lora_state import check_lora_request, lora_fields
from ferrox.engine.offline_stats import OfflineStats
from ferrox.engine.output_processor import OutputProcessor
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import InvalidArgumentError, RequestError
from ferrox.multimodal.prompt_embeds import is_embeds
from ferrox.outputs import (
    AnyRequestOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ferrox.pooling.params import PoolingParams, pooling_sampling_params
from ferrox.pooling.score import cosine_similarity, distinct, pair_labels, score_pairs
from ferrox.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from ferrox.lora.request import LoRARequest
    from ferrox.metrics.reader import Metric

OutputT = TypeVar("OutputT", RequestOutput, PoolingRequestOutput)
R = TypeVar("R")


class LLM:
    def __init__(self, model: str | None = None, *, generation_config: str = "auto",
                 override_generation_config: dict[str, Any] | None = None, **engine_args: Any) -> None:
        """generation_config / override_generation_config: vLLM's engine arguments of those names (the
        requests' default sampling parameters: ferrox.engine.defaults.resolve_generation_defaults)."""
        resolve_generation_defaults(generation_config, {}, override_generation_config)  # a bad one fails first
        engine_args.setdefault("disable_log_stats", True)  # vLLM's LLM default (a server's is False)
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        if self.config.data_parallel_size > 1:
            # As in vLLM, offline data parallelism is one process per replica; this LLM is one engine.
            raise InvalidArgumentError(
                f"data_parallel_size: {self.config.data_parallel_size} is not supported by the offline LLM (it runs "
                "one engine core in this process); use `ferrox serve --data-parallel-size N` or "
                "AsyncLLM(data_parallel_size=N), or one LLM per GPU in separate processes (CUDA_VISIBLE_DEVICES)",
                param="data_parallel_size")
        if self.config.otlp_traces_endpoint:
            raise InvalidArgumentError("otlp_traces_endpoint: request spans are exported by the server's engine "
                                       "(ferrox serve, AsyncLLM); the offline LLM keeps no per-request timing",
                                       param="otlp_traces_endpoint")
        from ferrox.multimodal.media import allow_media_domains

        allow_media_domains(self.config.allowed_media_domains)  # (the images this process fetches)
        self.engine = EngineCore(self.config)
        self.engine.generation_defaults = resolve_generation_defaults(
            generation_config, self.engine.generation_defaults, override_generation_config)
        self.output_processor = OutputProcessor(None if self.config.skip_tokenizer_init else self.engine.tokenizer)
        self._request_counter = itertools.count()
        # disable_log_stats=False: the periodic stats line and the metrics get_metrics() reads.
        self._stats: OfflineStats | None = None
        if not self.config.disable_log_stats:
            self._stats = OfflineStats(self.engine.model_name, self.engine.max_model_len,
                                       getattr(self.engine.image_prompts, "processor_cache", None))
            weakref.finalize(self, self._stats.close)

    # ---- public API -----------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of the engine's Prometheus metrics under their `vllm:` names, as objects
        (ferrox.metrics.reader: Counter, Gauge, Histogram, Vector), for an LLM made with
        disable_log_stats=False."""
        if self._stats is None:
            raise RuntimeError("get_metrics: stat logging is off (the LLM default, as in vLLM); create the LLM "
                               "with disable_log_stats=False")
        return self._stats.metrics()

    # ---- sleep mode (vLLM's; enable_sleep_mode=True: ferrox/sleep_mode.py) -----------------------------------
    def sleep(self, level: int = 1, mode: str = "abort", tags: list[str] | None = None) -> None:
        """Give the device memory back: level 1 keeps the weights in host memory and discards the KV
        cache; level 2 discards both (then wake_up(tags=["weights"]), collective_rpc("reload_weights"),
        wake_up(tags=["kv_cache"])); level 0 only pauses; tags=[...] discards what they name. Until the
        wake-up (and the reload), generate() and the other calls refuse to run."""
        self.engine.sleep(level, mode, tags)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory again (default: all of it; tags=["weights"] or ["kv_cache"] one part)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """True from sleep() until every released tag is awake again."""
        return self.engine.is_sleeping()

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's, for the worker methods ferrox has: "reload_weights" reads the checkpoint again into the
        served weights (after sleep(level=2) and wake_up(tags=["weights"]); enable_sleep_mode). One
        result per tensor-parallel rank."""
        if timeout is not None:
            # vLLM's bound on the wait; here the call runs in this thread, which nothing could interrupt.
            raise InvalidArgumentError("timeout: the offline LLM runs the call in this thread and cannot bound it; "
                                       "leave timeout unset (AsyncLLM.collective_rpc takes one)", param="timeout")
        return self.engine.collective_rpc(method, list(args), kwargs)

    def apply_model(self, func: Callable[[Any], R]) -> list[R]:
        """vLLM's: func(model) on each worker's model (a torch nn.Module of ferrox's own layers), one result
        per worker -- to inspect it, or change its weights in place (then reset_prefix_cache(): cached KV was
        computed with the old ones; in-place changes keep the addresses CUDA graphs read). One worker here:
        under tensor parallelism the other ranks' models live in their own processes, refused by name."""
        if self.config.tensor_parallel_size > 1:
            raise InvalidArgumentError(
                f"tensor_parallel_size: apply_model runs func in this process, and {self.config.tensor_parallel_size} "
                "ranks hold their shards in processes of their own", param="tensor_parallel_size")
        if self.engine.is_sleeping():
            raise RuntimeError("the engine is asleep (LLM.sleep): call LLM.wake_up() before apply_model (the "
                               "weights' memory may be released)")
        return [func(self.engine.runner.model)]

    def start_profile(self) -> None:
        """vLLM's: the torch profiler over the engine's steps until stop_profile, which writes a trace to
        VLLM_TORCH_PROFILER_DIR (profiling is off without it: engine/profiler.py)."""
        self.engine.start_profile()

    def stop_profile(self) -> None:
        self.engine.stop_profile()

    # ---- LoRA adapters (vLLM: llm.llm_engine.add_lora / remove_lora / list_loras) -----------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        check_lora_request(lora_request)
        return self.engine.add_lora(lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.engine.list_loras())

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request: one adapter for every prompt, or one (or None) per prompt (enable_lora=True)."""
        items = normalize_prompts(prompts)
        if not items:
            return []  # as vLLM: nothing asked, nothing to do (no progress bar, no engine step)
        tokenizer = self.engine.tokenizer
        processed = [attach_images(process_prompt(tokenizer, p, i), self.engine.image_prompts, f"prompts[{i}]",
                                   model_name=self.engine.model_name) for i, p in enumerate(items)]
        return self._run(processed, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template_content_format: str = "auto",
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """chat_template_content_format: message contents as the template gets them ("auto", "string",
        "openai": loader/chat_template.py), as vLLM's LLM.chat. mm_processor_kwargs: processor settings for
        these conversations' images over the engine's (multimodal/processing.py PROCESSOR_KWARGS)."""
        if isinstance(messages, Sequence) and not isinstance(messages, (str, Mapping)) and len(messages) == 0:
            return []  # no conversations (as generate([])); an empty conversation inside a list is an error
        # is_conversation_list checked the shape at run time; it returns a plain bool, so tell the
        # type checker which branch of the union each case is.
        conversations = cast(
            list[Sequence[Mapping[str, Any]]], list(messages) if is_conversation_list(messages) else [messages]
        )
        if not conversations or not conversations[0]:
            raise ValueError("messages: the conversation list is empty")
        template = chat_template if chat_template is not None else self.config.chat_template
        images = self.engine.image_prompts
        processed = [
            attach_images(render_chat(
                self.engine.tokenizer, conv, chat_template=template, add_generation_prompt=add_generation_prompt,
                tools=tools, chat_template_kwargs=chat_template_kwargs, index=i,
                content_format=chat_template_content_format,
                image_placeholder=images.placeholder if images is not None else None,
                video_placeholder=getattr(images, "video_placeholder", None),
                audio_placeholder=getattr(images, "audio_placeholder", None),
            ), images, f"messages[{i}]", model_name=self.engine.model_name, processor_kwargs=mm_processor_kwargs)
            for i, conv in enumerate(conversations)
        ]
        return self._run(processed, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: the beam_width best continuations of each prompt (ferrox.beam_search),
        each a BeamSearchSequence whose tokens and text are the prompt's and the beam's. Each step runs
        every live beam of up to concurrency_limit prompts (default: all) as one-token requests."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidArgumentError(f"params: expected BeamSearchParams, got {type(params).__name__}",
                                       param="params")
        items = normalize_prompts(prompts)
        tokenizer = self.engine.tokenizer
        processed = [refuse_images(process_prompt(tokenizer, p, i), f"prompts[{i}]", "beam search")
                     for i, p in enumerate(items)]
        loras = _lora_per_prompt(lora_request, len(processed))
        for i, p in enumerate(processed):
            check_beam_search(params, len(p.prompt_token_ids), max_model_len=self.engine.max_model_len,
                              max_logprobs=self.config.max_logprobs, what=f"prompts[{i}]: ")
        searches = [BeamSearch(p.prompt_token_ids, params, self.engine.eos_token_ids, lora)
                    for p, lora in zip(processed, loras, strict=True)]
        limit = concurrency_limit or len(searches) or 1
        step_params = one_token_params(params)
        for start in range(0, len(searches), limit):
            batch = searches[start:start + limit]
            steps: Iterable[int] = range(params.max_tokens)
            if use_tqdm:
                from tqdm.auto import tqdm

                steps = tqdm(steps, desc="Beam search", unit="token")
            for _ in steps:
                live = [s for s in batch if not s.done]
                if not live:
                    break
                beams = [(s, ids, s.beams[0].lora_request) for s in live for ids in s.step_prompts()]
                outs = self._run([ProcessedPrompt(None, ids) for _, ids, _ in beams], step_params, False,
                                 [lora for _, _, lora in beams])
                at = 0
                for s in live:
                    k = len(s.beams)
                    s.advance([step_logprobs(o) for o in outs[at:at + k]])
                    at += k
        results = []
        for s in searches:
            best = s.best()
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens, skip_special_tokens=True)
            results.append(BeamSearchOutput(sequences=best))
        return results

    # ---- pooling models (runner "pooling": an embedding model) -------------------------------------------
    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in prompt order (vLLM's LLM.embed). Prompts are texts (encoded with the
        model's special tokens, as transformers does; never truncated: a prompt longer than max_model_len is
        refused), {"prompt_token_ids": [...]} or lists of token ids. pooling_params: one for every prompt, or
        one per prompt (dimensions, normalize)."""
        outputs = self._encode(prompts, pooling_params, use_tqdm, task="embed")
        return [EmbeddingRequestOutput.from_base(out) for out in outputs]

    def encode(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt as a float32 array (vLLM's LLM.encode): an embedding model's
        vector (embed() gives lists), a classifier's class scores (classify() gives lists)."""
        return self._encode(prompts, pooling_params, use_tqdm)

    def _encode(self, prompts: PromptInput | Sequence[PromptInput],
                pooling_params: PoolingParams | Sequence[PoolingParams] | None, use_tqdm: bool,
                task: str | None = None) -> list[PoolingRequestOutput]:
        """task: what every prompt must compute (pooling/params.py TASKS; the model refuses one it does not
        do, naming `task`); None: what each PoolingParams says."""
        items = normalize_prompts(prompts)
        if not items:
            return []
        processed = self._pooling_prompts(items)
        params_list = _pooling_per_prompt(pooling_params, len(processed))
        if task is not None:
            params_list = [p.clone(task=task) for p in params_list]
        return self._pool(processed, params_list, use_tqdm, [f"prompts[{i}]" for i in range(len(processed))])

    def score(
        self,
        data_1: PromptInput | Sequence[PromptInput],
        data_2: PromptInput | Sequence[PromptInput],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest] | None = None,
        tokenization_kwargs: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score, one ScoringRequestOutput per pair in order. One data_1 pairs with every data_2
        (1:N), else they pair up one to one (N:N).

        An embedding model: the cosine similarity of each pair's embeddings; each side takes what embed()
        takes; every distinct prompt is embedded once, all in one batch. pooling_params: for every prompt
        (`dimensions` changes the vectors compared; `normalize` does not change a cosine).
        A sequence classifier (a cross-encoder reranker, a decoder reranker): each pair is read as ONE sequence,
        the tokenizer's pair encoding (`[CLS] a [SEP] b [SEP]`, BERT's token types 0 then 1; the texts joined
        into one string when config.json sets use_pad_token false, as vLLM does), and scored by the model's head
        and activation (a sigmoid for one label); texts only. pooling_params: use_activation=False gives
        the raw logit.
        lora_request, tokenization_kwargs and chat_template are refused by name."""
        for name, value in (("lora_request", lora_request), ("tokenization_kwargs", tokenization_kwargs or None),
                            ("chat_template", chat_template)):
            if value is not None:
                raise InvalidArgumentError(f"{name}: not supported by score() (each text is encoded with its "
                                           "special tokens, never truncated)", param=name)
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise InvalidArgumentError(f"pooling_params: expected one PoolingParams (it applies to every prompt), "
                                       f"got {type(pooling_params).__name__}", param="pooling_params")
        side_1, side_2 = _score_side(data_1, "data_1"), _score_side(data_2, "data_2")
        pairs = score_pairs(len(side_1), len(side_2))
        pooler = self.engine.pooler_config
        if pooler is not None and pooler.task == "classify":
            return self._cross_encode(side_1, side_2, pairs, pooling_params or PoolingParams(), use_tqdm,
                                      pooler.join_pair_texts)
        processed = self._pooling_prompts(side_1 + side_2)
        labels = [f"data_1[{i}]" for i in range(len(side_1))] + [f"data_2[{j}]" for j in range(len(side_2))]
        first, where = distinct([tuple(p.prompt_token_ids) for p in processed])
        outs = self._pool([processed[i] for i in first], [pooling_params or PoolingParams()] * len(first), use_tqdm,
                          [labels[i] for i in first])
        pad_id = self.engine.tokenizer.pad_token_id
        pad = [] if pad_id is None else [pad_id]
        results = []
        for i, j in pairs:
            a, b = outs[where[i]], outs[where[len(side_1) + j]]
            results.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                                ScoringOutput(cosine_similarity(a.outputs.data, b.outputs.data)),
                                                a.prompt_token_ids + pad + b.prompt_token_ids, True))
        return results

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's LLM.classify for a sequence-classification model: each prompt's class scores
        (`.outputs.probs`, config.json id2label order: softmax over several labels, a sigmoid for one;
        use_activation=False in pooling_params gives the logits). Prompts as embed() takes them."""
        outputs = self._encode(prompts, pooling_params, use_tqdm, task="classify")
        return [ClassificationRequestOutput.from_base(out) for out in outputs]

    def _cross_encode(self, side_1: list[PromptInput], side_2: list[PromptInput], pairs: list[tuple[int, int]],
                      pooling_params: PoolingParams, use_tqdm: bool, join_texts: bool) -> list[ScoringRequestOutput]:
        """score() on a cross-encoder: every pair one request, all in one batch (join_texts: the pair is the
        two texts joined into one string, PoolerConfig.join_pair_texts)."""
        texts: list[list[str]] = []
        for name, side in (("data_1", side_1), ("data_2", side_2)):
            for i, item in enumerate(side):
                if not isinstance(item, str):
                    raise InvalidArgumentError(f"{name}[{i}]: a cross-encoder scores pairs of texts (the tokenizer "
                                               "joins them); give a text, not token ids", param=name)
            texts.append([str(item) for item in side])
        encoded = self.engine.tokenizer.encode_pairs([(texts[0][i], texts[1][j]) for i, j in pairs],
                                                     join_texts=join_texts)
        processed = [ProcessedPrompt(None, ids) for ids, _ in encoded]
        params = [pooling_params.clone(task="score", second_text_start=start) for _, start in encoded]
        labels = [pair_labels(len(side_1), len(side_2), i, j) for i, j in pairs]
        outs = self._pool(processed, params, use_tqdm, labels)
        return [ScoringRequestOutput(out.request_id, ScoringOutput(float(out.outputs.data[0])), out.prompt_token_ids,
                                     True) for out in outs]

    def _pooling_prompts(self, items: list[PromptInput]) -> list[ProcessedPrompt]:
        # Texts are encoded in one batch (the tokenizer spreads it over its threads): embedding calls are
        # many short prompts, for which encoding one by one costs as much as the model on a GPU.
        tokenizer = self.engine.tokenizer
        texts = iter(tokenizer.encode_batch([p for p in items if isinstance(p, str)]))
        return [ProcessedPrompt(p, next(texts)) if isinstance(p, str) else
                refuse_images(process_prompt(tokenizer, p, i), f"prompts[{i}]", "pooling")
                for i, p in enumerate(items)]

    def _pool(self, processed: list[ProcessedPrompt], params_list: list[PoolingParams], use_tqdm: bool,
              labels: list[str]) -> list[PoolingRequestOutput]:
        """Every prompt through the engine in one batch (labels name each in errors); outputs in order."""
        for p, pp, what in zip(processed, params_list, labels, strict=True):
            self.engine.validate_pooling_prompt(p.prompt_token_ids, pp, what=what)
        order: dict[str, int] = {}
        sampling = pooling_sampling_params()  # read-only in the engine: one for every request
        try:
            for i, (p, pp) in enumerate(zip(processed, params_list, strict=True)):
                request_id = str(next(self._request_counter))
                request = EngineCoreRequest(request_id, p.prompt_token_ids, sampling, arrival_time=time.time(),
                                            pooling_params=pp)
                self.output_processor.add_request(request, p.prompt)
                order[request_id] = i
                self._submit(request, [request])
            outputs = self._drain(order, sum(len(p.prompt_token_ids) for p in processed), use_tqdm,
                                  PoolingRequestOutput)
        except BaseException:
            self._abort(list(order))
            raise
        for label, out in zip(labels, outputs, strict=True):
            if out.error is not None:
                raise RequestError(f"{label}: {out.error}")
        return outputs

    # ---- the offline loop ---------------------------------------------------------------------------------
    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        # bad_words encoded once per distinct params (a batch usually shares one), before any is queued.
        encoded: dict[int, SamplingParams] = {}
        for sp in params_list:
            if id(sp) not in encoded:
                encoded[id(sp)] = self.engine.encode_bad_words(sp)
        params_list = [encoded[id(sp)] for sp in params_list]
        loras = _lora_per_prompt(lora_request, len(prompts))
        # Validate every prompt before queueing any, so a bad one rejects the call cleanly.
        for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
            try:
                self.engine.validate_prompt(p.prompt_token_ids, sp, what=f"prompts[{i}]")
            except InvalidArgumentError as exc:
                # An embeddings prompt's placeholder ids break a prompt rule (too long): the field is prompt_embeds.
                if exc.param in ("prompt", "prompt_token_ids") and is_embeds(p.mm_items):
                    raise type(exc)(str(exc), param="prompt_embeds") from None
                raise
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._request_counter))
                # Offline callers only read final results: skip building per-step outputs.
                sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                request = EngineCoreRequest(request_id, p.prompt_token_ids, sp, arrival_time=time.time(),
                                            **lora_fields(loras[i]), mm_inputs=p.mm_items)
                core_requests = self.output_processor.add_request(request, p.prompt)
                added.append(request_id)
                order[request_id] = i
                # n > 1: the samples go in together. The core registers the prompt's full blocks
                # in the prefix cache when it allocates them for the first sample, so the siblings
                # scheduled after it in the same step hit them and the prompt is computed once.
                self._submit(request, core_requests)
        except BaseException:
            self._abort(added)
            raise
        try:
            return self._drain(order, sum(len(p.prompt_token_ids) for p in prompts), use_tqdm, RequestOutput)
        except BaseException:
            self._abort(list(order))  # e.g. KeyboardInterrupt: leave the engine clean for the next call
            raise

    def _drain(self, order: dict[str, int], num_prompt_tokens: int, use_tqdm: bool,
               kind: type[OutputT]) -> list[OutputT]:
        """Step until every request in `order` finished; their outputs (all of `kind`) in order."""
        if self.engine.paused:
            raise RuntimeError("the engine is asleep (LLM.sleep): call LLM.wake_up() before running requests"
                               + (", and collective_rpc('reload_weights'): the sleep discarded the weights"
                                  if self.engine.sleeper is not None and self.engine.sleeper.memory.weights_discarded
                                  else ""))
        results: list[OutputT | None] = [None] * len(order)
        bar = _ProgressBar(len(order), num_prompt_tokens) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests() or self.output_processor.has_unfinished_requests():
                step_start = time.time()
                outputs = self.engine.step()
                if self._stats is not None:
                    self._stats.step(outputs, step_start, self.engine.stats())
                if not outputs and not self.engine.has_unfinished_requests():
                    break
                for ro in self.output_processor.process_outputs(outputs):
                    if ro.finished and ro.request_id in order:
                        assert isinstance(ro, kind)
                        results[order[ro.request_id]] = ro
                        if bar is not None:
                            bar.done(ro)
                if not outputs:
                    self.engine.wait_for_work(0.01)
        finally:
            if bar is not None:
                bar.close()
        missing = [rid for rid, i in order.items() if results[i] is None]
        if missing:
            raise RuntimeError(f"engine stopped with requests unfinished: {missing[:5]}")
        return [r for r in results if r is not None]

    def _abort(self, request_ids: list[str]) -> None:
        engine_ids = self.output_processor.abort_requests(request_ids)
        if engine_ids:
            self.engine.abort_requests(engine_ids)
            if self._stats is not None:
                self._stats.aborted(engine_ids)

    def _submit(self, request: EngineCoreRequest, core_requests: list[EngineCoreRequest]) -> None:
        """The engine requests a user request became (its n samples) into the core, in order."""
        for r in core_requests:
            self.engine.add_request(r)
        if self._stats is not None:
            self._stats.add(request, [r.request_id for r in core_requests], self.engine.max_model_len)

    def _params_per_prompt(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"sampling_params: got {len(params)} for {n} prompts (give one, or one per prompt)")
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling_params[{i}]: expected SamplingParams, got {type(sp).__name__}")
        return params


def _lora_per_prompt(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                     n: int) -> list[LoRARequest | None]:
    if lora_request is None or not isinstance(lora_request, Sequence):
        return [lora_request] * n
    loras = list(lora_request)
    if len(loras) != n:
        raise InvalidArgumentError(f"lora_request: got {len(loras)} for {n} prompts (give one, or one per prompt)",
                                   param="lora_request")
    return loras


def _pooling_per_prompt(pooling_params: PoolingParams | Sequence[PoolingParams] | None, n: int) -> list[PoolingParams]:
    if pooling_params is None:
        return [PoolingParams()] * n
    if isinstance(pooling_params, PoolingParams):
        return [pooling_params] * n
    params = list(pooling_params)
    if len(params) != n:
        raise InvalidArgumentError(f"pooling_params: got {len(params)} for {n} prompts (give one, or one per prompt)",
                                   param="pooling_params")
    for i, pp in enumerate(params):
        if not isinstance(pp, PoolingParams):
            raise InvalidArgumentError(f"pooling_params[{i}]: expected PoolingParams, got {type(pp).__name__}",
                                       param="pooling_params")
    return params


def _score_side(data: PromptInput | Sequence[PromptInput], name: str) -> list[PromptInput]:
    """One side of score(): its prompts (a text, a token-id list or a dict is one prompt). vLLM's multimodal
    inputs ({"content": [...]}) are refused by name: ferrox's embedding models read text."""
    items = normalize_prompts(data)
    for item in items:
        if isinstance(item, Mapping) and "content" in item:
            raise InvalidArgumentError(f"{name}: multimodal score inputs ({{'content': [...]}}) are not supported; "
                                       "give texts", param=name)
    return items


class _ProgressBar:
    """tqdm over finished requests, with prompt (input) and generated (output) tokens/s."""

    def __init__(self, total: int, num_prompt_tokens: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.num_prompt_tokens = num_prompt_tokens
        self.in_tokens = 0
        self.out_tokens = 0

    def done(self, ro: AnyRequestOutput) -> None:
        self.in_tokens += len(ro.prompt_token_ids)
        if isinstance(ro, RequestOutput):
            self.out_tokens += sum(len(o.token_ids) for o in ro.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"input: {self.in_tokens / elapsed:.1f} toks/s, output: {self.out_tokens / elapsed:.1f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
