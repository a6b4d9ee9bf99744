"""Errors raised while resolving, reading and rendering a model's files.

All are `ferrox.FerroxError` subclasses so a user can catch one root; each message names
the file, field or template that was wrong so the fix is obvious from the message alone.
"""

from __future__ import annotations

from ferrox._core import FerroxError


class ModelLoadError(FerroxError):
    """A model folder or weight file is missing, unreadable, truncated or inconsistent."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model path (or the embedded model's package) does not exist."""


class UnsupportedModelError(ModelLoadError, ValueError):
    """Readable, but not something ferrox can run (architecture, quantization, tokenizer type)."""


class ChatTemplateError(FerroxError, ValueError):
    """A chat template is missing or failed to render."""
