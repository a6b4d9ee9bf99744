"""POST /v1/messages: Anthropic's Messages API over the same engine.

Stop reasons map as Anthropic defines them: EOS -> "end_turn", a stop sequence ->
"stop_sequence" (with `stop_sequence` set), the token budget -> "max_tokens", a tool call ->
"tool_use". The streaming event order is message_start, then per content block
content_block_start, content_block_delta* (text_delta, or input_json_delta for tool_use),
content_block_stop, then message_delta (stop_reason, usage), message_stop.

Tools go through the chat route's machinery (entrypoints/tool_use.py): tool_choice "any" and
"tool" decode under the grammar that forces a call, "auto" parses calls out of free text.

With a reasoning parser (--reasoning-parser) a reasoning model's thinking comes first as a
`thinking` block (thinking_delta events, then a signature_delta: ferrox signs nothing, the
signature is a random id as in vLLM), and the text / tool_use blocks are read from the answer.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any

import msgspec
from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints import tool_use
from ferrox.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from ferrox.entrypoints.openai.errors import APIError, from_exception
from ferrox.entrypoints.openai.serving import (
    MESSAGES_FIELDS,
    ServingContext,
    api_error,
    check_max_tokens,
    first_output,
    json_response,
    new_id,
    parse_body,
    sampling_knobs,
    send_sse,
    start_sse,
    validate_request,
)
from ferrox.entrypoints.openai.serving_images import fetch_images
from ferrox.entrypoints.openai.structured import format_constraint
from ferrox.errors import FerroxError
from ferrox.outputs import CompletionOutput
from ferrox.sampling_params import RequestOutputKind, SamplingParams


def _stop_reason(comp: CompletionOutput, tool_called: bool) -> tuple[str | None, str | None]:
    if comp.finish_reason is None:
        return None, None
    if comp.finish_reason == "length":  # also for a tool call cut short: never claim it is whole
        return "max_tokens", None
    if tool_called:
        return "tool_use", None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return "end_turn", None


def _tool_use_id(call_id: str) -> str:
    # The parsers name calls OpenAI's way ("call_..."); Anthropic's ids read "toolu_...".
    return "toolu_" + call_id.removeprefix("call_")


def _content_block(block: tool_use.ReplyBlock) -> dict[str, Any]:
    if block.kind == "text":
        return {"type": "text", "text": block.text}
    if not block.arguments_complete:  # cut short by max_tokens: what was generated, as text
        return {"type": "text", "text": block.arguments}
    return {"type": "tool_use", "id": _tool_use_id(block.call_id), "name": block.name,
            "input": json.loads(block.arguments)}


def _render_prompt(ctx: ServingContext, req: MessagesRequest, images: list[Any] | None = None
                   ) -> tool_use.RenderedPrompt:
    """The conversation through the chat template, tools included (blocking: runs in the engine's
    prompt threads); a bad template or message is an APIError naming `messages`. images: the user
    turns' image blocks, fetched."""
    return tool_use.render_prompt(ctx, req.template_messages(), req.tool_request(), continue_final=req.prefill,
                                  template_kwargs=req.template_kwargs(), images=images)


async def _render(ctx: ServingContext, req: MessagesRequest) -> tool_use.RenderedPrompt:
    images = await fetch_images(ctx, req.template_messages())
    return await ctx.engine.prompt_work(prompt_size(req), _render_prompt, ctx, req, images)


async def count_message_tokens(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    """POST /v1/messages/count_tokens: the prompt's size, as the model will see it."""
    req = await parse_body(request, MessagesCountRequest)
    ctx.check_model(req.model)
    tool_use.tool_constraint(req.tool_request())
    prompt = await _render(ctx, req)
    return json_response({"input_tokens": len(prompt.token_ids)})


def _sampling_params(ctx: ServingContext, req: MessagesRequest, structured: Any,
                     keep_special_tokens: bool = False) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": req.max_tokens, "stop": req.stop_sequences or None,
                              "structured_outputs": structured, "skip_special_tokens": not keep_special_tokens}
    if req.thinking is not None and ctx.reasoning is not None:
        # Without a parser the model does not think, so no budget has anything to count.
        kwargs["thinking_token_budget"] = req.thinking.budget()
    kwargs.update(sampling_knobs(ctx.engine.generation_defaults, temperature=req.temperature, top_p=req.top_p,
                                 top_k=req.top_k))
    kwargs["output_kind"] = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**kwargs)
    except (ValueError, msgspec.ValidationError) as exc:
        raise from_exception(exc, rename=MESSAGES_FIELDS) from None


