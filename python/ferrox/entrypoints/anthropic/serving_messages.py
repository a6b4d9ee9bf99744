"""POST /v1/messages: Anthropic's Messages API over the same engine.

Stop reasons map as Anthropic defines them: EOS -> "end_turn", a stop sequence ->
"stop_sequence" (with `stop_sequence` set), the token budget -> "max_tokens". The streaming
event order is message_start, content_block_start, content_block_delta*,
content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec
from aiohttp import web

from ferrox.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from ferrox.entrypoints.openai.errors import from_exception
from ferrox.entrypoints.openai.serving import (
    MESSAGES_FIELDS,
    ServingContext,
    check_max_tokens,
    first_output,
    json_response,
    new_id,
    parse_body,
    render_chat,
    send_sse,
    start_sse,
    validate_request,
)
from ferrox.errors import FerroxError
from ferrox.outputs import CompletionOutput
from ferrox.sampling_params import RequestOutputKind, SamplingParams


def _stop_reason(comp: CompletionOutput) -> tuple[str | None, str | None]:
    if comp.finish_reason == "length":
        return "max_tokens", None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return ("end_turn", None) if comp.finish_reason is not None else (None, None)


def _render_prompt(ctx: ServingContext, req: MessagesRequest) -> tuple[str, list[int]]:
    """(text, token ids) of the conversation through the chat template (blocking: runs in the
    engine's prompt threads); a bad template or message is an APIError naming `messages`."""
    prompt_text = render_chat(ctx, req.template_messages(), add_generation_prompt=True)
    return prompt_text, ctx.engine.tokenizer.encode(prompt_text, add_special_tokens=False)


async def _prompt_ids(ctx: ServingContext, req: MessagesRequest) -> tuple[str, list[int]]:
    # Rendering and encoding a long conversation takes a while: off the event loop.
    return await ctx.engine.run_in_prompt_pool(_render_prompt, ctx, req)


async def count_message_tokens(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt's size, as the model will see it."""
    req = await parse_body(request, MessagesCountRequest)
    ctx.check_model(req.model)
    _, prompt_ids = await _prompt_ids(ctx, req)
    return json_response({"input_tokens": len(prompt_ids)})


async def create_message(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, MessagesRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    prompt_text, prompt_ids = await _prompt_ids(ctx, req)
    check_max_tokens(ctx, len(prompt_ids), req.max_tokens)
    kwargs: dict[str, Any] = {"max_tokens": req.max_tokens, "stop": req.stop_sequences or None}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is None:
            value = ctx.engine.generation_defaults.get(name)
        if value is not None:
            kwargs[name] = value
    kwargs["output_kind"] = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, msgspec.ValidationError) as exc:
        raise from_exception(exc, rename=MESSAGES_FIELDS) from None
    validate_request(ctx, prompt_ids, params, MESSAGES_FIELDS)
    message_id = new_id("msg").replace("-", "_")
    prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
    gen = ctx.engine.generate(prompt, params, message_id)
    # Pull the first output before sending headers, so a rejected request is still a plain 4xx/503.
    first = await first_output(gen, "messages", MESSAGES_FIELDS)
    if not req.stream:
        async with contextlib.aclosing(gen):
            final = first
            async for later in gen:
                final = later
        assert final is not None
        comp = final.outputs[0]
        stop_reason, stop_sequence = _stop_reason(comp)
        return json_response({
            "id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name,
            "content": [{"type": "text", "text": comp.text}],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(comp.token_ids)},
        })

    resp = await start_sse(request)
    output_tokens = 0
    async with contextlib.aclosing(gen):
        try:
            await send_sse(resp, {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": 0}}}, "message_start")
            await send_sse(resp, {"type": "content_block_start", "index": 0,
                                  "content_block": {"type": "text", "text": ""}}, "content_block_start")
            stop_reason = stop_sequence = None
            out = first
            while out is not None:
                for comp in out.outputs:
                    output_tokens += len(comp.token_ids)
                    if comp.text:
                        await send_sse(resp, {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": comp.text}},
                                       "content_block_delta")
                    if comp.finish_reason is not None:
                        stop_reason, stop_sequence = _stop_reason(comp)
                out = await anext(gen, None)
            await send_sse(resp, {"type": "content_block_stop", "index": 0}, "content_block_stop")
            await send_sse(resp, {"type": "message_delta",
                                  "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": {"output_tokens": output_tokens}}, "message_delta")
            await send_sse(resp, {"type": "message_stop"}, "message_stop")
        except (FerroxError, ValueError) as exc:
            await send_sse(resp, from_exception(exc).anthropic_body(), "error")
    await resp.write_eof()
    return resp
