"""ferrox: an LLM inference and serving engine with a Rust core.

Public names: LLM, AsyncLLM, SamplingParams, StructuredOutputsParams, PoolingParams (with the
outputs of a pooling model, EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput and
ClassificationRequestOutput), and
the exception tree rooted at FerroxError (ferrox.errors: every error has `.param`, the request field at
fault).
Heavy modules (torch, the engine) load on first use so `import ferrox` stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ferrox.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineStartupError,
    FerroxError,
    InvalidArgumentError,
    PromptTooLongError,
    RequestError,
    TokenizerError,
    UnknownRequestError,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "PoolingParams",
    "EmbeddingRequestOutput",
    "PoolingRequestOutput",
    "ScoringRequestOutput",
    "ClassificationRequestOutput",
    "FerroxError",
    "InvalidArgumentError",
    "PromptTooLongError",
    "DuplicateRequestError",
    "UnknownRequestError",
    "TokenizerError",
    "RequestError",
    "EngineDeadError",
    "EngineStartupError",
    "__version__",
]

_LAZY = {
    "LLM": "ferrox.engine.llm",
    "AsyncLLM": "ferrox.engine.async_llm",
    "SamplingParams": "ferrox.sampling_params",
    "StructuredOutputsParams": "ferrox.structured.params",
    "PoolingParams": "ferrox.pooling.params",
    "EmbeddingRequestOutput": "ferrox.outputs",
    "PoolingRequestOutput": "ferrox.outputs",
    "ScoringRequestOutput": "ferrox.outputs",
    "ClassificationRequestOutput": "ferrox.outputs",
}

if TYPE_CHECKING:
    from ferrox.engine.async_llm import AsyncLLM
    from ferrox.engine.llm import LLM
    from ferrox.outputs import (
        ClassificationRequestOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        ScoringRequestOutput,
    )
    from ferrox.pooling.params import PoolingParams
    from ferrox.sampling_params import SamplingParams
    from ferrox.structured.params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ferrox' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
