"""Request body of OpenAI's Responses API (POST /v1/responses), validated with pydantic v2.

Served: text or item-list `input` (messages, function_call, function_call_output and reasoning items),
`instructions`, `max_output_tokens`, temperature / top_p, `stream`, function `tools` with
`tool_choice` / `parallel_tool_calls`, `text.format` (text, json_object, json_schema), and
`metadata` / `user`, which are echoed back, and `reasoning.effort` (a chat-template variable, as
chat's reasoning_effort); `store`, `previous_response_id` and `background` when the server keeps
responses (responses_store.py; refused by name otherwise). Everything else the API defines
(reasoning summaries, hosted tools, files...) is refused with a 400 naming the field:
ferrox never accepts a parameter it would then ignore. `to_chat_messages` gives the conversation
in OpenAI chat's shape, so rendering and tool use go through the chat route's machinery; a message's
input_image, input_audio, audio_url and video_url parts become the chat route's image_url, input_audio,
audio_url and video_url parts (vLLM's Responses route hands its parts to its chat parser the same way), so the
same decoding, --limit-mm-per-prompt counts, --media-io-kwargs, errors and model refusals apply.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    field_validator,
    model_validator,
)

from ferrox.entrypoints.openai.protocol import ResponseFormat
from ferrox.entrypoints.tool_use import ToolRequest

# Top-level fields of the API that ferrox does not serve -> why (sent with a value that asks for
# nothing, such as null, false or [], they pass).
UNSUPPORTED_FIELDS = {
    "conversation": "conversations are not supported; send the whole conversation as input",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "service_tier": "service tiers are not supported",
    "stream_options": "stream_options is not supported on /v1/responses",
    "prompt_cache_retention": "prompt_cache_retention is not supported (prefix caching is automatic)",
    "context_management": "context_management is not supported",
}


_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Item(BaseModel):
    # Items echoed back from an earlier response carry keys (id, status) that change nothing.
    model_config = ConfigDict(extra="ignore")


class InputText(_Item):
    type: Literal["input_text"]
    text: str


class OutputText(_Item):
    type: Literal["output_text"]
    text: str


class InputImage(_Item):
    """An image for a model that takes them: a URL or data URL (OpenAI's file_id names an uploaded file,
    which ferrox does not store: refused)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None

    @model_validator(mode="after")
    def _url_only(self) -> InputImage:
        if self.file_id is not None:
            raise ValueError("input_image.file_id: uploaded files are not supported (give image_url)")
        if not self.image_url:
            raise ValueError("input_image needs image_url")
        return self

    def chat_part(self) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": self.image_url}}


class AudioData(_Item):
    data: str  # the clip's bytes in base64
    format: str  # wav, mp3... (multimodal/audio.py AUDIO_FORMATS; the bytes are probed, not trusted to it)


class InputAudio(_Item):
    """A clip for a model that takes audio (OpenAI's ResponseInputAudioParam): decoded as a chat's input_audio
    part is (multimodal/audio.py)."""

    type: Literal["input_audio"]
    input_audio: AudioData

    def chat_part(self) -> dict[str, Any]:
        return {"type": "input_audio", "input_audio": {"data": self.input_audio.data,
                                                       "format": self.input_audio.format}}


class AudioURLData(_Item):
    url: str


class AudioURL(_Item):
    """vLLM's audio_url part (its Responses route takes every part its chat route does): a data: URL, http(s) or
    a file under --allowed-local-media-path; the url as an object or a plain string, kept as sent."""

    type: Literal["audio_url"]
    audio_url: AudioURLData | str

    def chat_part(self) -> dict[str, Any]:
        url = self.audio_url if isinstance(self.audio_url, str) else self.audio_url.url
        return {"type": "audio_url", "audio_url": {"url": url}}


class VideoURLData(_Item):
    url: str


