"""POST /v1/completions: one or many prompts (text or token ids), n choices each.

Choice index = prompt_index * n + sample_index, as OpenAI numbers them. Several prompts run
concurrently in the engine; their streams are merged as outputs arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints.openai import beam_search
from ferrox.entrypoints.openai.errors import bad_request
from ferrox.entrypoints.openai.protocol import CompletionRequest
from ferrox.entrypoints.openai.serving import (
    COMPLETION_FIELDS,
    SSE_DONE,
    STREAM_ERRORS,
    ServingContext,
    api_error,
    build_sampling_params,
    check_max_tokens,
    check_output_budget,
    check_priority,
    chosen_entry,
    end_sse,
    finite,
    first_output,
    json_response,
    parse_body,
    prompt_logprobs_body,
    request_ids,
    send_sse,
    sse_event,
    start_sse,
    stream_error_event,
    token_text,
    top_entries,
    truncate_prompt,
    validate_request,
)
from ferrox.entrypoints.openai.structured import build_structured_outputs
from ferrox.errors import InvalidArgumentError
from ferrox.multimodal.prompt_embeds import decode_base64, item_from_saved
from ferrox.outputs import Logprob, RequestOutput

_END = object()


async def create_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, CompletionRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    check_priority(ctx, req.priority)
    if req.embeds():
        _check_embeds_request(ctx, req)
    try:
        structured = build_structured_outputs(req)
    except ValueError as exc:  # InvalidArgumentError naming response_format / guided_json...
        raise api_error(exc) from None
    # Encoding long prompts takes a while: off the event loop (short ones inline).
    try:
        prompts = await ctx.engine.prompt_work(prompt_size(req), _tokenize_prompts, ctx, req)
    except InvalidArgumentError as exc:  # prompt_embeds that are not a saved tensor (read without torch here)
        raise api_error(exc) from None
    for p in prompts:  # 400 if any prompt cannot fit with the requested budget
        check_max_tokens(ctx, len(p["prompt_token_ids"]), req.requested_max_tokens)
    # Every prompt runs n samples: the budget is over the whole request.
    check_output_budget(ctx, req.n * len(prompts), min(len(p["prompt_token_ids"]) for p in prompts),
                        req.requested_max_tokens, "max_tokens")
    # Omitted max_tokens: None, i.e. each prompt may run up to the model's length.
    # Echoed logprobs need the prompt's: vLLM takes an explicit prompt_logprobs, else logprobs.
    echo_logprobs = req.echo and req.logprobs is not None and req.prompt_logprobs is None
    params = build_sampling_params(
        req, max_tokens=req.requested_max_tokens, logprobs=req.logprobs, stream=req.stream,
        prompt_logprobs=req.logprobs if echo_logprobs else req.prompt_logprobs, structured=structured,
        defaults=ctx.engine.generation_defaults,
    )
    fields = COMPLETION_FIELDS if echo_logprobs else {}
    for p in prompts:  # every prompt passes the request rules before any is queued
        validate_request(ctx, p["prompt_token_ids"], params, _EMBEDS_FIELDS if p.get("embeds") else fields)
    # use_beam_search: one search per prompt (the same limits for each, so the shortest prompt's default
    # max_tokens is checked against the longest).
    beams = beam_search.beam_search_params(ctx, req, max(len(p["prompt_token_ids"]) for p in prompts),
                                           req.requested_max_tokens)
    request_id, header_id = request_ids(request, req, "cmpl")
    headers = {"X-Request-Id": header_id}
    outputs = _merged(ctx, prompts, params, request_id, req.priority, req.cache_salt, ctx.lora_request(req.model),
                      beams, req.stream_interval)
    if req.stream:
        return await _stream(ctx, request, req, prompts, outputs, request_id, headers)

    finals: dict[int, RequestOutput] = {}
    try:
        async with contextlib.aclosing(outputs) as merged:
            async for idx, out in merged:
                finals[idx] = out
    except STREAM_ERRORS as exc:
        raise api_error(exc, default_param=_error_param(req), rename=fields) from None
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = cached_tokens = 0
    for idx, p in enumerate(prompts):
        final = finals[idx]
        prompt_tokens += len(p["prompt_token_ids"])
        cached_tokens += final.num_cached_tokens
        echo_text = _prompt_text(ctx, p) if req.echo else ""
        for comp in final.outputs:
            completion_tokens += len(comp.token_ids)
            logprobs = None
            if req.logprobs is not None:
                logprobs = _LogprobsBuilder(req.logprobs, ctx.as_token_ids(req), req.logprob_token_ids)
                if req.echo:
                    logprobs.add_prompt(p["prompt_token_ids"], final.prompt_logprobs, ctx)
                logprobs.add(comp.token_ids, comp.logprobs)
            choice: dict[str, Any] = {
                "index": idx * req.n + comp.index,
                "text": echo_text + comp.text,
                "logprobs": logprobs.body() if logprobs else None,
                "finish_reason": comp.finish_reason,
                "stop_reason": comp.stop_reason,
            }
            _add_vllm_extras(ctx, choice, req, p, final, first=True)
            if req.return_token_ids:
                choice["token_ids"] = comp.token_ids
            choices.append(choice)
    choices.sort(key=lambda c: c["index"])
    return json_response({
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": ctx.usage(prompt_tokens, completion_tokens, cached_tokens),
        "system_fingerprint": None,
    }, headers=headers)


# An embeddings prompt's request-rule errors (too long, no room for max_tokens) name prompt_embeds.
_EMBEDS_FIELDS = {"prompt": "prompt_embeds", "prompt_token_ids": "prompt_embeds"}


def _check_embeds_request(ctx: ServingContext, req: CompletionRequest) -> None:
    """vLLM's rules for prompt_embeds, before anything is decoded: only with --enable-prompt-embeds, and
    not with the parameters that need the prompt's tokens."""
    if not getattr(getattr(ctx.engine, "config", None), "enable_prompt_embeds", False):
        raise bad_request("You must set `--enable-prompt-embeds` to input `prompt_embeds`.", param="prompt_embeds")
    if req.echo:
        raise bad_request("echo is not supported with prompt_embeds (the prompt has no text)", param="echo")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs is not compatible with prompt_embeds", param="prompt_logprobs")
    if req.truncate_prompt_tokens is not None:
        raise bad_request("truncate_prompt_tokens is not supported with prompt_embeds", param="truncate_prompt_tokens")