def _constraint(req: MessagesRequest, tools: tool_use.ToolRequest) -> Any:
    """output_config.format's JSON schema, or the grammar a forcing tool_choice asks for (not both)."""
    try:
        structured = format_constraint(req.output_config.response_format() if req.output_config else None)
    except ValueError as exc:
        raise from_exception(exc, rename={"response_format": "output_config.format"}) from None
    forced = tool_use.tool_constraint(tools)
    if structured is not None and forced is not None:
        raise APIError(400, "output_config.format: a JSON format cannot be combined with a tool_choice that forces "
                       "a tool call", param="output_config.format")
    return structured or forced


async def create_message(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, MessagesRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    tools = req.tool_request()
    structured = _constraint(req, tools)
    # A long conversation takes a while to render and encode: off the event loop (a short one inline).
    prompt = await _render(ctx, req)
    check_max_tokens(ctx, len(prompt.token_ids), req.max_tokens)
    params = _sampling_params(ctx, req, structured, ctx.keeps_special_tokens(
        tool_use.keeps_special_tokens(tools, prompt.template, ctx.options.tool_call_parser)))
    validate_request(ctx, prompt.token_ids, params, MESSAGES_FIELDS)
    message_id = new_id("msg").replace("-", "_")
    request["request_id"] = message_id  # -> the X-Request-Id header and the access log
    gen = ctx.engine.generate(prompt.engine_prompt(), params, message_id,
                              lora_request=ctx.lora_request(req.model))
    # Pull the first output before sending headers, so a rejected request is still a plain 4xx/503.
    first = await first_output(gen, "messages", MESSAGES_FIELDS)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": ctx.model_name}
    if not req.stream:
        async with contextlib.aclosing(gen):
            final = first
            async for later in gen:
                final = later
        assert final is not None
        comp = final.outputs[0]
        answer, thought = comp.text, None
        if ctx.reasoning is not None:
            thought, answer_or_none = ctx.reasoning.split(
                comp.text, ctx.starts_thinking(prompt.token_ids, req.template_kwargs()),
                tool_use.reads_harmony_calls(tools, prompt.template, ctx.options.tool_call_parser))
            answer = answer_or_none or ""
        blocks = tool_use.split_reply(answer, tools, prompt.template, ctx.options.tool_call_parser)
        stop_reason, stop_sequence = _stop_reason(comp, any(b.kind == "tool_call" for b in blocks))
        content = [_content_block(b) for b in blocks]
        if thought:
            content.insert(0, {"type": "thinking", "thinking": "" if _omits_thinking(req) else thought,
                               "signature": uuid.uuid4().hex})
        return json_response({
            **head, "content": content or [{"type": "text", "text": ""}],
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {**_input_usage(len(prompt.token_ids), final.num_cached_tokens),
                      "output_tokens": len(comp.token_ids)},
        })

    resp = await start_sse(request)
    output_tokens = 0
    stream = tool_use.BlockStream(tools, prompt.template, ctx.options.tool_call_parser)
    thinking = _ThinkingBlockStream(ctx, prompt.token_ids, req.template_kwargs(), omit=_omits_thinking(req),
                                    tool_calls=tool_use.reads_harmony_calls(tools, prompt.template,
                                                                            ctx.options.tool_call_parser))
    async with contextlib.aclosing(gen):
        try:
            await send_sse(resp, {"type": "message_start", "message": {
                **head, "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**_input_usage(len(prompt.token_ids), first.num_cached_tokens if first else 0),
                          "output_tokens": 0}}}, "message_start")
            text_opened = False
            stop_reason = stop_sequence = None
            out = first
            while out is not None:
                for comp in out.outputs:
                    output_tokens += len(comp.token_ids)
                    finished = comp.finish_reason is not None
                    for thinking_event in thinking.step(comp.text, finished):  # the thinking block, if any
                        await send_sse(resp, *thinking_event)
                    answer = thinking.answer
                    if tools.tools is None and not text_opened and thinking.over:
                        # plain text: one text block, announced as soon as the answer may begin
                        text_opened = True
                        for event in stream.open_text():
                            await send_sse(resp, *_stream_event(event, thinking.blocks))
                    for event in stream.step(answer, finished):
                        await send_sse(resp, *_stream_event(event, thinking.blocks))
                    if comp.finish_reason is not None:
                        stop_reason, stop_sequence = _stop_reason(comp, stream.has_tool_calls)
                out = await anext(gen, None)
            await send_sse(resp, {"type": "message_delta",
                                  "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": {"output_tokens": output_tokens}}, "message_delta")
            await send_sse(resp, {"type": "message_stop"}, "message_stop")
        except (FerroxError, ValueError) as exc:
            await send_sse(resp, api_error(exc).anthropic_body(), "error")
    await resp.write_eof()
    return resp


