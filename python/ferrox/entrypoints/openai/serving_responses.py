"""POST /v1/responses: OpenAI's Responses API over the same engine.

The reply becomes output items: a `message` with one `output_text` part for text, a
`function_call` per tool call. Under --reasoning-parser, a `reasoning` item with the model's
thinking as one `reasoning_text` part comes first (none when the output has no thinking), and the
message and calls are read from the answer after `</think>` alone; usage counts the thinking's
tokens in output_tokens_details.reasoning_tokens. A reply cut by max_output_tokens has status
"incomplete" (with incomplete_details.reason "max_output_tokens"), and so has a function call
whose arguments were cut short, or a thinking cut short. Streaming sends the documented event
sequence, each event with a rising sequence_number:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning:     response.reasoning_text.delta*, response.reasoning_text.done
      message:       response.content_part.added, response.output_text.delta*,
                     response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta*, response.function_call_arguments.done
    response.output_item.done,
    response.completed (or response.incomplete; response.failed after an engine error).

When the server keeps responses (responses_store.py), a stored response is the object returned (a
stream's: the one its last event carries); `previous_response_id` renders the earlier conversation
(its inputs and outputs, reasoning and function calls included; not its instructions) before the
input; `background` answers at once with status "queued" and generates in a task that fills the
stored object ("in_progress", then "completed"...), which POST .../cancel cancels (the routes that
read the store: serving_responses_store.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints import tool_use
from ferrox.entrypoints.openai.errors import APIError, bad_request, from_exception
from ferrox.entrypoints.openai.protocol import check_schema_size, check_tools
from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest, encrypt_reasoning
from ferrox.entrypoints.openai.responses_logprobs import OutputTextLogprobs
from ferrox.entrypoints.openai.responses_store import (
    HOW_TO_ENABLE,
    RESPONSE_STORE,
    ResponseStore,
    StoredResponse,
)
from ferrox.entrypoints.openai.serving import (
    ServingContext,
    api_error,
    check_max_tokens,
    first_output,
    json_response,
    parse_body,
    sampling_knobs,
    send_sse,
    start_sse,
    validate_request,
)
from ferrox.entrypoints.openai.serving_images import fetch_images
from ferrox.entrypoints.openai.structured import format_constraint
from ferrox.errors import FerroxError
from ferrox.reasoning import AnyReasoningStream
from ferrox.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("ferrox.entrypoints.openai")

# Engine field name -> this route's spelling.
RESPONSES_FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens", "structured_outputs": "text.format"}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _constraint(req: ResponsesRequest, tools: tool_use.ToolRequest) -> Any:
    try:
        structured = format_constraint(req.response_format())
    except ValueError as exc:
        raise from_exception(exc, rename={"response_format": "text.format"}) from None
    forced = tool_use.tool_constraint(tools)
    if structured is not None and forced is not None:
        raise bad_request("text.format: a json format cannot be combined with a tool_choice that forces a "
                          "function call", param="text.format")
    return structured or forced


def _sampling_params(ctx: ServingContext, req: ResponsesRequest, structured: Any,
                     keep_special_tokens: bool = False) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": req.max_output_tokens, "structured_outputs": structured,
                              "output_kind": RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
                              "skip_special_tokens": not keep_special_tokens,
                              "logprobs": (req.top_logprobs or 0) if req.includes_output_logprobs else None}
    kwargs.update(sampling_knobs(ctx.engine.generation_defaults, temperature=req.temperature, top_p=req.top_p))
    try:
        return SamplingParams(**kwargs)
    except (ValueError, msgspec.ValidationError) as exc:
        raise from_exception(exc, rename=RESPONSES_FIELDS) from None


class _Response:
    """The response object as it grows: output items, status, usage."""

    def __init__(self, ctx: ServingContext, req: ResponsesRequest, params: SamplingParams,
                 num_prompt_tokens: int, stored: bool = False) -> None:
        self.id = _new_id("resp")
        self.stored = stored
        self.created_at = int(time.time())
        self.ctx, self.req, self.params = ctx, req, params
        self.num_prompt_tokens = num_prompt_tokens
        self.output_tokens = 0
        self.reasoning_tokens = 0  # the output's tokens before `</think>` (under --reasoning-parser)
        self.cached_tokens = 0
        self.items: list[dict[str, Any]] = []
        self.status = "in_progress"
        self.incomplete_reason: str | None = None
        self.error: dict[str, Any] | None = None
        self._logprobs_shown = False
        self.logprobs = (OutputTextLogprobs(req.top_logprobs or 0, ctx.as_token_ids(req))
                         if req.includes_output_logprobs else None)

    def item(self, block: tool_use.ReplyBlock, status: str) -> dict[str, Any]:
        if block.kind == "text":
            return {"type": "message", "id": _new_id("msg"), "status": status, "role": "assistant",
                    "content": [] if status == "in_progress" else [self.text_part(block.text)]}
        return {"type": "function_call", "id": "fc_" + block.call_id.removeprefix("call_"),
                "call_id": block.call_id, "name": block.name, "arguments": block.arguments, "status": status}

    def text_part(self, text: str) -> dict[str, Any]:
        """An output_text part; with logprobs asked for, the message's holds every output token's (the first
        message's: a later one, after a tool call, holds none, so no token is reported twice)."""
        part = _text_part(text)
        if self.logprobs is not None and not self._logprobs_shown:
            part["logprobs"] = self.logprobs.entries
            self._logprobs_shown = True
        return part

    def finish(self, finish_reason: str | None) -> None:
        self.status = "completed"
        if finish_reason == "length":
            self.status, self.incomplete_reason = "incomplete", "max_output_tokens"

    def body(self) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text and req.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "model": self.ctx.model_name, "output": self.items,
            "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            # The values decoding used (the model's generation defaults where the request left them out).
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": _dump(req.tool_choice) if req.tool_choice is not None else "auto",
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "text": {"format": fmt.model_dump(exclude_none=True, by_alias=True) if fmt else {"type": "text"}},
            "metadata": req.metadata or {}, "user": req.user, "store": self.stored, "background": req.background,
            "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
            "previous_response_id": req.previous_response_id, "reasoning": None, "truncation": "disabled",
            "usage": None if self.status in ("queued", "in_progress", "cancelled") else {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": self.num_prompt_tokens + self.output_tokens,
            },
        }


