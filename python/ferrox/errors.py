"""ferrox's exception tree, in one place.

Every error ferrox raises on purpose is a `FerroxError`. Each carries `param`: the request or
configuration field at fault, spelled as users send it ("max_tokens", "stop", "prompt",
"messages", "request_id"), or None when no one field is. Callers (the HTTP server among them)
read `exc.param`; they never parse it out of the message.

    FerroxError                                   (ferrox._core)
    ├── InvalidArgumentError (ValueError)         a bad request field or configuration value (HTTP 400)
    │   ├── PromptTooLongError                    prompt >= max_model_len, or >= the whole KV cache
    │   └── DuplicateRequestError                 a live request already has this request_id
    ├── UnknownRequestError (KeyError)            an operation named a request the engine does not hold
    ├── TokenizerError                            tokenizer.json unreadable, token id outside it
    ├── RequestError (ValueError)                 the engine accepted a request, then failed it alone
    ├── EngineDeadError (RuntimeError)            the engine core is gone: nothing more can be served (503)
    ├── EngineStartupError (RuntimeError)         the engine core failed to start
    ├── ModelLoadError                            model files missing / broken
    │   ├── ModelNotFoundError (FileNotFoundError)
    │   └── UnsupportedModelError (ValueError)    readable, but not something ferrox can run
    └── ChatTemplateError (ValueError)            no template / it failed to render

The first six are defined by the Rust core (rust/py/errors.rs); the rest are Python classes
under the same root. The constructor is `Error(message, *, param=None)` throughout.
"""

from __future__ import annotations

from ferrox._core import (
    DuplicateRequestError,
    FerroxError,
    InvalidArgumentError,
    PromptTooLongError,
    TokenizerError,
    UnknownRequestError,
)

__all__ = [
    "ChatTemplateError",
    "DuplicateRequestError",
    "EngineDeadError",
    "EngineStartupError",
    "FerroxError",
    "InvalidArgumentError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "RequestError",
    "TokenizerError",
    "UnknownRequestError",
    "UnsupportedModelError",
]


class RequestError(FerroxError, ValueError):
    """The engine accepted one request and then failed it (a grammar that does not compile for this
    tokenizer, a sampling failure); the other requests go on. Bad input is refused before a request
    is queued, with an InvalidArgumentError, not with this."""


class EngineDeadError(FerroxError, RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class EngineStartupError(FerroxError, RuntimeError):
    """The engine core failed to start (bad model path, out of memory, ...)."""


class ModelLoadError(FerroxError):
    """A model folder or weight file is missing, unreadable, truncated or inconsistent."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path (or the embedded model's package) does not exist."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """Readable, but not something ferrox can run (architecture, quantization, tokenizer type)."""


class ChatTemplateError(FerroxError, ValueError):
    """A chat template is missing or failed to render."""
