"""Tool use for the routes that are not OpenAI chat: Anthropic's /v1/messages and /v1/responses.

Both translate their request into OpenAI chat's shape (messages with `tool_calls` / `role: tool`,
`tools` as `{"type": "function", "function": {...}}`) and then call the chat route's own tool
machinery (entrypoints/openai/tools.py: validation, the grammar that forces a call, the chat
template's tool rendering, the tool-call parsers). What is theirs alone is the output shape, so
this module hands back the reply as *blocks* (a text run, or one tool call), whole or as
start / delta / stop events while streaming, which each route renders in its own wire format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from ferrox.entrypoints.openai import tools as tool_hooks
from ferrox.entrypoints.openai.errors import from_exception
from ferrox.entrypoints.openai.serving import ServingContext, render_chat
from ferrox.structured.params import StructuredOutputsParams


@dataclass(slots=True)
class ToolRequest:
    """The three fields the chat route's tool machinery reads, in OpenAI chat's spelling."""

    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def prompt_tools(self, exclude_when_none: bool = False) -> list[dict[str, Any]] | None:
        """The tools the model is told about: all of them, also under tool_choice "none" (whose reply is never
        read for calls), unless exclude_when_none (vLLM's --exclude-tools-when-tool-choice-none), as on chat."""
        if not self.tools or (exclude_when_none and self.tool_choice == "none"):
            return None
        return self.tools


def tool_constraint(req: ToolRequest) -> StructuredOutputsParams | None:
    """Validate tools / tool_choice and return the grammar that forces a call (required / named
    choice), None for auto / none; bad input is a 400 naming `tools` or `tool_choice`."""
    try:
        tool_hooks.validate_tools(req)
        return tool_hooks.tool_constraint(req)
    except ValueError as exc:
        raise from_exception(exc) from None


def keeps_special_tokens(req: ToolRequest, template: str | None, parser: str | None = None) -> bool:
    """Whether the reply must be decoded with its special tokens kept: the tool parser's markers
    are special tokens (Mistral's [TOOL_CALLS]), as vLLM's mistral parser asks."""
    return tool_hooks.needs_special_tokens(req, parser, template)


def reads_harmony_calls(req: ToolRequest, template: str | None, parser: str | None = None) -> bool:
    """Whether gpt-oss's tool calls reach the tool parser (the `openai_gptoss` reasoning parser keeps them
    in the content only then)."""
    return tool_hooks.reads_harmony_calls(req, parser, template)


@dataclass(slots=True)
class RenderedPrompt:
    template: str | None  # picks the tool-call parser, as on chat
    text: str
    token_ids: list[int]
    mm_items: list[Any] | None = None  # the images, their placeholders expanded in token_ids

    def engine_prompt(self) -> dict[str, Any]:
        """The prompt as AsyncLLM.generate takes it."""
        prompt: dict[str, Any] = {"prompt": self.text, "prompt_token_ids": self.token_ids}
        if self.mm_items:
            prompt["multi_modal_items"] = self.mm_items
        return prompt


def render_prompt(ctx: ServingContext, messages: list[dict[str, Any]], req: ToolRequest, *,
                  continue_final: bool = False, template_kwargs: dict[str, Any] | None = None,
                  images: list[Any] | None = None) -> RenderedPrompt:
    """Render OpenAI-shaped messages with the tools (blocking: call it in the prompt threads).
    `continue_final` renders a last assistant message open-ended, so the model continues it
    instead of starting a new turn (Anthropic's assistant prefill). images: the messages' image
    parts, fetched (entrypoints/openai/serving_images.py)."""
    from ferrox.entrypoints.openai.serving_images import expand_images, take_template_images

    tools = req.prompt_tools(ctx.options.exclude_tools_when_tool_choice_none)
    template = tool_hooks.template_text(ctx, None, tools)
    if images:
        messages = take_template_images(ctx, messages, template)
    # Templates without tool support (the embedded SmolLM2's) get the tools as system text.
    messages, tools = tool_hooks.prepare_messages(messages, tools, template)
    text = render_chat(ctx, messages, add_generation_prompt=not continue_final,
                       continue_final_message=continue_final, tools=tools, template_kwargs=template_kwargs)
    # The template holds the special tokens already (BOS, <|im_start|>): do not add them twice.
    ids = ctx.engine.tokenizer.encode(text, add_special_tokens=False)
    if images:
        ids, items = expand_images(ctx, ids, images)
        return RenderedPrompt(template, text, ids, items)
    return RenderedPrompt(template, text, ids)


# ---- the reply as blocks ------------------------------------------------------------------------


@dataclass(slots=True)
class ReplyBlock:
    kind: Literal["text", "tool_call"]
    text: str = ""  # kind "text"
    call_id: str = ""  # kind "tool_call": the parser's id ("call_..."), name, arguments JSON text
    name: str = ""
    arguments: str = ""

    @property
    def arguments_complete(self) -> bool:
        """Whether the arguments are one whole JSON object; a call cut short by the token budget
        is not, and must not be presented as a finished call."""
        try:
            return isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            return False


def split_reply(text: str, req: ToolRequest, template: str | None, parser: str | None = None) -> list[ReplyBlock]:
    """A finished reply -> [text block?, tool call blocks...] (the chat route's parsers: the server's
    --tool-call-parser, else the template's)."""
    content, calls = tool_hooks.parse_tool_calls(text, req, parser, template=template)
    blocks = [ReplyBlock("text", text=content)] if content else []
    for call in calls or []:
        function = call["function"]
        blocks.append(ReplyBlock("tool_call", call_id=call["id"], name=function["name"],
                                 arguments=function["arguments"]))
    return blocks


@dataclass(slots=True)
class BlockEvent:
    kind: Literal["start", "delta", "stop"]
    index: int  # the block's position in the reply
    block: ReplyBlock  # the block so far (on "stop": whole)
    delta: str = ""  # on "delta": the text, or the fragment of the arguments' JSON text


@dataclass(slots=True)
class BlockStream:
    """Streamed text deltas in, block start / delta / stop events out; one block open at a time.
    With tools in play the text goes through the chat route's ToolStream, which holds back text
    that may be the start of a tool call."""

    req: ToolRequest
    template: str | None
    parser: str | None = None  # the server's --tool-call-parser (None: the template's)
    blocks: list[ReplyBlock] = field(default_factory=list)
    _tools: tool_hooks.ToolStream | None = None
    _open: bool = False
    _calls: dict[int, int] = field(default_factory=dict)  # parser's call index -> block index

    def __post_init__(self) -> None:
        self._tools = tool_hooks.ToolStream(self.req, self.parser, template=self.template)

    @property
    def has_tool_calls(self) -> bool:
        return any(b.kind == "tool_call" for b in self.blocks)

    def step(self, text: str, finished: bool) -> list[BlockEvent]:
        assert self._tools is not None
        delta = self._tools.step(text, finished) or {}
        events: list[BlockEvent] = []
        if delta.get("content"):
            if not self._open or self.blocks[-1].kind != "text":
                events += self._start(ReplyBlock("text"))
            block = self.blocks[-1]
            block.text += delta["content"]
            events.append(BlockEvent("delta", len(self.blocks) - 1, block, delta["content"]))
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self._start(ReplyBlock("tool_call", call_id=call["id"], name=function.get("name") or ""))
                self._calls[call["index"]] = len(self.blocks) - 1
            fragment = function.get("arguments") or ""
            index = self._calls.get(call["index"])
            if fragment and index is not None:
                self.blocks[index].arguments += fragment
                events.append(BlockEvent("delta", index, self.blocks[index], fragment))
        if finished:
            events += self._stop()
        return events

    def open_text(self) -> list[BlockEvent]:
        """Open a text block before any output (for routes that announce one even if it stays empty)."""
        return self._start(ReplyBlock("text"))

    def _start(self, block: ReplyBlock) -> list[BlockEvent]:
        events = self._stop()
        self.blocks.append(block)
        self._open = True
        return [*events, BlockEvent("start", len(self.blocks) - 1, block)]

    def _stop(self) -> list[BlockEvent]:
        if not self._open:
            return []
        self._open = False
        return [BlockEvent("stop", len(self.blocks) - 1, self.blocks[-1])]
