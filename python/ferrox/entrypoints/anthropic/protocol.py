"""Request body of Anthropic's Messages API (POST /v1/messages), validated with pydantic v2.

Content blocks served: text, tool_use and thinking (assistant turns), tool_result and image (user
turns; images for a model that takes them); an assistant's redacted_thinking is opaque and left out of
the prompt (as in vLLM). Other blocks (document...) and server tools are rejected with a 400 naming them rather than silently
dropped. `template_messages` turns the conversation into the OpenAI chat
shape that the chat templates and the shared tool machinery (entrypoints/tool_use.py) read.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ferrox.entrypoints.openai.protocol import ResponseFormat, check_stop_sequences, check_tools
from ferrox.entrypoints.tool_use import ToolRequest

# Fields of Anthropic's API that ferrox does not serve: refused by name instead of ignored.
UNSUPPORTED_FIELDS = {
    "mcp_servers": "MCP servers are not supported",
    "container": "containers are not supported",
}


class _Base(BaseModel):
    # Blocks carry optional keys ferrox has no use for and that change nothing (cache_control).
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Base):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Base):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Base):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, value: Any) -> Any:
        return _reject_blocks(value, ("text",))

    def text(self) -> str:
        body = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        # The model should know a tool failed; Anthropic's flag has no chat-template field of its own.
        return f"Error: {body}" if self.is_error else body


class ThinkingBlock(_Base):
    """An earlier turn's thinking, echoed back: the chat template gets it as the message's
    reasoning_content (Qwen3's templates keep the last turns' thinking)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Base):
    type: Literal["redacted_thinking"]
    data: str = ""


class ImageSource(_Base):
    type: Literal["base64", "url"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"] | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields_for_type(self) -> ImageSource:
        if self.type == "base64" and (self.data is None or self.media_type is None):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs url")
        return self


class ImageBlock(_Base):
    """A user turn's image: an OpenAI image_url part for the shared chat path (a base64 source as a
    data URL), fetched and placed by the model's image rules (entrypoints/openai/serving_images.py)."""

    type: Literal["image"]
    source: ImageSource

    def to_openai(self) -> dict[str, Any]:
        src = self.source
        url = f"data:{src.media_type};base64,{src.data}" if src.type == "base64" else src.url
        return {"type": "image_url", "image_url": {"url": url}}


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
                         | ImageBlock, Field(discriminator="type")]

