"""`LLM`: the offline batch API. The engine core runs in this process.

    llm = LLM()                                  # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from ferrox.config import EngineConfig
from ferrox.engine.defaults import default_sampling_params
from ferrox.engine.engine_core import EngineCore
from ferrox.engine.input_processor import (
    ProcessedPrompt,
    PromptInput,
    is_conversation_list,
    normalize_prompts,
    process_prompt,
    render_chat,
)
from ferrox.engine.output_processor import OutputProcessor
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import InvalidArgumentError
from ferrox.outputs import RequestOutput
from ferrox.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **engine_args)
        if self.config.data_parallel_size > 1:
            # As in vLLM, offline data parallelism is one process per replica; this LLM is one engine.
            raise InvalidArgumentError(
                f"data_parallel_size: {self.config.data_parallel_size} is not supported by the offline LLM (it runs "
                "one engine core in this process); use `ferrox serve --data-parallel-size N` or "
                "AsyncLLM(data_parallel_size=N), or one LLM per GPU in separate processes (CUDA_VISIBLE_DEVICES)",
                param="data_parallel_size")
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.engine.tokenizer)
        self._request_counter = itertools.count()

    # ---- public API -----------------------------------------------------------------------------------
    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return default_sampling_params(self.engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = normalize_prompts(prompts)
        if not items:
            return []  # as vLLM: nothing asked, nothing to do (no progress bar, no engine step)
        tokenizer = self.engine.tokenizer
        processed = [process_prompt(tokenizer, p, i) for i, p in enumerate(items)]
        return self._run(processed, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
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
        processed = [
            render_chat(
                self.engine.tokenizer, conv, chat_template=template, add_generation_prompt=add_generation_prompt,
                tools=tools, chat_template_kwargs=chat_template_kwargs, index=i,
            )
            for i, conv in enumerate(conversations)
        ]
        return self._run(processed, sampling_params, use_tqdm)

    # ---- the offline loop ---------------------------------------------------------------------------------
    def _run(
        self,
        prompts: list[ProcessedPrompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        # Validate every prompt before queueing any, so a bad one rejects the call cleanly.
        for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
            self.engine.validate_prompt(p.prompt_token_ids, sp, what=f"prompts[{i}]")
        order: dict[str, int] = {}
        added: list[str] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._request_counter))
                # Offline callers only read final results: skip building per-step outputs.
                sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                request = EngineCoreRequest(request_id, p.prompt_token_ids, sp, arrival_time=time.time())
                core_requests = self.output_processor.add_request(request, p.prompt)
                added.append(request_id)
                order[request_id] = i
                # n > 1: the samples go in together. The core registers the prompt's full blocks
                # in the prefix cache when it allocates them for the first sample, so the siblings
                # scheduled after it in the same step hit them and the prompt is computed once.
                for r in core_requests:
                    self.engine.add_request(r)
        except BaseException:
            self._abort(added)
            raise
        try:
            return self._drain(order, sum(len(p.prompt_token_ids) for p in prompts), use_tqdm)
        except BaseException:
            self._abort(list(order))  # e.g. KeyboardInterrupt: leave the engine clean for the next call
            raise

    def _drain(self, order: dict[str, int], num_prompt_tokens: int, use_tqdm: bool) -> list[RequestOutput]:
        results: list[RequestOutput | None] = [None] * len(order)
        bar = _ProgressBar(len(order), num_prompt_tokens) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests() or self.output_processor.has_unfinished_requests():
                outputs = self.engine.step()
                if not outputs and not self.engine.has_unfinished_requests():
                    break
                for ro in self.output_processor.process_outputs(outputs):
                    if ro.finished and ro.request_id in order:
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


class _ProgressBar:
    """tqdm over finished requests, with prompt (input) and generated (output) tokens/s."""

    def __init__(self, total: int, num_prompt_tokens: int) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.num_prompt_tokens = num_prompt_tokens
        self.in_tokens = 0
        self.out_tokens = 0

    def done(self, ro: RequestOutput) -> None:
        self.in_tokens += len(ro.prompt_token_ids)
        self.out_tokens += sum(len(o.token_ids) for o in ro.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"input: {self.in_tokens / elapsed:.1f} toks/s, output: {self.out_tokens / elapsed:.1f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
