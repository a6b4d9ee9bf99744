"""Request bodies of the OpenAI-compatible API, validated with pydantic v2.

Field names, defaults and ranges follow OpenAI's API, plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...), so existing clients and
scripts work unchanged. Unknown fields are ignored (clients send many optional ones), but every
parameter vLLM documents is declared here and either honoured with vLLM's meaning or refused with a
400 naming it (`_REFUSED`): a vLLM user never gets a 200 that silently dropped what they asked for.
Responses are plain dicts built in `serving_chat.py` / `serving_completion.py`: their
shape is fixed by OpenAI's schema and a dict keeps that visible.

The structured-output fields (`response_format`, `structured_outputs`, `guided_*`) and
`tools` / `tool_choice` are accepted here and handed to `structured.py` / the tool hooks.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

# OpenAI caps top_logprobs at 20; vLLM allows more, but 20 keeps responses sane.
MAX_TOP_LOGPROBS = 20
MAX_N = 128

# ---- limits on the sizes a request controls ---------------------------------------------------
# Each is far above what real use needs (and above OpenAI's own limits where it has them: 4 stop
# sequences, 128 tools), but finite, so no one request makes every decode step, the structured-output
# compiler or the template renderer do unbounded work. A request past one gets a 400 naming the field.
MAX_STOP_SEQUENCES = 64  # checked against the text each step
MAX_STOP_CHARS = 1024  # per stop string
MAX_LOGIT_BIAS = 1024  # entries (every one is applied to every sampled row)
MAX_TOOLS = 128  # OpenAI's limit
MAX_SCHEMA_BYTES = 64 << 10  # a JSON schema (response format, guided_json, one tool's), as JSON text
MAX_SCHEMA_DEPTH = 64  # nesting of objects and lists in a schema
MAX_GRAMMAR_CHARS = 64 << 10  # guided_regex / guided_grammar text
MAX_CHAT_TEMPLATE_CHARS = 128 << 10  # a request's own chat_template (real ones are tens of KiB)


def json_depth(value: Any) -> int:
    """How deeply objects and lists nest in a decoded JSON value (a scalar: 0); iterative, so any
    depth json.loads accepted is measured without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema_size(schema: Any, what: str = "schema") -> None:
    """ValueError when a JSON schema is past MAX_SCHEMA_BYTES or MAX_SCHEMA_DEPTH."""
    size = len(schema.encode()) if isinstance(schema, str) else len(json.dumps(schema).encode())
    if size > MAX_SCHEMA_BYTES:
        raise ValueError(f"{what} is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are accepted")
    if not isinstance(schema, str) and json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{what} nests {json_depth(schema)} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted")


def check_stop_sequences(stops: list[str]) -> None:
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"{len(stops)} stop sequences; at most {MAX_STOP_SEQUENCES} are accepted")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop sequence of {longest} characters; at most {MAX_STOP_CHARS} are accepted")


def check_tools(tools: list[Any], schema_key: tuple[str, ...] = ("function", "parameters")) -> None:
    """At most MAX_TOOLS tools, each one's parameters schema (found under `schema_key`) within the
    schema limits."""
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"{len(tools)} tools; at most {MAX_TOOLS} are accepted")
    for i, tool in enumerate(tools):
        schema: Any = tool
        for key in schema_key:
            schema = schema.get(key) if isinstance(schema, dict) else getattr(schema, key, None)
        if schema is not None:
            check_schema_size(schema, f"tools[{i}]'s parameters schema")


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


# vLLM request parameters ferrox cannot honour: given with any value but their no-op default, they
# are a 400 naming the field (pydantic reports a field validator's error under the field's name).
_REFUSED = {
    "logits_processors": "custom logits processors are not supported",
    "kv_transfer_params": "disaggregated KV transfer is not supported",
    "watermarking": "watermarking is not supported",
}
# The value each of them may take without being refused (what vLLM does when it is not given).
_REFUSED_DEFAULTS: dict[str, Any] = {"watermarking": False}


def _refuse_unsupported(cls: type, value: Any, info: ValidationInfo) -> Any:
    name = info.field_name or ""
    if value is None or value == _REFUSED_DEFAULTS.get(name, None) or value in ([], {}):
        return value
    raise ValueError(f"{_REFUSED[name]}")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}
    # vLLM's structural_tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: Any = None  # the newer form, refused by name (structured.py)


