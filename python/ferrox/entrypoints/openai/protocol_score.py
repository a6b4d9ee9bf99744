"""Request bodies of POST /score (also /v1/score) and POST /rerank (also /v1/rerank, /v2/rerank): vLLM's.

/score takes its two sides under any one of vLLM's spellings: text_1/text_2, data_1/data_2, queries/documents
or queries/items; each side a string or an array of strings. Two spellings in one body, or half of one, is
a 400 naming the field. /rerank takes `query` (a string) and `documents` (a string or an array of them) and
`top_n` (<= 0, the default, keeps every document, as vLLM does).

vLLM's other fields are honoured or refused by name: use_activation (and its older names softmax and
activation) normalises the vectors or not, which leaves a cosine as it is (a cross-encoder: its activation,
or the raw logit when false); padding "do_not_pad" is what
is done, "max_length" is refused; cache_salt is accepted (a pooling model keeps no prefix cache to
share); truncate_prompt_tokens and truncation_side are refused (inputs are never truncated, as on
/v1/embeddings); multimodal inputs ({"content": [...]}) and a non-empty mm_processor_kwargs are refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ferrox.errors import InvalidArgumentError

ScoreInputs = str | list[str]

# vLLM's names for the two sides of a /score request, in the order its request union tries them.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_SIDE_FIELDS = ("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items")


def _check_texts(value: Any) -> ScoreInputs:
    if isinstance(value, dict) and "content" in value or isinstance(value, list) and any(
            isinstance(v, dict) for v in value):
        raise ValueError("multimodal score inputs ({\"content\": [...]}) are not supported; give texts")
    if isinstance(value, list):
        bad = next((v for v in value if not isinstance(v, str)), None)
        if bad is not None:
            raise ValueError(f"must be a string or an array of strings, got {bad!r} in the array")
        return value
    if not isinstance(value, str):
        raise ValueError(f"must be a string or an array of strings, got {type(value).__name__}")
    return value


def as_list(value: ScoreInputs) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


class BaseScoringRequest(BaseModel):
    """The fields /score and /rerank share (vLLM's pooling request fields)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    request_id: str | None = Field(None, min_length=1)
    use_activation: bool | None = None
    softmax: bool | None = None  # vLLM's older names of use_activation
    activation: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    padding: Literal["max_length", "do_not_pad"] | None = None
    # Declared so that they are refused by name rather than ignored (see the module docstring).
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @field_validator("truncate_prompt_tokens", "truncation_side")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("inputs are never truncated (a longer input than the model takes is refused); shorten "
                             "the input instead")
        return value

    @field_validator("padding")
    @classmethod
    def _no_padding(cls, value: str | None) -> str | None:
        if value == "max_length":
            raise ValueError("'max_length' is not supported: inputs are embedded as they are ('do_not_pad')")
        return value

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _text_only(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value:
            raise ValueError("not supported: ferrox's pooling models read text only")
        return value

    def normalize(self) -> bool | None:
        """use_activation as vLLM resolves it: softmax, else activation, else use_activation. An embedding
        model's normalisation; a cross-encoder's activation."""
        for value in (self.softmax, self.activation, self.use_activation):
            if value is not None:
                return value
        return None


class ScoreRequest(BaseScoringRequest):
    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None

    @field_validator(*_SIDE_FIELDS, mode="before")
    @classmethod
    def _texts(cls, value: Any) -> ScoreInputs | None:
        return None if value is None else _check_texts(value)

    def sides(self) -> tuple[tuple[str, list[str]], tuple[str, list[str]]]:
        """((name, texts), (name, texts)) of the one spelling the body used; InvalidArgumentError naming the
        field otherwise."""
        given = [name for name in _SIDE_FIELDS if getattr(self, name) is not None]
        for first, second in SCORE_SIDES:
            if first in given and second in given:
                extra = [name for name in given if name not in (first, second)]
                if extra:
                    raise InvalidArgumentError(
                        f"{extra[0]}: give one pair of inputs ({_spellings()}); this request also has {first} and "
                        f"{second}", param=extra[0])
                return (first, as_list(getattr(self, first))), (second, as_list(getattr(self, second)))
        if not given:
            raise InvalidArgumentError(f"text_1: the texts to score are required ({_spellings()})", param="text_1")
        name = given[0]
        partner = next(b if a == name else a for a, b in SCORE_SIDES if name in (a, b))
        also = " (or items)" if name == "queries" else ""
        raise InvalidArgumentError(f"{partner}: required with {name}{also} ({_spellings()})", param=partner)


def _spellings() -> str:
    return ", ".join(f"{a}/{b}" for a, b in reversed(SCORE_SIDES))


class RerankRequest(BaseScoringRequest):
    query: str
    documents: ScoreInputs
    top_n: int = 0

    @field_validator("query", mode="before")
    @classmethod
    def _query(cls, value: Any) -> str:
        if isinstance(value, dict) and "content" in value:
            raise ValueError("multimodal score inputs ({\"content\": [...]}) are not supported; give a text")
        if not isinstance(value, str):
            raise ValueError(f"must be a string, got {type(value).__name__}")
        return value

    @field_validator("documents", mode="before")
    @classmethod
    def _documents(cls, value: Any) -> ScoreInputs:
        return _check_texts(value)
