"""POST /v1/chat/completions: render the chat template, generate, answer in OpenAI's shape."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ferrox.entrypoints.openai import tools as tool_hooks
from ferrox.entrypoints.openai.errors import from_exception
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.serving import (
    CHAT_FIELDS,
    ServingContext,
    build_sampling_params,
    check_max_tokens,
    chosen_entry,
    finite,
    first_output,
    json_response,
    new_id,
    parse_body,
    render_chat,
    send_sse,
    send_stream_error,
    start_sse,
    top_entries,
    validate_request,
)
from ferrox.entrypoints.openai.structured import build_structured_outputs
from ferrox.errors import FerroxError
from ferrox.outputs import CompletionOutput, RequestOutput


async def create_chat_completion(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, ChatCompletionRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    try:
        tool_hooks.validate_tools(req)
        structured = build_structured_outputs(req) or tool_hooks.tool_constraint(req)
    except ValueError as exc:  # InvalidArgumentError naming tools / tool_choice / response_format...
        raise from_exception(exc) from None
    # Rendering and encoding a long conversation takes a while: off the event loop.
    chat = await ctx.engine.run_in_prompt_pool(_render_prompt, ctx, req)
    messages, template, prompt_text, prompt_ids = chat.messages, chat.template, chat.text, chat.token_ids
    check_max_tokens(ctx, len(prompt_ids), req.requested_max_tokens)
    params = build_sampling_params(
        req, max_tokens=req.requested_max_tokens, logprobs=req.num_logprobs, stream=req.stream,
        structured=structured, defaults=ctx.engine.generation_defaults,
    )
    validate_request(ctx, prompt_ids, params, CHAT_FIELDS)
    request_id = new_id("chatcmpl")
    prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
    echo = (messages[-1].get("content") or "") if req.echo and messages else ""
    if req.stream:
        return await _stream(ctx, request, req, prompt, params, request_id, echo, template)
    final: RequestOutput | None = None
    try:
        async with contextlib.aclosing(ctx.engine.generate(prompt, params, request_id, priority=req.priority)) as gen:
            async for out in gen:
                final = out
    except (FerroxError, ValueError) as exc:
        raise from_exception(exc, default_param="messages", rename=CHAT_FIELDS) from None
    assert final is not None
    choices = []
    for comp in final.outputs:
        content, tool_calls = tool_hooks.parse_tool_calls(echo + comp.text, req, template=template)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        finish_reason = comp.finish_reason
        if tool_calls:
            message["tool_calls"] = tool_calls
            finish_reason = "tool_calls"
        choices.append({
            "index": comp.index,
            "message": message,
            "logprobs": _chat_logprobs(comp, req.top_logprobs or 0) if req.logprobs else None,
            "finish_reason": finish_reason,
            "stop_reason": comp.stop_reason,
        })
    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
    return json_response({
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": _usage(len(prompt_ids), completion_tokens, final.num_cached_tokens),
        "system_fingerprint": None,
    })


@dataclass(slots=True)
class _ChatPrompt:
    messages: list[dict[str, Any]]  # as rendered (tools folded in for templates without tool support)
    template: str | None  # the template used, which picks the tool-call parser
    text: str
    token_ids: list[int]


def _render_prompt(ctx: ServingContext, req: ChatCompletionRequest) -> _ChatPrompt:
    """The request's conversation through the chat template and the tokenizer (blocking: runs in
    the engine's prompt threads); a bad template or message is an APIError naming `messages`."""
    messages = [m.to_template_dict() for m in req.messages]
    use_tools = req.tools if req.tool_choice != "none" else None
    # Templates without tool support (the embedded SmolLM2's) get the tools as system text.
    template = tool_hooks.template_text(ctx, req.chat_template, use_tools)
    messages, use_tools = tool_hooks.prepare_messages(messages, use_tools, template)
    text = render_chat(
        ctx, messages,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        tools=use_tools,
        chat_template=req.chat_template,
        template_kwargs=req.chat_template_kwargs,
    )
    # The template already holds the special tokens (BOS, <|im_start|>): do not add them twice.
    return _ChatPrompt(messages, template, text, ctx.engine.tokenizer.encode(text, add_special_tokens=False))


async def _stream(ctx: ServingContext, request: web.Request, req: ChatCompletionRequest, prompt: dict[str, Any],
                  params: Any, request_id: str, echo: str, template: str | None = None) -> web.StreamResponse:
    created = int(time.time())
    include_usage = req.include_usage
    num_prompt = len(prompt["prompt_token_ids"])

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name, "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return body

    gen = ctx.engine.generate(prompt, params, request_id, priority=req.priority)
    # Pull the first output before sending headers, so a rejected request is still a plain 4xx/503.
    first = await first_output(gen, "messages", CHAT_FIELDS)

    # With tools, text deltas go through a per-choice tool parser (delta.tool_calls chunks).
    tool_streams = {i: tool_hooks.ToolStream(req, template=template) for i in range(req.n)} if req.tools else None
    resp = await start_sse(request)
    completion_tokens = 0
    cached = 0
    async with contextlib.aclosing(gen):
        try:
            for i in range(req.n):
                role = {"role": "assistant", "content": echo}
                await send_sse(resp, chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]))
            out = first
            while out is not None:
                cached = out.num_cached_tokens
                choices = []
                for comp in out.outputs:
                    completion_tokens += len(comp.token_ids)
                    if not comp.text and not comp.token_ids and comp.finish_reason is None:
                        continue
                    delta: dict[str, Any] = {"content": comp.text} if comp.text or comp.finish_reason is None else {}
                    finish_reason = comp.finish_reason
                    if tool_streams is not None:
                        stream = tool_streams[comp.index]
                        delta = stream.step(comp.text, comp.finish_reason is not None) or {}
                        if not delta and comp.finish_reason is None:
                            continue  # text held back (a possible tool-call start)
                        if stream.tools_called and finish_reason is not None:
                            finish_reason = "tool_calls"
                    choices.append({
                        "index": comp.index,
                        "delta": delta,
                        "logprobs": _chat_logprobs(comp, req.top_logprobs or 0) if req.logprobs else None,
                        "finish_reason": finish_reason,
                        **({"stop_reason": comp.stop_reason} if comp.finish_reason else {}),
                    })
                if choices:
                    await send_sse(resp, chunk(choices))
                out = await anext(gen, None)
            if include_usage:
                await send_sse(resp, chunk([], _usage(num_prompt, completion_tokens, cached)))
        except (FerroxError, ValueError) as exc:
            await send_stream_error(resp, exc)
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _chat_logprobs(comp: CompletionOutput, top_n: int) -> dict[str, Any]:
    content = []
    for token_id, position in zip(comp.token_ids, comp.logprobs or [], strict=False):
        chosen = chosen_entry(position, token_id)
        token = chosen.decoded_token or ""
        content.append({
            "token": token,
            "logprob": finite(chosen.logprob),
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [
                {"token": lp.decoded_token or "", "logprob": finite(lp.logprob),
                 "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                for _, lp in top_entries(position, top_n)
            ],
        })
    return {"content": content}