def _error_param(req: CompletionRequest) -> str:
    """The field an engine error names when it names none (a request the core refused, e.g. embeddings it
    could not load or whose hidden size is not the model's): the request's prompt field."""
    return "prompt_embeds" if req.embeds() and not req.prompts() else "prompt"


def _add_vllm_extras(ctx: ServingContext, choice: dict[str, Any], req: CompletionRequest, prompt: dict[str, Any],
                     out: RequestOutput, first: bool) -> None:
    """vLLM's per-choice prompt fields: prompt_logprobs when asked for, prompt_token_ids with
    return_token_ids (in a stream, on each choice's first chunk only)."""
    if not first:
        return
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_body(out.prompt_logprobs, ctx.as_token_ids(req))
    if req.return_token_ids:  # (an embeddings prompt has no token ids: its placeholders are not sent)
        choice["prompt_token_ids"] = None if prompt.get("embeds") else prompt["prompt_token_ids"]


def _tokenize_prompts(ctx: ServingContext, req: CompletionRequest) -> list[dict[str, Any]]:
    """{"prompt": text or None, "prompt_token_ids": ids} per prompt (blocking: runs in the engine's
    prompt threads). Empty prompts and ids outside the vocabulary are the request rules' to refuse
    (validate_request)."""
    tokenizer = ctx.engine.tokenizer
    prompts: list[dict[str, Any]] = []
    for k, encoded in enumerate(req.embeds()):  # vLLM's order: the embeddings prompts first
        what = "prompt_embeds" if isinstance(req.prompt_embeds, str) else f"prompt_embeds[{k}]"
        ids, item = item_from_saved(decode_base64(encoded, what), what)
        prompts.append({"prompt": None, "prompt_token_ids": ids, "multi_modal_items": [item], "embeds": True})
    for raw in req.prompts():
        if isinstance(raw, str):
            ids, text = tokenizer.encode(raw, add_special_tokens=req.add_special_tokens), raw
        else:
            ids, text = raw, None
        truncated = truncate_prompt(ctx, ids, req)
        # A truncated prompt is no longer its text: echo then decodes the ids kept.
        prompts.append({"prompt": text if truncated is ids else None, "prompt_token_ids": truncated})
    return prompts


