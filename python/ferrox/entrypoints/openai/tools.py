"""Tool calling on /v1/chat/completions: the glue between the request and ferrox.structured.

- validate_tools / tool_constraint: tools + tool_choice -> the constraint ("required": Hermes
  <tool_call> blocks over the functions' schemas; named: that function's parameters schema),
  an InvalidArgumentError whose `param` is "tools" or "tool_choice" for bad input (-> 400).
- prepare_messages (= structured.tools.prepare_tool_messages, shared with the offline LLM.chat):
  for chat templates that know nothing of tools (the embedded SmolLM2's), the tool listing goes
  into the system message and tool calls / results become text.
- parse_tool_calls (whole reply) and ToolStream (streamed deltas) turn model text into
  OpenAI `tool_calls`.
"""

from __future__ import annotations

from typing import Any

from ferrox.entrypoints.openai.tool_parsers import (
    DeltaMessage,
    ToolCall,
    ToolParser,
    default_tool_parser,
    get_tool_parser,
)
from ferrox.entrypoints.openai.tool_parsers.base import DeltaToolCall, new_tool_call_id
from ferrox.entrypoints.openai.tool_parsers.openai_harmony import OpenAIHarmonyToolParser
from ferrox.errors import InvalidArgumentError
from ferrox.structured.backend import validate_params
from ferrox.structured.params import StructuredOutputsParams
from ferrox.structured.tools import (
    ToolConstraint,
    parse_tools,
    tool_choice_constraint,
)
from ferrox.structured.tools import prepare_tool_messages as prepare_messages

__all__ = ["ToolStream", "parse_tool_calls", "prepare_messages", "template_text", "tool_constraint", "validate_tools"]


def _constraint(request: Any) -> ToolConstraint:
    parallel = request.parallel_tool_calls if request.parallel_tool_calls is not None else True
    return tool_choice_constraint(request.tools, request.tool_choice, parallel_tool_calls=parallel)


def validate_tools(request: Any) -> None:
    """Raise InvalidArgumentError (param "tools" or "tool_choice"; the message names tools[i]...)
    when they are malformed or inconsistent."""
    try:
        parse_tools(request.tools)
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), param="tools") from None
    try:
        _constraint(request)  # the tools parse: what is left to refuse is the choice among them
    except ValueError as exc:
        raise InvalidArgumentError(str(exc), param="tool_choice") from None


def tool_constraint(request: Any) -> StructuredOutputsParams | None:
    """The constraint forcing a tool call (tool_choice 'required' or named); None otherwise.
    A function whose parameters schema llguidance rejects is an InvalidArgumentError naming
    "tools" (-> 400) here."""
    params = _constraint(request).structured_outputs
    if params is not None:
        try:
            validate_params(params)
        except ValueError as exc:
            raise InvalidArgumentError(f"tools: {exc}", param="tools") from None
    return params


def template_text(ctx: Any, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str | None:
    """The chat template a request renders with (None when there is none: rendering will say so)."""
    try:
        return ctx.engine.tokenizer.get_chat_template(chat_template or ctx.engine.chat_template, tools)
    except Exception:  # no template: render_chat reports it as a 400
        return None


def _parser(request: Any, parser_name: str | None, template: str | None) -> ToolParser:
    # The request's tools go along: some formats (qwen3_coder) need the parameter types.
    return get_tool_parser(parser_name or default_tool_parser(template))(tools=request.tools)


def needs_special_tokens(request: Any, parser_name: str | None = None, template: str | None = None) -> bool:
    """Whether the parser that reads this request's reply (tool_choice "auto") needs the special
    tokens kept in the text: then it must be generated with skip_special_tokens=False."""
    try:
        if _constraint(request).mode != "auto":
            return False
    except ValueError:  # bad tools: validate_tools reports them
        return False
    return get_tool_parser(parser_name or default_tool_parser(template)).needs_special_tokens


def reads_harmony_calls(request: Any, parser_name: str | None = None, template: str | None = None) -> bool:
    """Whether the parser that reads this request's reply (tool_choice "auto") is gpt-oss's `openai`:
    the `openai_gptoss` reasoning parser then passes the calls on in the content (else it drops them)."""
    try:
        if _constraint(request).mode != "auto":
            return False
    except ValueError:  # bad tools: validate_tools reports them
        return False
    return issubclass(get_tool_parser(parser_name or default_tool_parser(template)), OpenAIHarmonyToolParser)


def _openai_call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def parse_tool_calls(
    text: str, request: Any, parser_name: str | None = None, template: str | None = None
) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) from a finished completion; tool_calls None when there are none."""
    constraint = _constraint(request)
    if constraint.mode == "none":
        return text, None
    if constraint.mode == "named":
        # The output *is* the arguments object (constrained to the function's schema).
        return None, [_openai_call(ToolCall(name=constraint.function_name or "", arguments=text.strip()))]
    parser = (
        get_tool_parser("hermes")()
        if constraint.mode == "required"
        else _parser(request, parser_name, template)
    )
    result = parser.extract(text)
    if not result.tool_calls:
        return text, None
    return result.content, [_openai_call(c) for c in result.tool_calls]


class ToolStream:
    """Per-choice streaming: text deltas in, OpenAI chat delta dicts out."""

    def __init__(self, request: Any, parser_name: str | None = None, template: str | None = None) -> None:
        self.constraint = _constraint(request)
        self.mode = self.constraint.mode
        self.parser: ToolParser | None = None
        if self.mode == "required":
            self.parser = get_tool_parser("hermes")()
        elif self.mode == "auto":
            self.parser = _parser(request, parser_name, template)
        self._named_id = new_tool_call_id()
        self._named_started = False

    @property
    def tools_called(self) -> bool:
        return self._named_started if self.mode == "named" else bool(self.parser and self.parser.tools_called)

    def feed(self, text: str) -> dict[str, Any] | None:
        if self.mode == "none":
            return {"content": text} if text else None
        if self.mode == "named":
            return self._named(text)
        assert self.parser is not None
        return _delta_dict(self.parser.feed(text))

    def finish(self) -> dict[str, Any] | None:
        if self.parser is None:
            return None
        return _delta_dict(self.parser.finish())

    def step(self, text: str, finished: bool) -> dict[str, Any] | None:
        """feed(text), plus finish() when the choice ended: the delta dict for one chunk."""
        delta = self.feed(text) or {}
        if finished:
            tail = self.finish() or {}
            if tail.get("content"):
                delta["content"] = delta.get("content", "") + tail["content"]
            if tail.get("tool_calls"):
                delta["tool_calls"] = delta.get("tool_calls", []) + tail["tool_calls"]
        return delta or None

    def _named(self, text: str) -> dict[str, Any] | None:
        if not self._named_started:
            text = text.lstrip()
            if not text:
                return None
            self._named_started = True
            delta = DeltaToolCall(0, id=self._named_id, name=self.constraint.function_name, arguments=text)
        elif text:
            delta = DeltaToolCall(0, arguments=text)
        else:
            return None
        return _delta_dict(DeltaMessage(tool_calls=[delta]))


def _delta_dict(delta: DeltaMessage) -> dict[str, Any] | None:
    if not delta:
        return None
    out: dict[str, Any] = {}
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = [
            {
                "index": tc.index,
                **({"id": tc.id, "type": "function"} if tc.id else {}),
                "function": {
                    **({"name": tc.name} if tc.name is not None else {}),
                    "arguments": tc.arguments or "",
                },
            }
            for tc in delta.tool_calls
        ]
    return out
