"""What `LLM.generate` / `AsyncLLM.generate` hand back (vLLM-compatible shapes and names), and for a
pooling model what `LLM.embed` / `LLM.encode` / `AsyncLLM.encode` / `LLM.score` / `LLM.classify` do
(EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput, ClassificationRequestOutput).

Logprobs follow vLLM: one dict per position, token id -> `Logprob`, holding the chosen token and
the top-N alternatives. Prompt logprobs start with None (the first prompt token has no context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the model's distribution
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that fired

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    extra: dict[str, object] = field(default_factory=dict)


# ---- pooling models (LLM.embed / LLM.encode / AsyncLLM.encode), vLLM's shapes -----------------------


@dataclass(slots=True)
class PoolingOutput:
    """A pooled vector. vLLM holds a torch tensor here; ferrox a float32 numpy array (`torch.from_numpy`
    wraps it without a copy), so the front-end stays free of torch."""

    data: npt.NDArray[np.float32]


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine failed this request (then `outputs.data` is empty)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(request_output.request_id,
                                      EmbeddingOutput(request_output.outputs.data.tolist()),
                                      request_output.prompt_token_ids, request_output.finished)


@dataclass(slots=True)
class ScoringOutput:
    # An embedding model's: the cosine similarity of the pair's two vectors; a cross-encoder's: the pair's
    # score (its one logit through the model's activation).
    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """One scored pair (LLM.score). As vLLM's for an embedding model: the id joins the two texts' request
    ids with "_"; prompt_token_ids are the first text's, the pad token (when the tokenizer has one), then
    the second text's. For a cross-encoder: the pair's own request id and its pair encoding's tokens."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool


@dataclass(slots=True)
class ClassificationOutput:
    """A sequence classifier's class scores of one text (vLLM's): softmax probabilities over several
    labels, a sigmoid for one (pooling/classify.py), in config.json id2label order."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput:
    """One classified prompt (LLM.classify)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool

    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(request_output.request_id,
                                           ClassificationOutput(request_output.outputs.data.tolist()),
                                           request_output.prompt_token_ids, request_output.finished)


# What the output processor yields for one request: a generation's or a pooling model's.
AnyRequestOutput = RequestOutput | PoolingRequestOutput
