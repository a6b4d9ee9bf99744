"""POST /v1/chat/completions: render the chat template, generate, answer in OpenAI's shape."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints.openai import beam_search
from ferrox.entrypoints.openai import tools as tool_hooks
from ferrox.entrypoints.openai.errors import APIError
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.serving import (
    CHAT_FIELDS,
    SSE_DONE,
    STREAM_ERRORS,
    ServingContext,
    api_error,
    build_sampling_params,
    check_max_tokens,
    check_output_budget,
    check_priority,
    check_request_mm_kwargs,
    check_request_template,
    chosen_entry,
    end_sse,
    finite,
    first_output,
    json_response,
    parse_body,
    prompt_logprobs_body,
    render_chat,
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
from ferrox.entrypoints.openai.serving_images import (
    expand_images,
    fetch_images,
    request_image_prompts,
    take_template_images,
)
from ferrox.entrypoints.openai.structured import build_structured_outputs
from ferrox.loader.chat_template import content_text
from ferrox.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger("ferrox.entrypoints.openai")


async def create_chat_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    check_priority(ctx, req.priority)
    if not req.include_reasoning and ctx.reasoning is None:
        raise APIError(400, "include_reasoning: this server has no reasoning parser, so the whole output is the "
                       "content (start it with --reasoning-parser to tell a reasoning model's thinking apart)",
                       param="include_reasoning")
    try:
        tool_hooks.validate_tools(req)
        structured = build_structured_outputs(req) or tool_hooks.tool_constraint(req)
    except ValueError as exc:  # InvalidArgumentError naming tools / tool_choice / response_format...
        raise api_error(exc) from None
    check_request_mm_kwargs(ctx, mm_processor_kwargs=req.mm_processor_kwargs, media_io_kwargs=req.media_io_kwargs)
    # A long conversation takes a while to render and encode: off the event loop (a short one inline).
    images = await fetch_images(ctx, [m.to_template_dict() for m in req.messages],
                                media_io_kwargs=req.media_io_kwargs)
    chat = await ctx.engine.prompt_work(prompt_size(req), _render_prompt, ctx, req, images)
    messages, template, prompt_text, prompt_ids = chat.messages, chat.template, chat.text, chat.token_ids
    if ctx.keeps_special_tokens(tool_hooks.needs_special_tokens(req, ctx.options.tool_call_parser, template)):
        # The parser's markers are special tokens (Mistral's [TOOL_CALLS], gpt-oss's harmony): kept in the
        # text, as vLLM does.
        req.skip_special_tokens = False
    check_max_tokens(ctx, len(prompt_ids), req.requested_max_tokens)
    check_output_budget(ctx, req.n, len(prompt_ids), req.requested_max_tokens, "max_completion_tokens"
                        if req.max_completion_tokens is not None else "max_tokens")
    params = build_sampling_params(
        req, max_tokens=req.requested_max_tokens, logprobs=req.num_logprobs, stream=req.stream,
        prompt_logprobs=req.prompt_logprobs, structured=structured, defaults=ctx.engine.generation_defaults,
    )
    validate_request(ctx, prompt_ids, params, CHAT_FIELDS)
    beams = beam_search.beam_search_params(ctx, req, len(prompt_ids), req.requested_max_tokens)
    request_id, header_id = request_ids(request, req, "chatcmpl")
    headers = {"X-Request-Id": header_id}
    if req.user is not None or req.safety_identifier is not None:
        # OpenAI's end-user tags: no effect on the output, kept for the operator's logs.
        logger.debug("request %s from user %r (safety_identifier %r)", request_id, req.user, req.safety_identifier)
    prompt: dict[str, Any] = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
    if chat.mm_items:
        if beams is not None:
            raise APIError(400, "use_beam_search: beam search takes no images", param="use_beam_search")
        prompt["multi_modal_items"] = chat.mm_items
    echo = content_text(messages[-1].get("content")) if req.echo and messages else ""
    if req.stream:
        return await _stream(ctx, request, req, prompt, params, request_id, echo, template, headers)
    final: RequestOutput | None = None
    try:
        async with contextlib.aclosing(beam_search.generate(ctx, prompt, params, beams, request_id,
                                                            priority=req.priority, cache_salt=req.cache_salt,
                                                            lora_request=ctx.lora_request(req.model),
                                                            prompt_cache_key=req.prompt_cache_key)) as gen:
            async for out in gen:
                final = out
    except STREAM_ERRORS as exc:
        raise api_error(exc, default_param="messages", rename=CHAT_FIELDS) from None
    assert final is not None
    choices = []
    thinking = ctx.starts_thinking(prompt_ids, req.template_kwargs())
    harmony_calls = tool_hooks.reads_harmony_calls(req, ctx.options.tool_call_parser, template)
    reasoning_tokens = 0
    show_details = _shows_details(ctx, req)
    for comp in final.outputs:
        text, reasoning = comp.text, None
        if ctx.reasoning is not None:
            # The answer is what follows the thinking: tool calls are parsed from it alone.
            reasoning, answer = ctx.reasoning.split(comp.text, thinking, harmony_calls)
            text = answer or ""
            reasoning_tokens += ctx.reasoning.count_reasoning_tokens(comp.token_ids, thinking)
        content, tool_calls = tool_hooks.parse_tool_calls(echo + text, req, ctx.options.tool_call_parser,
                                                          template=template)
        message: dict[str, Any] = {"role": _response_role(ctx, req), "content": content}
        if ctx.reasoning is not None:
            message["content"] = content or None  # vLLM's: no answer (cut short while thinking) is null
            _set_reasoning(message, reasoning if req.include_reasoning else None)
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {
            "index": comp.index,
            "message": message,
            "logprobs": _chat_logprobs(comp, req, ctx.as_token_ids(req)) if req.logprobs and show_details else None,
            "finish_reason": _finish_reason(comp.finish_reason, bool(tool_calls)),
            "stop_reason": comp.stop_reason,
        }
        if req.return_token_ids and show_details:
            choice["token_ids"] = comp.token_ids
        choices.append(choice)
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": ctx.usage(len(prompt_ids), completion_tokens, final.num_cached_tokens,
                           reasoning_tokens if ctx.reasoning is not None else None),
        "system_fingerprint": None,
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_body(final.prompt_logprobs, ctx.as_token_ids(req))
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    return json_response(body, headers=headers)


def _shows_details(ctx: ServingContext, req: ChatCompletionRequest) -> bool:
    """include_reasoning false hides the thinking, and with it the logprobs and token ids that would
    spell it out (vLLM's rule: on every choice and chunk of the request)."""
    return ctx.reasoning is None or req.include_reasoning


def _set_reasoning(message: dict[str, Any], reasoning: str | None) -> None:
    """The thinking under vLLM's name, `reasoning`, and its older one, `reasoning_content` (which
    DeepSeek's API and many clients read)."""
    message["reasoning"] = reasoning
    message["reasoning_content"] = reasoning


def _response_role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """vLLM's rule: the server's --response-role for a new turn (add_generation_prompt), else the role
    of the last message, which the model continues."""
    return ctx.options.response_role if req.add_generation_prompt else req.messages[-1].role


def _finish_reason(engine_reason: str | None, tools_called: bool) -> str | None:
    """"tool_calls" only for a choice that ended by itself with a call: a call cut short by max_tokens
    (its arguments truncated) stays "length", and an aborted one keeps its reason."""
    return "tool_calls" if tools_called and engine_reason == "stop" else engine_reason


@dataclass(slots=True)
class _ChatPrompt:
    messages: list[dict[str, Any]]  # as rendered (tools folded in for templates without tool support)
    template: str | None  # the template used, which picks the tool-call parser
    text: str | None  # None when truncate_prompt_tokens cut the rendered text
    token_ids: list[int]
    mm_items: list[Any] | None = None  # the images, their placeholders expanded in token_ids


def _render_prompt(ctx: ServingContext, req: ChatCompletionRequest, images: list[Any] | None = None) -> _ChatPrompt:
    """The request's conversation through the chat template and the tokenizer (blocking: runs in
    the engine's prompt threads); a bad template or message is an APIError naming `messages`.
    images: the messages' image parts, fetched and decoded (serving_images.py)."""
    check_request_template(ctx, req.chat_template)
    # Checked (and the request's processors derived) even without images: a bad key is refused, not ignored.
    prompts = request_image_prompts(ctx, req.mm_processor_kwargs)
    messages = [m.to_template_dict() for m in req.messages]
    # Under tool_choice "none" the tools stay in the prompt (vLLM's default; the reply is not read for calls),
    # unless --exclude-tools-when-tool-choice-none.
    exclude = req.tool_choice == "none" and ctx.options.exclude_tools_when_tool_choice_none
    use_tools = None if exclude else req.tools
    # Templates without tool support (the embedded SmolLM2's) get the tools as system text.
    template = tool_hooks.template_text(ctx, req.chat_template, use_tools)
    if images:
        messages = take_template_images(ctx, messages, template)
    messages, use_tools = tool_hooks.prepare_messages(messages, use_tools, template)
    text = render_chat(
        ctx, messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=use_tools,
        chat_template=req.chat_template,
        template_kwargs=req.template_kwargs(),
    )
    # The template already holds the special tokens (BOS, <|im_start|>): add_special_tokens is off
    # unless the request turns it on, as in vLLM.
    ids = ctx.engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    if images:
        if getattr(req, "truncate_prompt_tokens", None) is not None:
            raise APIError(400, "truncate_prompt_tokens: a prompt with images is not truncated (it could cut an "
                           "image's tokens)", param="truncate_prompt_tokens")
        ids, items = expand_images(ctx, ids, images, prompts)
        return _ChatPrompt(messages, template, text, ids, items)
    truncated = truncate_prompt(ctx, ids, req)
    # A truncated prompt is no longer the rendered text: the engine then takes the ids alone.
    return _ChatPrompt(messages, template, text if truncated is ids else None, truncated)


async def _stream(ctx: ServingContext, request: web.Request, req: ChatCompletionRequest, prompt: dict[str, Any],
                  params: Any, request_id: str, echo: str, template: str | None,
                  headers: dict[str, str]) -> web.StreamResponse:
    created = int(time.time())
    # --enable-force-include-usage: the usage chunk comes even when stream_options did not ask (vLLM's rule).
    include_usage = req.include_usage or ctx.options.enable_force_include_usage
    continuous_usage = req.continuous_usage
    num_prompt = len(prompt["prompt_token_ids"])
    completion_tokens = 0
    cached = 0

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name, "choices": choices,
        }
        if include_usage:
            # continuous_usage_stats: every chunk says the usage so far; otherwise only the last one.
            if usage is None and continuous_usage:
                usage = ctx.usage(num_prompt, completion_tokens, cached, reasoning_tokens())
            body["usage"] = usage
        return body

    gen = ctx.engine.generate(prompt, params, request_id, priority=req.priority, cache_salt=req.cache_salt,
                              lora_request=ctx.lora_request(req.model), prompt_cache_key=req.prompt_cache_key,
                              stream_interval=req.stream_interval)
    # Pull the first output before sending headers, so a rejected request is still a plain 4xx/503 (with
    # --sse-keep-alive-interval a slow first output starts the stream meanwhile: serving.first_output).
    first = await first_output(gen, "messages", CHAT_FIELDS, request=request, headers=headers)

    # With tools, text deltas go through a per-choice tool parser (delta.tool_calls chunks); with a
    # reasoning parser, through a per-choice splitter first (the tool parser sees the answer only).
    tool_streams = ({i: tool_hooks.ToolStream(req, ctx.options.tool_call_parser, template=template)
                     for i in range(req.n)} if req.tools else None)
    thinking = ctx.starts_thinking(prompt["prompt_token_ids"], req.template_kwargs())
    harmony_calls = tool_hooks.reads_harmony_calls(req, ctx.options.tool_call_parser, template)
    reasoning_streams = ({i: ctx.reasoning.stream(thinking, harmony_calls) for i in range(req.n)}
                         if ctx.reasoning is not None else None)
    show_details = _shows_details(ctx, req)
    as_token_ids = ctx.as_token_ids(req)

    def reasoning_tokens() -> int | None:
        return sum(r.reasoning_tokens for r in reasoning_streams.values()) if reasoning_streams is not None else None
    resp = await start_sse(request, headers, keep_alive=True)  # (already started if the first output was slow)
    tail: list[bytes] = []  # the last events, written with the end of the response (end_sse)
    async with contextlib.aclosing(gen):
        try:
            for i in range(req.n):
                role = {"role": _response_role(ctx, req), "content": echo}
                first_chunk = chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}])
                if req.return_token_ids and i == 0:  # vLLM: the prompt's ids ride on the first chunk only
                    first_chunk["prompt_token_ids"] = prompt["prompt_token_ids"]
                await send_sse(resp, first_chunk)
            out = first
            while out is not None:
                cached = out.num_cached_tokens
                choices = []
                for comp in out.outputs:
                    completion_tokens += len(comp.token_ids)
                    if not comp.text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    finished = comp.finish_reason is not None
                    text, thought = comp.text, ""
                    if reasoning_streams is not None:
                        split = reasoning_streams[comp.index]
                        split.count_tokens(comp.token_ids)
                        thought, text = split.feed(comp.text, finished)
                    delta: dict[str, Any] = {"content": text} if text or not finished else {}
                    finish_reason = comp.finish_reason
                    if tool_streams is not None:
                        stream = tool_streams[comp.index]
                        delta = stream.step(text, finished) or {}
                        finish_reason = _finish_reason(finish_reason, stream.tools_called)
                    if reasoning_streams is not None:
                        if not text:
                            delta.pop("content", None)
                        if thought and req.include_reasoning:
                            _set_reasoning(delta, thought)
                    # Held-back text (a possible tool-call start or think tag) sends nothing, unless token
                    # ids or logprobs were asked for: those go out as they come.
                    if (tool_streams is not None or reasoning_streams is not None) and not delta and not finished \
                            and not ((req.return_token_ids or req.logprobs) and show_details):
                        continue
                    choice: dict[str, Any] = {
                        "index": comp.index,
                        "delta": delta,
                        "logprobs": _chat_logprobs(comp, req, as_token_ids) if req.logprobs and show_details else None,
                        "finish_reason": finish_reason,
                        **({"stop_reason": comp.stop_reason} if comp.finish_reason else {}),
                    }
                    if req.return_token_ids and show_details:
                        choice["token_ids"] = comp.token_ids
                    choices.append(choice)
                if choices:
                    if out.finished:  # the stream's last content chunk
                        tail.append(sse_event(chunk(choices)))
                    else:
                        await send_sse(resp, chunk(choices))
                out = await anext(gen, None)
            if include_usage:
                tail.append(sse_event(chunk([], ctx.usage(num_prompt, completion_tokens, cached, reasoning_tokens()))))
        except STREAM_ERRORS as exc:
            tail.append(stream_error_event(exc))
        tail.append(SSE_DONE)
    await end_sse(resp, tail)
    return resp


def _chat_logprobs(comp: CompletionOutput, req: ChatCompletionRequest, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat logprobs: the sampled token with its logprob, and the top_logprobs most likely
    tokens by rank (the sampled token is the entry itself, so it is not added to that list)."""
    top_n = req.top_logprobs or 0
    content = []
    for token_id, position in zip(comp.token_ids, comp.logprobs or [], strict=False):
        token = token_text(token_id, chosen_entry(position, token_id), as_ids)
        content.append({
            "token": token,
            "logprob": finite(chosen_entry(position, token_id).logprob),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": (text := token_text(tid, lp, as_ids)), "logprob": finite(lp.logprob),
                 "bytes": list(text.encode("utf-8"))}
                for tid, lp in top_entries(position, top_n, req.logprob_token_ids)
            ],
        })
    return {"content": content}
