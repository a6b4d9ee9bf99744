"""Request body of Anthropic's Messages API (POST /v1/messages), validated with pydantic v2.

Only text content is served; image / tool-use blocks are rejected with a clear 400 rather
than silently dropped.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Base):
    type: Literal["text"]
    text: str


def _reject_non_text(value: Any) -> Any:
    if isinstance(value, list):
        for block in value:
            if isinstance(block, dict) and block.get("type") != "text":
                raise ValueError(f"content block type {block.get('type')!r} is not supported (only 'text')")
    return value


class AnthropicMessage(_Base):
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _only_text(cls, value: Any) -> Any:
        return _reject_non_text(value)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


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

    @field_validator("system", mode="before")
    @classmethod
    def _only_text_system(cls, value: Any) -> Any:
        return _reject_non_text(value)

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, value: list[str] | None) -> list[str] | None:
        if value and any(s == "" for s in value):
            raise ValueError("stop sequences must be non-empty")
        return value

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "".join(block.text for block in self.system)

    def template_messages(self) -> list[dict[str, str]]:
        """System prompt + turns in the OpenAI-style shape chat templates expect."""
        out: list[dict[str, str]] = []
        system = self.system_text()
        if system:
            out.append({"role": "system", "content": system})
        out.extend({"role": m.role, "content": m.text()} for m in self.messages)
        return out


class MessagesCountRequest(MessagesRequest):
    """Body of /v1/messages/count_tokens: a Messages request without the generation fields."""

    max_tokens: int = Field(1, ge=1)
