"""Errors raised while resolving, reading and rendering a model's files (re-exported for the loader).

All are `ferrox.FerroxError` subclasses defined in ferrox/errors.py, so a user can catch one root;
each message names the file, field or template that was wrong so the fix is obvious from it alone.
"""

from __future__ import annotations

from ferrox.errors import ChatTemplateError, ModelLoadError, ModelNotFoundError, UnsupportedModelError

__all__ = ["ModelLoadError", "ModelNotFoundError", "UnsupportedModelError", "ChatTemplateError"]