class _SamplingFields(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep the last (truncation_side "left", the default) or first k prompt tokens; -1: max_model_len.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = Field(None, ge=0)
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(None, min_length=1)
    # Structured outputs (semantics live in entrypoints/openai/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    # Beam search (ferrox.beam_search): n is the beam width; length_penalty its score's exponent.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Refused unless left at their default (see _REFUSED).
    logits_processors: list[Any] | None = None
    cache_salt: str | None = None
    # Thinking tokens before `</think>` is forced (vLLM's; needs --reasoning-parser); -1: no budget.
    thinking_token_budget: int | None = Field(None, ge=-1)
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: SamplingParams.extra_args, read by custom logits processors (--logits-processors); refused
    # without them (engine/validation.py).
    vllm_xargs: dict[str, Any] | None = None
    # vLLM's: these token ids' logprobs in place of the top alternatives at each generated position (with
    # logprobs on; at most 128, ferrox.sampling_params). [] = unset.
    logprob_token_ids: list[int] | None = None
    # vLLM's RepetitionDetectionParams fields (max_pattern_size, min_pattern_size, min_count): a request
    # whose output loops on a pattern ends with finish_reason "repetition" (ferrox.sampling_params).
    repetition_detection: dict[str, Any] | None = None
    watermarking: bool | None = None
    # Tokens a streamed chunk gathers (the first and the last chunk go at once); default: the server's
    # --stream-interval. Non-streamed requests: no effect.
    stream_interval: int | None = Field(None, ge=1)

    _refuse = field_validator(
        "logits_processors", "kv_transfer_params", "watermarking",
    )(_refuse_unsupported)

    @field_validator("length_penalty")
    @classmethod
    def _penalty_for_beams(cls, value: float, info: ValidationInfo) -> float:
        if value != 1.0 and not info.data.get("use_beam_search"):
            raise ValueError("only applies to beam search (use_beam_search: true)")
        return value

    @field_validator("guided_decoding_backend")
    @classmethod
    def _check_backend(cls, value: str | None) -> str | None:
        # One backend: llguidance. Naming it (or vLLM's "auto") is fine; asking for another is not.
        if value is not None and value not in ("auto", "guidance", "llguidance"):
            raise ValueError(f"only the llguidance backend is available, got {value!r}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(w.strip() for w in value):
            raise ValueError("bad words must be non-empty strings")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None:
            check_stop_sequences([value] if isinstance(value, str) else value)
        return value

    @field_validator("response_format", "structured_outputs", "guided_json")
    @classmethod
    def _check_schema_size(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, ResponseFormat):
            if value.json_schema is not None:
                check_schema_size(value.json_schema, "the json_schema")
        elif value is not None:
            check_schema_size(value, "the schema" if info.field_name == "guided_json" else "the constraint")
        return value

    @field_validator("guided_regex", "guided_grammar")
    @classmethod
    def _check_grammar_size(cls, value: str | None) -> str | None:
        if value is not None and len(value) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{len(value)} characters; at most {MAX_GRAMMAR_CHARS} are accepted")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"{len(value)} entries; at most {MAX_LOGIT_BIAS} are accepted")
        for key, bias in value.items():
            try:
                int(key)
            except ValueError:
                raise ValueError(f"keys must be token ids (integers as strings), got {key!r}") from None
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be in [-100, 100], got {bias}")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk (vLLM's stream_options.continuous_usage_stats, with include_usage)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    # vLLM's rules: stream_options mean nothing without a stream, and prompt logprobs only come in a
    # whole response. (`stream` is declared before both, so it is in info.data.)
    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_streamed_prompt_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("not available when stream is true")
        return value


# ---- chat ------------------------------------------------------------------------------------


class TextContentPart(_Base):
    type: Literal["text"]
    text: str


class ImageURL(_Base):
    url: str
    # OpenAI's resolution hint; vLLM takes it and the model's processor decides the resolution.
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLContentPart(_Base):
    type: Literal["image_url"]
    image_url: ImageURL

    @field_validator("image_url", mode="before")
    @classmethod
    def _url_string(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value  # vLLM also takes the url as a string


class VideoURL(_Base):
    url: str


class VideoURLContentPart(_Base):
    """vLLM's video part: a data:video/...;base64 URL, an http(s) URL or a local file (multimodal/video.py)."""

    type: Literal["video_url"]
    video_url: VideoURL

    @field_validator("video_url", mode="before")
    @classmethod
    def _url_string(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value


class InputAudioContentPart(_Base):
    """OpenAI's audio part: {"data": <base64>, "format": "wav"}; its fields are checked where the clip decodes
    (multimodal/audio.py), so an error names the part and the model that takes no audio refuses it by name."""

    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class AudioURL(_Base):
    url: str


class AudioURLContentPart(_Base):
    """vLLM's audio part: a data:audio/...;base64 URL, an http(s) URL or a local file (multimodal/audio.py)."""

    type: Literal["audio_url"]
    audio_url: AudioURL

    @field_validator("audio_url", mode="before")
    @classmethod
    def _url_string(cls, value: Any) -> Any:
        return {"url": value} if isinstance(value, str) else value


_PART_TYPES = (None, "text", "image_url", "video_url", "input_audio", "audio_url")


class ChatMessage(BaseModel):
    # Extra keys (e.g. reasoning fields some clients echo back) pass through to the template.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart | ImageURLContentPart | VideoURLContentPart | InputAudioContentPart
                        | AudioURLContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in _PART_TYPES:
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (only 'text', "
                                     "'image_url', 'video_url', 'input_audio' and 'audio_url')")
        return value

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines (vLLM's joiner)."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextContentPart))

    def to_template_dict(self) -> dict[str, Any]:
        """The message for the chat template: content a string, or its parts as dicts (rendering
        shapes both as the template wants them: loader/chat_template.py; image parts are taken out
        first: multimodal/chat_parts.py)."""
        content: Any = ([_part_dict(part) for part in self.content] if isinstance(self.content, list)
                        else self.content or "")
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        for key, value in (self.model_extra or {}).items():
            out.setdefault(key, value)
        return out



def _part_dict(part: Any) -> dict[str, Any]:
    """A content part as the dict the chat rendering takes (multimodal/chat_parts.py)."""
    if isinstance(part, TextContentPart):
        return {"type": "text", "text": part.text}
    if isinstance(part, VideoURLContentPart):
        return {"type": "video_url", "video_url": {"url": part.video_url.url}}
    if isinstance(part, InputAudioContentPart):
        return {"type": "input_audio", "input_audio": dict(part.input_audio)}
    if isinstance(part, AudioURLContentPart):
        return {"type": "audio_url", "audio_url": {"url": part.audio_url.url}}
    return {"type": "image_url", "image_url": {"url": part.image_url.url}}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: a cache key (the data-parallel router keeps requests with one key on the core that
    # caches their prefix) and a stable end-user id (like user: no effect on the output, logged).
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # The template already holds the special tokens it wants (BOS, <|im_start|>): none added by default.
    add_special_tokens: bool = False
    # Template variables, as vLLM passes them (templates that do not use them render unchanged).
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # False drops the thinking (and the logprobs and token ids that would show it) from the reply;
    # needs the server's --reasoning-parser (serving_chat.py).
    include_reasoning: bool = True
    # The images' processor settings for this request over the server's --mm-processor-kwargs (the keys each
    # family takes: multimodal/processing.py PROCESSOR_KWARGS; others are a 400 naming mm_processor_kwargs.<key>).
    mm_processor_kwargs: dict[str, Any] | None = None
    # How this request's video files are sampled, over the server's --media-io-kwargs (media_io_config.py: video
    # num_frames and fps; other keys are a 400 naming media_io_kwargs.<modality>.<key>).
    media_io_kwargs: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _check_tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if value is not None:
            check_tools(value)
        return value

    @field_validator("chat_template")
    @classmethod
    def _check_template_size(cls, value: str | None) -> str | None:
        # It renders in the jinja2 sandbox (loader/chat_template.py); the size bounds its compilation.
        if value is not None and len(value) > MAX_CHAT_TEMPLATE_CHARS:
            raise ValueError(f"{len(value)} characters; at most {MAX_CHAT_TEMPLATE_CHARS} are accepted")
        return value

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs plus documents / reasoning_effort as template variables (vLLM's way:
        reasoning_effort also switches `enable_thinking` unless the caller set it)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            kwargs.setdefault("documents", self.documents)
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are sent.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- completions -----------------------------------------------------------------------------

PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    # Optional only beside prompt_embeds (vLLM's rule: one of the two, non-empty); "" with embeddings is none.
    prompt: PromptInput | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True
    # vLLM's: base64 of torch.save bytes of a [L, hidden] tensor, or a list of them (--enable-prompt-embeds;
    # multimodal/prompt_embeds.py). Each is a prompt of its own, before the text prompts.
    prompt_embeds: str | list[str] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: PromptInput | None) -> PromptInput | None:
        # Only the shape: each prompt's own rules (empty, too long, ids outside the vocabulary) are
        # the engine's request rules (ferrox.engine.validation), applied per prompt.
        if value is not None and not isinstance(value, str) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.prompt is None and not self.prompt_embeds:
            raise ValueError("either prompt or prompt_embeds must be given and non-empty")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def embeds(self) -> list[str]:
        """prompt_embeds as a list (each one prompt, one choice group)."""
        e = self.prompt_embeds
        return [] if e is None else [e] if isinstance(e, str) else list(e)

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one choice group each; beside
        prompt_embeds an absent or "" prompt is none (vLLM's)."""
        p = self.prompt
        if p is None or (p == "" and self.prompt_embeds):
            return []
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ---- tokenizer endpoints ---------------------------------------------------------------------


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None  # with messages, under the chat route's rule (--trust-request-chat-template)
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # with messages: the chat route's per-request processor settings

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt or messages must be given")
        return self


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, value: list[int]) -> list[int]:
        if any(t < 0 for t in value):
            raise ValueError("token ids must be >= 0")
        return value