def _reasoning_item(item_id: str, text: str, status: str, encrypted: bool = False) -> dict[str, Any]:
    """The thinking as OpenAI's reasoning item (and vLLM's): the text as one reasoning_text part, no
    summary (an in-progress item has no part yet: its text comes as reasoning_text deltas); with
    include reasoning.encrypted_content, the text also as encrypted_content (protocol_responses.py)."""
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
    if encrypted:
        item["encrypted_content"] = None if status == "in_progress" else encrypt_reasoning(text)
    return item


def _reasoning_status(split: AnyReasoningStream, finish_reason: str | None) -> str:
    """A thinking that never reached `</think>` because max_output_tokens cut it is incomplete."""
    return "incomplete" if finish_reason == "length" and not split.ended else "completed"


def _dump(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _block_status(block: tool_use.ReplyBlock, finish_reason: str | None) -> str:
    if finish_reason == "length" and (block.kind == "text" or not block.arguments_complete):
        return "incomplete"
    return "completed"


def _check_sizes(req: ResponsesRequest) -> None:
    """The size limits of /v1/chat/completions (protocol.py), on this route's spelling of them."""
    try:
        if req.tools:
            check_tools(req.tools, ("parameters",))
    except ValueError as exc:
        raise bad_request(f"tools: {exc}", param="tools") from None
    text_format = req.text.format if req.text is not None else None
    if text_format is not None and text_format.schema_ is not None:
        try:
            check_schema_size(text_format.schema_, "the schema")
        except ValueError as exc:
            raise bad_request(f"text.format: {exc}", param="text.format") from None
    if req.top_logprobs and not req.includes_output_logprobs:  # it would do nothing: refused, not ignored
        raise bad_request('top_logprobs: needs include ["message.output_text.logprobs"] (the logprobs it adds to)',
                          param="top_logprobs")


def _named_for_input(error: APIError, fields: list[str]) -> APIError:
    """fetch_images names a media part by its chat message (`input[k]` for messages[k]); the message's field in
    the request differs where instructions came first, function calls joined one message or the input continues
    previous_response_id: named by the request's own field (`input[i].content[j].input_audio.data: ...`)."""
    found = re.match(r"input\[(\d+)\]", error.message)
    if found is None or int(found[1]) >= len(fields):
        return error
    message = fields[int(found[1])] + error.message[found.end():]
    return APIError(error.status, message, param=error.param, code=error.code)


def _store_decision(req: ResponsesRequest, store: ResponseStore) -> bool:
    """Whether to keep this response; refuses store / previous_response_id / background by name while
    the store is off, and the combinations background cannot serve."""
    if not store.enabled:
        for name, value, otherwise in (("store", req.store, "or send store=false"),
                                       ("previous_response_id", req.previous_response_id,
                                        "or send the whole conversation as input"),
                                       ("background", req.background, "or leave background out")):
            if value:
                raise bad_request(f"{name}: not supported by ferrox's Responses API (stored responses are off; "
                                  f"{HOW_TO_ENABLE}, {otherwise})", param=name, code="unsupported_parameter")
        return False
    keep = req.store is not False  # OpenAI's default is to store, and vLLM's once its store is on
    if req.background and not keep:
        raise bad_request("background: a background response is fetched by id later, so it needs store "
                          "(leave store out or send store=true)", param="background")
    if req.background and req.stream:
        raise bad_request("stream: not supported with background (poll GET /v1/responses/{id} instead)",
                          param="stream", code="unsupported_parameter")
    return keep


def _previous(req: ResponsesRequest, store: ResponseStore) -> StoredResponse | None:
    if req.previous_response_id is None:
        return None
    previous = store.require(req.previous_response_id, param="previous_response_id")
    if previous.running:
        raise bad_request(f"previous_response_id: response {previous.id!r} is still {previous.body['status']}; "
                          "continue it once it has finished", param="previous_response_id")
    return previous


async def create_response(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
    req = await parse_body(request, ResponsesRequest)
    refused = req.refused_fields()
    if refused:
        name, why = refused[0]
        raise bad_request(f"{name}: not supported by ferrox's Responses API ({why})", param=name,
                          code="unsupported_parameter")
    store = request.app[RESPONSE_STORE]
    keep = _store_decision(req, store)
    previous = _previous(req, store)
    _check_sizes(req)
    ctx.check_model(req.model)
    ctx.check_engine()
    # Rendered as if the whole conversation had been sent: the same prompt, so the same prefix cache.
    history = previous.history() if previous is not None else []
    conversation = req.with_history(history) if previous is not None else req
    tools = req.tool_request()
    structured = _constraint(req, tools)
    # A long conversation takes a while to render and encode: off the event loop (a short one inline).
    messages, fields = conversation.chat_messages(len(history))
    try:
        images = await fetch_images(ctx, messages, "input")
    except APIError as exc:
        raise _named_for_input(exc, fields) from None
    prompt = await ctx.engine.prompt_work(prompt_size(conversation), tool_use.render_prompt, ctx, messages, tools,
                                          template_kwargs=req.template_kwargs(), images=images)
    check_max_tokens(ctx, len(prompt.token_ids), req.max_output_tokens)
    params = _sampling_params(ctx, req, structured, ctx.keeps_special_tokens(
        tool_use.keeps_special_tokens(tools, prompt.template, ctx.options.tool_call_parser)))
    validate_request(ctx, prompt.token_ids, params, RESPONSES_FIELDS)
    response = _Response(ctx, req, params, len(prompt.token_ids), stored=keep)
    request["request_id"] = response.id  # -> the X-Request-Id header and the access log
    entry = StoredResponse(response.body(), req.stored_input_items(), previous) if keep else None
    gen = ctx.engine.generate(prompt.engine_prompt(), params, response.id,
                              lora_request=ctx.lora_request(req.model), prompt_cache_key=req.prompt_cache_key)
    thinking = ctx.starts_thinking(prompt.token_ids, req.template_kwargs())
    finish = _Finish(tools, prompt.template, thinking)
    if entry is not None and req.background:
        response.status = "queued"
        entry.body = response.body()
        entry.task = asyncio.create_task(_run_background(entry, response, gen, finish), name=f"background {response.id}")
        store.put(entry)
        return json_response(entry.body)
    # Pull the first output before sending headers, so a rejected request is still a plain 4xx/503.
    first = await first_output(gen, "input", RESPONSES_FIELDS)
    if req.stream:
        result = await _stream(request, response, gen, first, tools, prompt.template, thinking)
    else:
        async with contextlib.aclosing(gen):
            final = first
            async for later in gen:
                final = later
        finish(response, final)
        result = json_response(response.body())
    if entry is not None:  # what the client got last (a stream's final event), not a half-built one
        entry.body = response.body()
        store.put(entry)
    return result


class _Finish:
    """Turns a request's final output (FINAL_ONLY: the whole text) into the response's output items."""

    def __init__(self, tools: tool_use.ToolRequest, template: str | None, thinking: bool) -> None:
        self.tools, self.template, self.thinking = tools, template, thinking

    def __call__(self, response: _Response, final: Any) -> None:
        ctx, req = response.ctx, response.req
        assert final is not None
        comp = final.outputs[0]
        response.output_tokens = len(comp.token_ids)
        response.cached_tokens = final.num_cached_tokens
        if response.logprobs is not None:
            response.logprobs.add(comp.token_ids, comp.logprobs)
        answer = comp.text
        if ctx.reasoning is not None:
            # The answer is what follows the thinking: the message and the tool calls are read from it alone.
            split = ctx.reasoning.stream(self.thinking, tool_use.reads_harmony_calls(
                self.tools, self.template, ctx.options.tool_call_parser))
            split.count_tokens(comp.token_ids)
            reasoning, answer = split.feed(comp.text, finished=True)
            response.reasoning_tokens = split.reasoning_tokens
            if reasoning:
                response.items.append(_reasoning_item(_new_id("rs"), reasoning,
                                                      _reasoning_status(split, comp.finish_reason),
                                                      req.includes_encrypted_reasoning))
        # An empty reply is one empty message, unless the thinking was all there was (as streamed).
        blocks = tool_use.split_reply(answer, self.tools, self.template, ctx.options.tool_call_parser) or \
            ([] if response.items else [tool_use.ReplyBlock("text")])
        response.items += [response.item(b, _block_status(b, comp.finish_reason)) for b in blocks]
        response.finish(comp.finish_reason)


async def _run_background(entry: StoredResponse, response: _Response, gen: Any, finish: _Finish) -> None:
    """A background response's generation: the stored object is in_progress from the task's start
    (the request is in the engine's hands; its outputs come whole at the end), then completed
    (incomplete, failed). Cancelling the task (POST .../cancel, or the store dropping the entry)
    closes the generator, which aborts the request and frees its KV blocks."""
    response.status = "in_progress"
    entry.body = response.body()
    async with contextlib.aclosing(gen):
        try:
            final = await first_output(gen, "input", RESPONSES_FIELDS)
            async for later in gen:
                final = later
            finish(response, final)
        except asyncio.CancelledError:
            response.status = "cancelled"
            entry.body = response.body()
            raise
        except Exception as exc:  # noqa: BLE001 - a task has no caller: the stored object carries the error
            error = exc if isinstance(exc, APIError) else api_error(exc)
            if not isinstance(exc, (APIError, FerroxError, ValueError)):
                logger.exception("background response %s failed", response.id)
            response.status, response.error = "failed", {"code": error.code or "server_error",
                                                         "message": error.message}
    entry.body = response.body()


async def _stream(request: web.Request, response: _Response, gen: Any, first: Any,
                  tools: tool_use.ToolRequest, template: str | None, thinking: bool) -> web.StreamResponse:
    resp = await start_sse(request)
    sequence = 0

    async def send(payload: dict[str, Any]) -> None:
        nonlocal sequence
        payload["sequence_number"] = sequence
        sequence += 1
        await send_sse(resp, payload, payload["type"])

    stream = tool_use.BlockStream(tools, template, response.ctx.options.tool_call_parser)
    ids: dict[int, str] = {}  # block index -> item id
    reasoning = response.ctx.reasoning
    split = (reasoning.stream(thinking, tool_use.reads_harmony_calls(tools, template, response.ctx.options.tool_call_parser))
             if reasoning is not None else None)
    thought = _StreamedReasoning(response)
    async with contextlib.aclosing(gen):
        try:
            await send({"type": "response.created", "response": response.body()})
            await send({"type": "response.in_progress", "response": response.body()})
            out, finish_reason = first, None
            while out is not None:
                response.cached_tokens = out.num_cached_tokens
                for comp in out.outputs:
                    response.output_tokens += len(comp.token_ids)
                    if response.logprobs is not None:
                        response.logprobs.add(comp.token_ids, comp.logprobs)
                    finish_reason = comp.finish_reason or finish_reason
                    finished = comp.finish_reason is not None
                    answer = comp.text
                    if split is not None:
                        # The thinking's events first (its item closes when `</think>` comes), then the
                        # answer's, read from the text after it.
                        split.count_tokens(comp.token_ids)
                        response.reasoning_tokens = split.reasoning_tokens
                        delta, answer = split.feed(comp.text, finished)
                        for payload in thought.step(delta, split, finished, finish_reason):
                            await send(payload)
                    for event in stream.step(answer, finished):
                        for payload in _item_events(response, event, ids, finish_reason, thought.items):
                            await send(payload)
                out = await anext(gen, None)
            response.finish(finish_reason)
            await send({"type": f"response.{response.status}", "response": response.body()})
        except (FerroxError, ValueError) as exc:
            error = api_error(exc)
            response.status, response.error = "failed", {"code": error.code or "server_error", "message": error.message}
            await send({"type": "response.failed", "response": response.body()})
    await resp.write_eof()
    return resp


class _StreamedReasoning:
    """The reasoning item of a stream: added with the first thinking text (output index 0), each
    thinking delta a reasoning_text.delta, done when the thinking ends (`</think>`) or the output does."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.id: str | None = None
        self.text = ""
        self.open = False

    @property
    def items(self) -> int:
        """How many output items it takes: 0 for an output without thinking, else 1 (the answer's
        items come after it)."""
        return 0 if self.id is None else 1

    def step(self, delta: str, split: AnyReasoningStream, finished: bool,
             finish_reason: str | None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        # The reasoning item is output 0: thinking after the answer's items began (gpt-oss may think
        # again after a preamble) is not streamed; non-streamed, it joins the one reasoning item.
        if delta and (self.open or (self.id is None and not self.response.items)):
            if self.id is None:
                self.id, self.open = _new_id("rs"), True
                item = _reasoning_item(self.id, "", "in_progress", self.response.req.includes_encrypted_reasoning)
                self.response.items.insert(0, item)  # the first item: no answer has come before it
                events.append({"type": "response.output_item.added", "output_index": 0, "item": item})
            self.text += delta
            events.append({"type": "response.reasoning_text.delta", "item_id": self.id, "output_index": 0,
                           "content_index": 0, "delta": delta})
        if self.open and (split.ended or finished):
            self.open = False
            assert self.id is not None
            done = _reasoning_item(self.id, self.text, _reasoning_status(split, finish_reason),
                                   self.response.req.includes_encrypted_reasoning)
            self.response.items[0] = done
            events += [{"type": "response.reasoning_text.done", "item_id": self.id, "output_index": 0,
                        "content_index": 0, "text": self.text},
                       {"type": "response.output_item.done", "output_index": 0, "item": done}]
        return events


def _item_events(response: _Response, event: tool_use.BlockEvent, ids: dict[int, str],
                 finish_reason: str | None, offset: int) -> list[dict[str, Any]]:
    """One block event -> the Responses stream events it stands for; `offset` output items (the
    reasoning item) come before the reply's blocks."""
    block, index = event.block, event.index + offset
    if event.kind == "start":
        item = response.item(block, "in_progress")
        ids[event.index] = item["id"]
        response.items.append(item)
        added = [{"type": "response.output_item.added", "output_index": index, "item": item}]
        if block.kind == "text":
            added.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                          "content_index": 0, "part": _text_part("")})
        return added
    where = {"item_id": ids[event.index], "output_index": index}
    if event.kind == "delta":
        if block.kind == "text":
            new = response.logprobs.take_new() if response.logprobs is not None else []
            return [{"type": "response.output_text.delta", **where, "content_index": 0, "delta": event.delta,
                     "logprobs": new}]
        return [{"type": "response.function_call_arguments.delta", **where, "delta": event.delta}]
    done = response.item(block, _block_status(block, finish_reason))
    done["id"] = ids[event.index]
    response.items[index] = done
    if block.kind == "text":
        part = done["content"][0]
        events = [{"type": "response.output_text.done", **where, "content_index": 0, "text": block.text,
                   "logprobs": part["logprobs"]},
                  {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
    else:
        events = [{"type": "response.function_call_arguments.done", **where, "name": block.name,
                   "arguments": block.arguments}]
    return [*events, {"type": "response.output_item.done", "output_index": index, "item": done}]
