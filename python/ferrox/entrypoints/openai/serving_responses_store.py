"""The routes that read the Responses API's store (responses_store.py), as OpenAI's client calls them:

    GET    /v1/responses/{id}              client.responses.retrieve(id): the object as last returned
    DELETE /v1/responses/{id}              client.responses.delete(id): {"id", "object": "response", "deleted": true}
    POST   /v1/responses/{id}/cancel       client.responses.cancel(id): a queued / in-progress background
                                           response, its engine request aborted; the object, "cancelled"
    GET    /v1/responses/{id}/input_items  client.responses.input_items.list(id): the items that produced it
                                           (earlier turns' inputs and outputs, then its own input), paged

While the store is off (no VLLM_ENABLE_RESPONSES_API_STORE) each answers 404 naming the variable; an id
the store does not hold is a 404 "Response with id '...' not found." as in vLLM. Query parameters
ferrox does not serve (a retrieve's `stream`, input_items' `before`...) are refused by name.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from ferrox.entrypoints.openai.errors import bad_request
from ferrox.entrypoints.openai.responses_store import RESPONSE_STORE, StoredResponse
from ferrox.entrypoints.openai.serving import json_response

MAX_PAGE = 100  # OpenAI's bounds for input_items' `limit` (default 20)
DEFAULT_PAGE = 20


def _entry(request: web.Request) -> StoredResponse:
    return request.app[RESPONSE_STORE].require(request.match_info["response_id"])


def _check_query(request: web.Request, served: tuple[str, ...]) -> None:
    """Refuse, by name, a query parameter this route does not serve (an empty `include` passes)."""
    for name, value in request.query.items():
        if name in served or (name in ("include", "include[]") and not value):
            continue
        raise bad_request(f"{name}: not supported on {request.method} {request.path} by ferrox", param=name,
                          code="unsupported_parameter")


async def retrieve_response(request: web.Request) -> web.Response:
    """A stored response as last returned (a background one as it stands: poll until it has finished)."""
    _check_query(request, ())
    return json_response(_entry(request).body)


async def delete_response(request: web.Request) -> web.Response:
    """Forget a stored response (one still generating in the background is cancelled first)."""
    entry = _entry(request)
    request.app[RESPONSE_STORE].pop(entry.id)
    entry.cancel_task()
    return json_response({"id": entry.id, "object": "response", "deleted": True})


async def cancel_response(request: web.Request) -> web.Response:
    """Cancel a queued or in-progress background response: its engine request is aborted (its KV blocks
    freed) and the object, now "cancelled", is returned."""
    entry = _entry(request)
    if not entry.body.get("background"):
        raise bad_request("Cannot cancel a synchronous response.", param="response_id")  # vLLM's wording
    if not entry.running:
        raise bad_request(f"response {entry.id!r} is already {entry.body['status']}: only a queued or "
                          "in-progress background response can be cancelled", param="response_id")
    task = entry.task
    if task is not None:
        task.cancel()
        await asyncio.wait([task])  # the generator is closed and the request aborted when this returns
    if entry.running:  # cancelled before it ever ran: nothing reached the engine
        entry.body = {**entry.body, "status": "cancelled"}
    return json_response(entry.body)


async def list_input_items(request: web.Request) -> web.Response:
    """The items that produced a response, OpenAI's list page: `order` asc or desc (default desc),
    `limit` 1-100 (default 20), `after` an item id of the previous page."""
    _check_query(request, ("order", "limit", "after"))
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc' (got {order!r})", param="order")
    limit = _limit(request.query.get("limit"))
    items = _entry(request).conversation()
    if order == "desc":
        items.reverse()
    after = request.query.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if position is None:
            raise bad_request(f"after: no input item with id {after!r} in this response", param="after")
        items = items[position + 1:]
    page = items[:limit]
    body: dict[str, Any] = {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
    return json_response(body)


def _limit(raw: str | None) -> int:
    if raw is None:
        return DEFAULT_PAGE
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise bad_request(f"limit: must be a whole number from 1 to {MAX_PAGE} (got {raw!r})", param="limit")
    return limit