class VideoURL(_Item):
    """vLLM's video_url part (its chat parser takes it on the Responses route too): a data: URL, http(s) or a file
    under --allowed-local-media-path, decoded and sampled as a chat's video (multimodal/video.py); the url as an
    object or a plain string, kept as sent."""

    type: Literal["video_url"]
    video_url: VideoURLData | str

    def chat_part(self) -> dict[str, Any]:
        url = self.video_url if isinstance(self.video_url, str) else self.video_url.url
        return {"type": "video_url", "video_url": {"url": url}}


ContentPart = Annotated[InputText | OutputText | InputImage | InputAudio | AudioURL | VideoURL,
                        Field(discriminator="type")]
_MEDIA_PARTS = (InputImage, InputAudio, AudioURL, VideoURL)


class ReasoningText(_Item):
    type: Literal["reasoning_text"]
    text: str


# include: ["reasoning.encrypted_content"] asks for the thinking in a form the client can send back
# with store=false (Codex does), when the server keeps nothing between requests. ferrox encrypts nothing:
# the reasoning item's encrypted_content is its text, base64-encoded behind this marker.
ENCRYPTED_PREFIX = "ferrox-reasoning-v1:"


def encrypt_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


class ReasoningItem(_Item):
    """An earlier response's reasoning item, sent back with the rest of its output (as agent SDKs do):
    its text goes to the template as the next assistant turn's reasoning_content. Without content,
    ferrox's own encrypted_content stands for it; `summary` and another provider's encrypted_content
    (opaque) have nothing a template can read."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _readable_if_ours(cls, value: str | None) -> str | None:
        if value is not None and value.startswith(ENCRYPTED_PREFIX):
            _decrypt(value)  # a 400 now rather than a failure while rendering
        return value

    def text(self) -> str:
        if self.content:
            return "".join(part.text for part in self.content)
        blob = self.encrypted_content or ""
        return _decrypt(blob) if blob.startswith(ENCRYPTED_PREFIX) else ""


def _decrypt(blob: str) -> str:
    try:
        return base64.b64decode(blob[len(ENCRYPTED_PREFIX):], validate=True).decode()
    except (ValueError, UnicodeDecodeError):
        raise ValueError("encrypted_content: carries ferrox's marker but is not what ferrox wrote") from None


class ReasoningOptions(_Strict):
    """OpenAI's `reasoning`: effort becomes the chat template's reasoning_effort (and enable_thinking,
    as chat's reasoning_effort does); summaries are not written: "auto" lets the server choose, and
    ferrox's choice is none (the whole thinking is the reasoning item's content)."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto"] | None = None
    generate_summary: Literal["auto"] | None = None  # the older name of summary

    def template_kwargs(self) -> dict[str, Any]:
        if self.effort is None:
            return {}
        return {"reasoning_effort": self.effort, "enable_thinking": self.effort != "none"}


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(
            p.text for p in self.content if not isinstance(p, _MEDIA_PARTS))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content for the chat path: text, or its parts in order (content[j] stays the chat's content[j])
        when it has images, videos or audio."""
        if isinstance(self.content, str) or not any(isinstance(p, _MEDIA_PARTS) for p in self.content):
            return self.text()
        return [p.chat_part() if isinstance(p, _MEDIA_PARTS) else {"type": "text", "text": p.text}
                for p in self.content]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(p.text for p in self.output)


def _item_kind(item: Any) -> str | None:
    # A message may leave out its `type` ({"role": "user", "content": "hi"}, the easy form).
    if isinstance(item, dict):
        return item.get("type") or ("message" if "role" in item else None)
    return getattr(item, "type", None)


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_PART_KINDS = ("input_text", "output_text", "input_image", "input_audio", "audio_url", "video_url")


def _check_items(items: Any) -> Any:
    """Name the first item or content part of a kind ferrox does not serve (input_file parts, hosted-tool
    calls...) and a media part's missing url or data: pydantic alone would only say that `input` is not a string."""
    if not isinstance(items, list):
        return items
    for i, item in enumerate(items):
        kind = _item_kind(item)
        if kind not in _ITEM_KINDS:
            raise ValueError(f"input[{i}]: item type {kind!r} is not supported (only {', '.join(_ITEM_KINDS)})")
        content = item.get("content") if kind == "message" and isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind not in _PART_KINDS:
                raise ValueError(f"input[{i}].content[{j}]: content type {part_kind!r} is not supported "
                                 f"(only {', '.join(_PART_KINDS)})")
            if part_kind == "input_image" and part.get("file_id") is not None:
                raise ValueError(f"input[{i}].content[{j}].file_id: uploaded files are not supported (give "
                                 "image_url: a URL or a data URL)")
            if part_kind in ("input_audio", "audio_url"):
                _check_audio_part(part, f"input[{i}].content[{j}]")
            if part_kind == "video_url":
                _check_video_part(part, f"input[{i}].content[{j}]")
    return items


def _check_video_part(part: dict[str, Any], where: str) -> None:
    """Name a video part's missing url (pydantic alone would only say that `input` is not a string); the video
    itself is fetched and decoded with the chat route's messages."""
    url = part.get("video_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str) or not url:
        raise ValueError(f"{where}.video_url.url: a video part needs a url (https://..., data:video/mp4;base64,...)")


def _check_audio_part(part: dict[str, Any], where: str) -> None:
    """Name an audio part's missing or mistyped field (pydantic alone would only say that `input` is not a
    string). Its format and bytes are checked as the clip decodes, with the chat route's messages."""
    if part["type"] == "audio_url":
        url = part.get("audio_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}.audio_url.url: an audio part needs a url (https://..., "
                             "data:audio/wav;base64,...)")
        return
    body = part.get("input_audio")
    if not isinstance(body, dict):
        raise ValueError(f"{where}.input_audio: must be an object {{\"data\": <base64>, \"format\": \"wav\"}}")
    if not isinstance(body.get("data"), str):
        raise ValueError(f"{where}.input_audio.data: an input_audio part needs its clip as a base64 string")
    if body.get("format") is None:
        raise ValueError(f"{where}.input_audio.format: missing: name the clip's format (wav, mp3...)")
    if not isinstance(body["format"], str):
        raise ValueError(f"{where}.input_audio.format: must be a string naming the clip's format (wav, mp3...)")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


_HISTORY = TypeAdapter(list[InputItem])

# Id prefixes of the items ferrox lists for GET /v1/responses/{id}/input_items (OpenAI's spelling).
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def _stored_item(item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem) -> dict[str, Any]:
    """An input item as a Responses item with an id and a status, the shape input_items lists (a
    message's text content becomes one input_text part, output_text for the assistant's)."""
    body = item.model_dump(exclude_none=True)
    if isinstance(item, MessageItem) and isinstance(item.content, str):
        kind = "output_text" if item.role == "assistant" else "input_text"
        body["content"] = [{"type": kind, "text": item.content}]
    if isinstance(item, ReasoningItem):
        body["summary"] = []
    return {"id": f"{_ID_PREFIXES[item.type]}_{uuid.uuid4().hex}", **body, "status": "completed"}


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Honoured for tool_choice "required" / a named function (decoding follows the schema); with
    # "auto" calls are parsed from free text, as on /v1/chat/completions.
    strict: bool | None = None

    def to_chat(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    # Unknown top-level fields are kept so the route can refuse them by name (see UNSUPPORTED_FIELDS).
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: ReasoningOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # OpenAI's: a stable end-user id (like user: no effect on the output, logged); a cache key, by which
    # the data-parallel router keeps a conversation on the core that caches its prefix.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # What extra output to include: "reasoning.encrypted_content" (reasoning items carry it) and
    # "message.output_text.logprobs" (responses_logprobs.py), with top_logprobs alternatives per token.
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Served only while the server keeps responses (responses_store.py); refused by name otherwise.
    # store None is OpenAI's default, which is to store.
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        return _check_items(value)

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value: list[str] | None) -> list[str] | None:
        for entry in value or []:
            if entry not in _INCLUDES:
                raise ValueError(f"{entry!r} is not available (ferrox includes {' and '.join(map(repr, _INCLUDES))})")
        return value

    @property
    def includes_encrypted_reasoning(self) -> bool:
        return "reasoning.encrypted_content" in (self.include or [])

    @property
    def includes_output_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or [])

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        for i, tool in enumerate(value if isinstance(value, list) else []):
            if isinstance(tool, dict) and tool.get("type") != "function":
                raise ValueError(f"tools[{i}]: tool type {tool.get('type')!r} is not supported (only 'function')")
        return value

    def refused_fields(self) -> list[tuple[str, str]]:
        """(field, why) for each field sent that ferrox does not serve, in the order sent."""
        refused = []
        for name, value in (self.model_extra or {}).items():
            if value in (None, False, [], {}):
                continue
            refused.append((name, UNSUPPORTED_FIELDS.get(name, "unknown parameter")))
        return refused

    def to_chat_messages(self) -> list[dict[str, Any]]:
        """instructions + input as OpenAI chat messages: consecutive function_call items join one
        assistant message's tool_calls, function_call_output items become `role: tool` messages."""
        return self.chat_messages()[0]

    def chat_messages(self, history: int = 0) -> tuple[list[dict[str, Any]], list[str]]:
        """(to_chat_messages, each message's field in this request: `instructions`, `input[i]`), for errors
        about a chat message's parts to name the field the client sent. history: how many of `input`'s items
        came from previous_response_id (with_history), named as such."""
        out: list[dict[str, Any]] = []
        fields: list[str] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
            fields.append("instructions")
        if isinstance(self.input, str):
            out.append({"role": "user", "content": self.input})
            fields.append("input")
            return out, fields
        thinking = ""  # a reasoning item's text, for the assistant turn that follows it
        for i, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                thinking += item.text()
                continue
            before = len(out)
            if isinstance(item, MessageItem):
                # Chat templates know "system"; OpenAI's "developer" plays that part.
                role = "system" if item.role == "developer" else item.role
                out.append({"role": role, "content": item.chat_content()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if out and out[-1]["role"] == "assistant" and not thinking:
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if len(out) > before:  # (a function call joining the message before it keeps that one's field)
                fields.append(f"input[{i - history}]" if i >= history else
                              f"previous_response_id: the earlier conversation's item {i}")
            if out[-1]["role"] == "assistant" and thinking:
                out[-1]["reasoning_content"] = thinking
            if out[-1]["role"] != "assistant" or thinking:
                thinking = ""
        return out, fields

    def own_items(self) -> list[InputItem]:
        """The input as items (a text input is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def stored_input_items(self) -> list[dict[str, Any]]:
        """The input as the Responses items a store keeps and input_items lists, each with an id."""
        return [_stored_item(item) for item in self.own_items()]

    def with_history(self, history: list[dict[str, Any]]) -> ResponsesRequest:
        """This request continuing `history` (an earlier response's items: its inputs and outputs, as
        stored): the same request as one that sent those items before its own input, so it renders to
        the same prompt. An output item reads as the input item it would be sent back as."""
        return self.model_copy(update={"input": [*_HISTORY.validate_python(history), *self.own_items()]})

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's variables this request sets (reasoning.effort)."""
        return self.reasoning.template_kwargs() if self.reasoning is not None else {}

    def tool_request(self) -> ToolRequest:
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            chat_choice: str | dict[str, Any] | None = {"type": "function", "function": {"name": choice.name}}
        else:
            chat_choice = choice
        tools = [t.to_chat() for t in self.tools] if self.tools else None
        if tools is None and chat_choice in ("auto", "none"):
            chat_choice = None  # nothing to choose from: plain text, as OpenAI answers
        return ToolRequest(tools, chat_choice, self.parallel_tool_calls)

    def response_format(self) -> ResponseFormat | None:
        """text.format in chat's response_format shape (the chat route's structured-output hook)."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        spec: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
        if fmt.strict is not None:
            spec["strict"] = fmt.strict
        return ResponseFormat(type="json_schema", json_schema=spec)
