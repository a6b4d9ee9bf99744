"""API errors and their two JSON shapes (OpenAI's everywhere, Anthropic's on /v1/messages).

Handlers raise `APIError(status, message, param=...)`; the server's middleware renders it in
the shape of the route. The offending field goes in `param`, the way OpenAI does, so a client sees
which field to fix: `from_validation_error` takes it from pydantic's error location,
`from_exception` from the engine's exceptions (`FerroxError.param`), never from the message text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web
from pydantic import ValidationError

from ferrox.errors import EngineDeadError, PromptTooLongError

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("internal_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
    504: ("timeout_error", "timeout_error"),  # --request-timeout
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        err_type = _TYPES.get(self.status, ("internal_error", "api_error"))[0]
        return {"error": {"message": self.message, "type": err_type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        err_type = _TYPES.get(self.status, ("internal_error", "api_error"))[1]
        return {"type": "error", "error": {"type": err_type, "message": self.message}}

    def response(self, anthropic: bool = False) -> web.Response:
        body = self.anthropic_body() if anthropic else self.openai_body()
        return web.Response(status=self.status, body=msgspec.json.encode(body), content_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error, as a 400 naming its field path (e.g. `messages.0.content`)."""
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err.get("loc", ()) if not _is_union_branch(p)]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    msg = msg.removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _is_union_branch(part: Any) -> bool:
    # pydantic adds the tried union member ("str", "list[int]", "function-after[...]") to loc.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def from_exception(
    exc: BaseException, *, default_param: str | None = None, rename: Mapping[str, str] | None = None
) -> APIError:
    """An exception from SamplingParams, the request rules (ferrox.engine.validation) or the engine,
    as an API error: 503 once the engine is dead, else 400 naming `exc.param` (an engine field name,
    spelled for this endpoint through `rename`: chat reports the prompt as "messages"), or
    `default_param` for an error that names no field. A prompt that does not fit is
    "context_length_exceeded", as OpenAI says."""
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"engine is not running: {exc}")
    param = getattr(exc, "param", None)
    if param is None:
        param = default_param
    elif rename:
        param = rename.get(param, param)
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else "invalid_value"
    return APIError(400, str(exc) or type(exc).__name__, param=param, code=code)