def _input_usage(prompt_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's split of the prompt: input_tokens are the ones computed, cache_read_input_tokens the
    ones read from the prefix cache (their sum is the prompt, as /v1/messages/count_tokens counts it).
    ferrox writes the cache on its own (every prompt's full blocks), never at a cache_control
    breakpoint, so no tokens count as cache creation."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached_tokens}


def _omits_thinking(req: MessagesRequest) -> bool:
    """thinking.display "omitted": thinking blocks come back without their text (signature only)."""
    return req.thinking is not None and req.thinking.display == "omitted"


def _stream_event(event: tool_use.BlockEvent, offset: int = 0) -> tuple[dict[str, Any], str]:
    """An answer block's event; `offset`: blocks sent before the answer's (the thinking block)."""
    block = event.block
    index = event.index + offset
    if event.kind == "start":
        start: dict[str, Any] = (
            {"type": "text", "text": ""} if block.kind == "text"
            else {"type": "tool_use", "id": _tool_use_id(block.call_id), "name": block.name, "input": {}})
        return {"type": "content_block_start", "index": index, "content_block": start}, "content_block_start"
    if event.kind == "delta":
        delta = ({"type": "text_delta", "text": event.delta} if block.kind == "text"
                 else {"type": "input_json_delta", "partial_json": event.delta})
        return {"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta"
    return {"type": "content_block_stop", "index": index}, "content_block_stop"


class _ThinkingBlockStream:
    """A streamed reply's thinking as block 0 (start, thinking_delta*, signature_delta, stop), and the
    answer text for the answer's blocks. Without a reasoning parser all text is the answer."""

    def __init__(self, ctx: ServingContext, prompt_ids: list[int], template_kwargs: dict[str, Any],
                 omit: bool = False, tool_calls: bool = False) -> None:
        self._omit = omit  # display "omitted": the block opens and closes with no thinking_delta
        # tool_calls: gpt-oss's calls stay in the answer for the tool parser (reasoning/harmony.py).
        self._split = (ctx.reasoning.stream(ctx.starts_thinking(prompt_ids, template_kwargs), tool_calls)
                       if ctx.reasoning is not None else None)
        self.blocks = 0  # thinking blocks sent (0 or 1): the answer's block indices start after them
        self._open = False
        self.answer = ""  # the answer text of the last step

    @property
    def over(self) -> bool:
        """The answer may have begun: no parser, or the thinking ended."""
        return self._split is None or self._split.ended

    def step(self, text: str, finished: bool) -> list[tuple[dict[str, Any], str]]:
        if self._split is None:
            self.answer = text
            return []
        answer_began = self._split.ended
        thought, self.answer = self._split.feed(text, finished)
        events: list[tuple[dict[str, Any], str]] = []
        # Block 0 comes first: thinking after the answer began (gpt-oss may think again after a
        # preamble) is not streamed; non-streamed, it joins the one thinking block.
        if thought and (self._open or (not self.blocks and not answer_began)):
            if not self._open:
                self._open, self.blocks = True, 1
                events.append(({"type": "content_block_start", "index": 0,
                                "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
                               "content_block_start"))
            if not self._omit:
                events.append(({"type": "content_block_delta", "index": 0,
                                "delta": {"type": "thinking_delta", "thinking": thought}}, "content_block_delta"))
        if self._open and (self._split.ended or finished):
            self._open = False
            events.append(({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "signature_delta", "signature": uuid.uuid4().hex}}, "content_block_delta"))
            events.append(({"type": "content_block_stop", "index": 0}, "content_block_stop"))
        return events