async def _stream(ctx: ServingContext, request: web.Request, req: CompletionRequest, prompts: list[dict[str, Any]],
                  outputs: AsyncGenerator[tuple[int, RequestOutput], None], request_id: str,
                  headers: dict[str, str]) -> web.StreamResponse:
    created = int(time.time())
    n = req.n
    first = await first_output(outputs, _error_param(req), COMPLETION_FIELDS, request=request, headers=headers)
    prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    completion_tokens = 0

    # --enable-force-include-usage: the usage chunk comes even when stream_options did not ask (vLLM's rule).
    include_usage = req.include_usage or ctx.options.enable_force_include_usage
    continuous_usage = req.continuous_usage

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                                "model": ctx.model_name, "choices": choices}
        if include_usage:
            # continuous_usage_stats: every chunk says the usage so far; otherwise only the last one.
            if usage is None and continuous_usage:
                usage = ctx.usage(prompt_tokens, completion_tokens, sum(cached.values()))
            body["usage"] = usage
        return body

    resp = await start_sse(request, headers, keep_alive=True)  # (already started if the first output was slow)
    echoed: set[int] = set()
    started: set[int] = set()  # choices that sent their first chunk
    cached: dict[int, int] = {}  # prompt index -> its tokens found in the prefix cache
    builders: dict[int, _LogprobsBuilder] = {}
    finished: set[int] = set()  # prompts whose last output arrived
    tail: list[bytes] = []  # the last events, written with the end of the response (end_sse)
    async with contextlib.aclosing(outputs):
        try:
            item = first
            while item is not None:
                idx, out = item
                if out.finished:
                    finished.add(idx)
                cached[idx] = out.num_cached_tokens
                choices = []
                for comp in out.outputs:
                    index = idx * n + comp.index
                    completion_tokens += len(comp.token_ids)
                    text = comp.text
                    logprobs = None
                    if req.logprobs is not None:
                        builder = builders.setdefault(
                            index, _LogprobsBuilder(req.logprobs, ctx.as_token_ids(req), req.logprob_token_ids))
                        builder.reset()
                        if req.echo and index not in echoed:
                            builder.add_prompt(prompts[idx]["prompt_token_ids"], out.prompt_logprobs, ctx)
                        builder.add(comp.token_ids, comp.logprobs)
                        logprobs = builder.body()
                    if req.echo and index not in echoed:
                        text = _prompt_text(ctx, prompts[idx]) + text
                        echoed.add(index)
                    if not text and comp.finish_reason is None and not comp.token_ids:
                        continue
                    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs,
                                              "finish_reason": comp.finish_reason,
                                              **({"stop_reason": comp.stop_reason} if comp.finish_reason else {})}
                    _add_vllm_extras(ctx, choice, req, prompts[idx], out, first=index not in started)
                    started.add(index)
                    if req.return_token_ids:
                        choice["token_ids"] = comp.token_ids
                    choices.append(choice)
                if choices:
                    if len(finished) == len(prompts):  # the stream's last content chunk
                        tail.append(sse_event(chunk(choices)))
                    else:
                        await send_sse(resp, chunk(choices))
                item = await anext(outputs, None)
            if include_usage:
                tail.append(sse_event(chunk([], ctx.usage(prompt_tokens, completion_tokens, sum(cached.values())))))
        except STREAM_ERRORS as exc:
            tail.append(stream_error_event(exc))
        tail.append(SSE_DONE)
    await end_sse(resp, tail)
    return resp


async def _merged(ctx: ServingContext, prompts: list[dict[str, Any]], params: Any, request_id: str,
                  priority: int, cache_salt: str | None, lora_request: Any = None,
                  beams: Any = None, stream_interval: int | None = None,
                  ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """(prompt index, output) from every prompt's generator, in arrival order."""
    # (a beam search yields its one final output: no stream interval to apply)
    extra = {"stream_interval": stream_interval} if beams is None and stream_interval is not None else {}
    if len(prompts) == 1:
        async with contextlib.aclosing(beam_search.generate(ctx, prompts[0], params, beams, request_id,
                                                            priority=priority, cache_salt=cache_salt,
                                                            lora_request=lora_request, **extra)) as g:
            async for out in g:
                yield 0, out
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(idx: int, prompt: dict[str, Any]) -> None:
        try:
            gen = beam_search.generate(ctx, prompt, params, beams, f"{request_id}-{idx}", priority=priority,
                                       cache_salt=cache_salt, lora_request=lora_request, **extra)
            async with contextlib.aclosing(gen):
                async for out in gen:
                    queue.put_nowait((idx, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_text(ctx: ServingContext, prompt: dict[str, Any]) -> str:
    if prompt["prompt"] is not None:
        return prompt["prompt"]
    return ctx.engine.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


class _LogprobsBuilder:
    """The legacy completions logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""

    def __init__(self, top_n: int, as_token_ids: bool = False, named: list[int] | None = None) -> None:
        self.top_n = top_n
        self.named = named  # logprob_token_ids: the generated positions' alternatives (prompt ones: top_n)
        self.as_token_ids = as_token_ids
        self.offset = 0  # text offset carried across stream chunks
        self.reset()

    def reset(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def _append(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(token)

    def add_prompt(self, ids: list[int], prompt_logprobs: list[dict[int, Logprob] | None] | None,
                   ctx: ServingContext) -> None:
        for i, tid in enumerate(ids):
            position = prompt_logprobs[i] if prompt_logprobs and i < len(prompt_logprobs) else None
            if position is None:
                text = f"token_id:{tid}" if self.as_token_ids else ctx.engine.tokenizer.decode(
                    [tid], skip_special_tokens=False)
                self._append(text, None, None)
            else:
                self._add_position(tid, position)

    def add(self, ids: list[int], logprobs: list[dict[int, Logprob]] | None) -> None:
        for tid, position in zip(ids, logprobs or [], strict=False):
            self._add_position(tid, position, self.named)

    def _add_position(self, tid: int, position: dict[int, Logprob], named: list[int] | None = None) -> None:
        chosen = chosen_entry(position, tid)
        token = token_text(tid, chosen, self.as_token_ids)
        top = {token_text(t, lp, self.as_token_ids): finite(lp.logprob) for t, lp in top_entries(position, self.top_n, named)}
        # As vLLM does, the sampled token is among top_logprobs even when it is not in the top n
        # (so logprobs=0 still shows it there).
        top.setdefault(token, finite(chosen.logprob))
        self._append(token, finite(chosen.logprob), top)

    def body(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
