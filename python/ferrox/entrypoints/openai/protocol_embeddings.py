"""Request bodies of POST /v1/embeddings (OpenAI's, with vLLM's extras) and POST /pooling (vLLM's).

`input` takes OpenAI's four shapes: a string, an array of strings, an array of token ids (one input),
or an array of token-id arrays. Anything else (an empty array, an empty string, [1.5], a mix) is a 400
naming `input`. vLLM's extra fields are honoured (add_special_tokens, priority, request_id, normalize,
endianness) or refused by name when set to something ferrox does not do (truncate_prompt_tokens:
inputs are never cut, a too-long one is refused; embed_dtype other than float32; chat `messages`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_input(value: Any) -> EmbeddingInput:
    shapes = "a string, an array of strings, an array of token ids or an array of token-id arrays"
    if isinstance(value, str):
        if not value:
            raise ValueError("must not be an empty string")
        return value
    if not isinstance(value, list):
        raise ValueError(f"must be {shapes}, got {type(value).__name__}")
    if not value:
        raise ValueError("must not be an empty array")
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise ValueError(f"{len(value)} inputs; at most {MAX_EMBEDDING_INPUTS} are accepted in one request")
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise ValueError(f"input {value.index('')} is an empty string")
        return value
    if all(_is_token_id(v) for v in value):
        if min(value) < 0:
            raise ValueError(f"token ids must be >= 0, got {min(value)}")
        return value
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not ids or not all(_is_token_id(t) and t >= 0 for t in ids):
                raise ValueError(f"input {i} must be a non-empty array of token ids (integers >= 0)")
        return value
    raise ValueError(f"must be {shapes} (not a mix), got {value[:4]!r}{'...' if len(value) > 4 else ''}")


class PoolingInputRequest(BaseModel):
    """What every pooling route's body shares (embeddings, /pooling, /classify): `input` in the embeddings
    API's shapes, vLLM's request extras, and truncation refused by name."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None
    # vLLM's extras.
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(None, min_length=1)
    # Declared so that it is refused by name rather than ignored (see the module docstring).
    truncate_prompt_tokens: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> EmbeddingInput:
        return _check_input(value)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _no_truncation(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("inputs are never truncated (a longer input than the model takes is refused); shorten "
                             "the input instead")
        return value

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or one prompt's token ids."""
        value: Any = self.input
        if isinstance(value, str):
            return [value]
        if _is_token_id(value[0]):
            return [[int(t) for t in value]]
        return [x if isinstance(x, str) else [int(t) for t in x] for x in value]


class EmbeddingRequest(PoolingInputRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    endianness: Literal["native", "little", "big"] = "native"  # of the base64 float32 bytes
    # Declared so that they are refused by name rather than ignored (see the module docstring).
    embed_dtype: str = "float32"
    messages: list[Any] | None = None

    @field_validator("embed_dtype")
    @classmethod
    def _float32_only(cls, value: str) -> str:
        if value != "float32":
            raise ValueError(f"only float32 embeddings are served, got {value!r}")
        return value

    @field_validator("messages")
    @classmethod
    def _no_chat(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("chat-style embedding requests are not supported (send `input`)")
        return value


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling body: the embeddings fields plus the pooling task: "encode" (or none) gives the model's
    pooled output (an embedding model's vector, a sequence classifier's class scores), "embed" and
    "classify" ask for one kind (the other kind of model refuses it, naming `task`)."""

    task: Literal["embed", "encode", "classify"] | None = None