_BLOCKS_BY_ROLE = {"user": ("text", "tool_result", "image"),
                   "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def _reject_blocks(value: Any, allowed: tuple[str, ...]) -> Any:
    if isinstance(value, list):
        for block in value:
            if isinstance(block, dict) and block.get("type") not in allowed:
                raise ValueError(f"content block type {block.get('type')!r} is not supported here "
                                 f"(only {', '.join(repr(a) for a in allowed)})")
    return value


class AnthropicMessage(_Base):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _blocks_for_role(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("role") in _BLOCKS_BY_ROLE:
            _reject_blocks(data.get("content"), _BLOCKS_BY_ROLE[data["role"]])
            content = data.get("content")
            for block in content if isinstance(content, list) else []:
                # (pydantic's own error for a bad block would name the content's string form instead)
                source = block.get("source") if isinstance(block, dict) and block.get("type") == "image" else None
                if isinstance(block, dict) and block.get("type") == "image" and (
                        not isinstance(source, dict) or source.get("type") not in ("base64", "url")):
                    raise ValueError("image block: source must be {\"type\": \"base64\", \"media_type\", "
                                     "\"data\"} or {\"type\": \"url\", \"url\"}")
        return data

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # Text blocks joined by newlines, as vLLM's Messages route joins them (its OpenAI text parts).
        return "\n".join(block.text for block in self.content if isinstance(block, TextBlock))

    def to_openai(self) -> list[dict[str, Any]]:
        """This turn as OpenAI chat messages: tool_use blocks become the assistant's tool_calls,
        each tool_result its own `role: tool` message, in the order the blocks came."""
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            texts = [b.text for b in self.content if isinstance(b, TextBlock)]
            message: dict[str, Any] = {"role": "assistant", "content": _text_content(texts)}
            thinking = "".join(b.thinking for b in self.content if isinstance(b, ThinkingBlock))
            if thinking:
                message["reasoning_content"] = thinking
            calls = [{"id": b.id, "type": "function",
                      "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                     for b in self.content if isinstance(b, ToolUseBlock)]
            if calls:
                message["tool_calls"] = calls
            return [message]
        out: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        for block in self.content:
            if isinstance(block, ToolResultBlock):
                if parts:
                    out.append({"role": "user", "content": _user_content(parts)})
                    parts = []
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            elif isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(block.to_openai())
        if parts or not out:
            out.append({"role": "user", "content": _user_content(parts)})
        return out


def _user_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A user turn's text and image parts as OpenAI content: one text a string, else the parts."""
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts or ""


def _text_content(texts: list[str]) -> str | list[dict[str, str]]:
    """A turn's text blocks as OpenAI content: one block a string, several a list of text parts (the
    chat template gets them joined by newlines or as parts: --chat-template-content-format)."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts] if texts else ""


class Tool(_Base):
    """A client tool. Anthropic's server tools (bash_*, web_search_*...) carry another `type`."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]

    def to_openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoice(_Base):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("name is required with type 'tool', and only with it")
        return self

    def to_openai(self) -> str | dict[str, Any]:
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JSONOutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class ThinkingConfig(_Strict):
    """Anthropic's `thinking`, read for an open reasoning model (--reasoning-parser):
    - enabled: the chat template's enable_thinking on, and `budget_tokens` the request's
      thinking_token_budget (vLLM's rule: `</think>` is forced once the thinking used it);
    - adaptive: enable_thinking on, the model decides how long it thinks (no budget);
    - disabled: enable_thinking off (Qwen3's switch), and a budget of 0 for models whose template
      opens the thinking anyway (DeepSeek-R1): it closes at once.
    `display: "omitted"` returns thinking blocks without their text (Anthropic's meaning);
    "summarized" returns the thinking itself: ferrox writes no summaries of an open model's thinking.
    A model served without a reasoning parser does not think: enabled and adaptive change nothing
    it would do, and no thinking blocks come back."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget_for_enabled(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required with type 'enabled'")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise ValueError(f"budget_tokens is only for type 'enabled', not {self.type!r}")
        return self

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.type != "disabled"}

    def budget(self) -> int | None:
        """The thinking_token_budget this asks for (with a reasoning parser)."""
        return self.budget_tokens if self.type == "enabled" else 0 if self.type == "disabled" else None


class OutputConfig(_Strict):
    """Anthropic's output_config: `format` constrains the reply to a JSON schema (chat's
    response_format json_schema, closed objects and all); `effort` is the chat template's
    reasoning_effort, as vLLM passes it. Keys Anthropic adds later are refused by name (strict)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None

    def response_format(self) -> ResponseFormat | None:
        if self.format is None:
            return None
        return ResponseFormat(type="json_schema", json_schema={"name": "output", "schema": self.format.schema_})


# Claude Code starts the system prompt with a line such as
# "x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch=eb6c6;" (its own block).
# The cch value changes with every request, so kept in the prompt it would make every turn's prompt
# differ from the previous one at its first tokens and the prefix cache would never hit: each turn
# would prefill Claude Code's whole context (tens of thousands of tokens) again. It is billing
# metadata for Anthropic's API, not text for the model, so it is left out (as vLLM and SGLang do).
BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing_header(text: str) -> str:
    if not text.startswith(BILLING_HEADER):
        return text
    _, _, rest = text.partition("\n")
    return rest


class MessagesRequest(_Base):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None

    thinking: ThinkingConfig | None = None

    # Declared only to be refused by name.
    mcp_servers: list[Any] | None = Field(None, description="refused when non-empty")
    container: Any = Field(None, description="refused when set")

    @field_validator("mcp_servers", "container")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            raise ValueError(f"{UNSUPPORTED_FIELDS[str(info.field_name)]} by ferrox")
        return None

    @field_validator("system", mode="before")
    @classmethod
    def _only_text_system(cls, value: Any) -> Any:
        return _reject_blocks(value, ("text",))

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(s == "" for s in value):
            raise ValueError("stop sequences must be non-empty")
        if value:
            check_stop_sequences(value)  # the same limits as OpenAI's `stop`
        return value

    @field_validator("tools")
    @classmethod
    def _check_tool_sizes(cls, value: list[Tool] | None) -> list[Tool] | None:
        if value:
            check_tools(value, ("input_schema",))
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _only_client_tools(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, tool in enumerate(value):
                if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
                    raise ValueError(f"tools[{i}]: server tool type {tool.get('type')!r} is not supported "
                                     "(only client tools with an input_schema)")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if value is not None and value.type in ("any", "tool") and not info.data.get("tools"):
            raise ValueError(f"type {value.type!r} needs a non-empty tools list")
        return value

    def system_text(self) -> str | None:
        """The system prompt the model reads: Claude Code's billing header left out (below)."""
        if self.system is None:
            return None
        if isinstance(self.system, str):
            return _without_billing_header(self.system)
        return "".join(_without_billing_header(block.text) for block in self.system)

    @property
    def prefill(self) -> bool:
        """A last assistant turn with text: the reply continues it (Anthropic's assistant prefill)."""
        last = self.messages[-1]
        return last.role == "assistant" and bool(last.text()) and not (
            isinstance(last.content, list) and any(isinstance(b, ToolUseBlock) for b in last.content))

    def template_messages(self) -> list[dict[str, Any]]:
        """System prompt + turns in the OpenAI chat shape chat templates expect. An empty last
        assistant turn (nothing to continue) is dropped: the model starts a fresh turn."""
        out: list[dict[str, Any]] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        turns = self.messages
        last = turns[-1]
        if last.role == "assistant" and not last.text() and not last.to_openai()[0].get("tool_calls"):
            turns = turns[:-1]
        for message in turns:
            out.extend(message.to_openai())
        return out

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables this request sets (thinking's enable_thinking,
        output_config.effort)."""
        kwargs = self.thinking.template_kwargs() if self.thinking is not None else {}
        effort = self.output_config.effort if self.output_config is not None else None
        if effort is not None:
            kwargs["reasoning_effort"] = effort
        return kwargs

    def tool_request(self) -> ToolRequest:
        if not self.tools:  # tool_choice auto / none without tools: nothing to choose from
            return ToolRequest()
        choice = self.tool_choice
        return ToolRequest(
            tools=[t.to_openai() for t in self.tools],
            tool_choice=choice.to_openai() if choice else "auto",
            parallel_tool_calls=not choice.disable_parallel_tool_use if choice else None,
        )


class MessagesCountRequest(MessagesRequest):
    """Body of /v1/messages/count_tokens: a Messages request without the generation fields."""

    max_tokens: int = Field(1, ge=1)
