"""Form fields of POST /v1/audio/transcriptions and /v1/audio/translations (multipart/form-data, vLLM's names and
defaults; OpenAI's API plus vLLM's extras).

Transcriptions take vLLM's TranscriptionRequest fields: file, model, language, prompt, response_format,
timestamp_granularities (sent as `timestamp_granularities[]`), stream with stream_include_usage and
stream_continuous_usage_stats (flat form fields, vLLM's stream options), vllm_xargs (a JSON object), to_language,
and the sampling fields temperature (default 0: greedy), top_p, top_k, min_p, seed, frequency_penalty,
repetition_penalty, presence_penalty and max_completion_tokens. Translations take vLLM's TranslationRequest
fields, a smaller set: file, model, prompt, response_format, seed, temperature, language, to_language, stream and
its two options, max_completion_tokens. A form value arrives as text and is read as the field's type ("true",
"0.2", "5"); any other form field is refused by name (read_form), as are values the served model cannot honour
(serving_transcription.py says which).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# What response_format may name (vLLM's AudioResponseFormat); serving_transcription.py honours json and text.
AudioResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
_LONG = 2**63  # seed: a 64-bit signed integer, as vLLM bounds it


class SpeechRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    file: bytes = Field(description="The audio file (flac, mp3, mp4, mpeg, mpga, m4a, ogg, wav or webm): a file part",
                        json_schema_extra={"format": "binary"})
    model: str | None = None
    language: str | None = Field(None, description="The spoken language, an ISO-639-1 code")
    prompt: str = ""
    response_format: AudioResponseFormat = "json"
    temperature: float = 0.0
    seed: int | None = Field(None, ge=-_LONG, lt=_LONG)
    to_language: str | None = None
    stream: bool = False
    stream_include_usage: bool = False
    stream_continuous_usage_stats: bool = False
    max_completion_tokens: int | None = None


class TranscriptionRequest(SpeechRequest):
    timestamp_granularities: list[Literal["word", "segment"]] = Field(default_factory=list)
    vllm_xargs: dict[str, str | int | float | bool] | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0

    @field_validator("vllm_xargs", mode="before")
    @classmethod
    def _xargs_json(cls, value: Any) -> Any:
        """A form carries vllm_xargs as JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"must be a JSON object: {e}") from None
        return value


class TranslationRequest(SpeechRequest):
    pass


# Form field names that carry a list, one value a part (OpenAI's clients send `name[]`), by the field they fill.
LIST_FIELDS = {"timestamp_granularities[]": "timestamp_granularities", "timestamp_granularities": "timestamp_granularities"}


def form_fields(model: type[SpeechRequest]) -> frozenset[str]:
    """The form field names a route takes (the file part's among them)."""
    names = set(model.model_fields)
    return frozenset(names | {name for name, field in LIST_FIELDS.items() if field in names})
