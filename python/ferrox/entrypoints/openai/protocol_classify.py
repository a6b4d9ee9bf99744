"""Request body of POST /classify (vLLM's), served by a sequence-classification model.

`input` takes the embeddings API's shapes (a string, strings, token ids, token-id arrays; anything else is a
400 naming `input`). vLLM's other fields are honoured (add_special_tokens, priority, request_id, user;
use_activation and its older names softmax and activation: false gives the raw logits) or refused by name
(truncate_prompt_tokens: inputs are never cut; chat `messages`; mm_processor_kwargs).
"""

from __future__ import annotations

from typing import Any

from pydantic import field_validator

from ferrox.entrypoints.openai.protocol_embeddings import PoolingInputRequest


class ClassificationRequest(PoolingInputRequest):
    use_activation: bool | None = None
    softmax: bool | None = None  # vLLM's older names of use_activation
    activation: bool | None = None
    # Declared so that they are refused by name rather than ignored (see the module docstring).
    messages: list[Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

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
