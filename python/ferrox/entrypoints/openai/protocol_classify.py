"""Request body of POST /classify (vLLM's), served by a sequence-classification model.

`input` takes the embeddings API's shapes (a string, strings, token ids, token-id arrays; anything else is a
400 naming `input`). vLLM's other fields are honoured (add_special_tokens, priority, request_id, user;
use_activation and its older names softmax and activation: false gives the raw logits) or refused by name
(truncate_prompt_tokens: inputs are never cut; chat `messages`; mm_processor_kwargs).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ferrox.entrypoints.openai.protocol_embeddings import EmbeddingInput, _check_input, _is_token_id


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: EmbeddingInput
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(None, min_length=1)
    use_activation: bool | None = None
    softmax: bool | None = None  # vLLM's older names of use_activation
    activation: bool | None = None
    # Declared so that they are refused by name rather than ignored (see the module docstring).
    truncate_prompt_tokens: int | None = None
    messages: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

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

    @field_validator("messages")
    @classmethod
    def _no_chat(cls, value: list[Any] | None) -> list[Any] | None:
        if value:
            raise ValueError("chat-style classification requests are not supported (send `input`)")
        return value

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("not supported: ferrox's classification models read text only")
        return value

    def resolved_activation(self) -> bool | None:
        """softmax, else activation, else use_activation (vLLM's order)."""
        for value in (self.softmax, self.activation, self.use_activation):
            if value is not None:
                return value
        return None

    def inputs(self) -> list[str | list[int]]:
        """Each input: a text or one prompt's token ids."""
        value: Any = self.input
        if isinstance(value, str):
            return [value]
        if _is_token_id(value[0]):
            return [[int(t) for t in value]]
        return [x if isinstance(x, str) else [int(t) for t in x] for x in value]
