"""API errors and their two JSON shapes (OpenAI's everywhere, Anthropic's on /v1/messages).

Handlers raise `APIError(status, message, param=...)`; the server's middleware renders it in
the shape of the route. `from_validation_error` names the offending field in `param`, the
way OpenAI does, so a client sees which field to fix.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web
from pydantic import ValidationError

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    500: ("internal_error", "api_error"),
    503: ("service_unavailable", "overloaded_error"),
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
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _is_union_branch(part: Any) -> bool:
    # pydantic adds the tried union member ("str", "list[int]", "function-after[...]") to loc.
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict"))


def from_value_error(exc: Exception, default_param: str | None = None) -> APIError:
    """A ValueError from SamplingParams / the engine ("field: message") as a 400 naming the field."""
    message = str(exc)
    head, sep, _ = message.partition(":")
    param = head.strip() if sep and head.strip().isidentifier() else default_param
    return APIError(400, message, param=param, code="invalid_value")
