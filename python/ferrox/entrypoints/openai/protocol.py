"""Request bodies of the OpenAI-compatible API, validated with pydantic v2.

Field names, defaults and ranges follow OpenAI's API, plus vLLM's extras (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, ...), so existing clients and
scripts work unchanged. Unknown fields are ignored (clients send many optional ones).
Responses are plain dicts built in `serving_chat.py` / `serving_completion.py`: their
shape is fixed by OpenAI's schema and a dict keeps that visible.

The structured-output fields (`response_format`, `structured_outputs`, `guided_*`) and
`tools` / `tool_choice` are accepted here and handed to `structured.py` / the tool hooks.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# OpenAI caps top_logprobs at 20; vLLM allows more, but 20 keeps responses sane.
MAX_TOP_LOGPROBS = 20
MAX_N = 128


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict"}


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
    priority: int = 0
    request_id: str | None = None
    # Structured outputs (semantics live in entrypoints/openai/structured.py).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
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


# ---- chat ------------------------------------------------------------------------------------


class TextContentPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (e.g. reasoning fields some clients echo back) pass through to the template.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise ValueError(f"content part type {part.get('type')!r} is not supported (only 'text')")
        return value

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def to_template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to one string."""
        out: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        for key, value in (self.model_extra or {}).items():
            out.setdefault(key, value)
        return out


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
    prompt: PromptInput
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: PromptInput) -> PromptInput:
        # Only the shape: each prompt's own rules (empty, too long, ids outside the vocabulary) are
        # the engine's request rules (ferrox.engine.validation), applied per prompt.
        if not isinstance(value, str) and len(value) == 0:
            raise ValueError("prompt must not be empty")
        return value

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
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

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one choice group each."""
        p = self.prompt
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
    chat_template_kwargs: dict[str, Any] | None = None

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
