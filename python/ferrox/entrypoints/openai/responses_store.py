"""Stored responses of /v1/responses: what `store`, `previous_response_id` and `background` need.

As in vLLM, the store is on only when the server's environment has VLLM_ENABLE_RESPONSES_API_STORE=1
(or true); then a response is kept unless its request says `store: false` (OpenAI's default is to
store). Unlike vLLM's, which never forgets, it holds at most FERROX_RESPONSES_STORE_MAX_ENTRIES
responses (default 1000): past that the least recently used one is dropped, so a long-running server
cannot grow without bound (a dropped response that was still generating in the background is
cancelled: no one could fetch its result).

Each entry keeps the response object as last returned (a background one's is replaced as it runs),
the request's own input as items, and the entry it continued (`previous_response_id`). A chained
conversation is the walk back through those links, so a long chain costs memory once, not once per
turn; an entry keeps the turns before it alive after they are dropped from the index, as the chain
still needs them.

The store lives in the API server process and is touched only from its event loop, by plain methods
that never await: each call runs whole before another request's code does, so no lock is needed.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ferrox.entrypoints.openai.errors import APIError

ENABLE_VAR = "VLLM_ENABLE_RESPONSES_API_STORE"  # vLLM's name, so a vLLM deployment's settings carry over
MAX_ENTRIES_VAR = "FERROX_RESPONSES_STORE_MAX_ENTRIES"
DEFAULT_MAX_ENTRIES = 1000
HOW_TO_ENABLE = f"start the server with {ENABLE_VAR}=1 to keep responses"


@dataclass(slots=True, eq=False)
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it
    input_items: list[dict[str, Any]]  # this request's own input, as Responses items with ids
    previous: StoredResponse | None = None  # the response it continued
    task: asyncio.Task[None] | None = field(default=None, repr=False)  # a background response's generation

    @property
    def id(self) -> str:
        return str(self.body["id"])

    @property
    def running(self) -> bool:
        return self.body["status"] in ("queued", "in_progress")

    def conversation(self) -> list[dict[str, Any]]:
        """Every item that produced this response: each earlier turn's input and output, oldest first,
        then this request's input (instructions are not items: OpenAI carries no turn's over)."""
        chain: list[StoredResponse] = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.previous
        items: list[dict[str, Any]] = []
        for earlier in reversed(chain[1:]):
            items += earlier.input_items
            items += earlier.body["output"]
        return items + self.input_items

    def history(self) -> list[dict[str, Any]]:
        """What a request continuing this response starts from: its conversation and its output."""
        return self.conversation() + list(self.body["output"])

    def cancel_task(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the task closes its generator, which aborts the engine request


class ResponseStore:
    """Responses by id, least recently used first; `enabled` False stores nothing."""

    def __init__(self, enabled: bool, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"{MAX_ENTRIES_VAR} must be at least 1 (got {max_entries})")
        self.enabled = enabled
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @classmethod
    def from_env(cls) -> ResponseStore:
        enabled = os.environ.get(ENABLE_VAR, "").strip().lower() in ("1", "true")
        raw = os.environ.get(MAX_ENTRIES_VAR, "").strip()
        try:
            max_entries = int(raw) if raw else DEFAULT_MAX_ENTRIES
        except ValueError:
            raise ValueError(f"{MAX_ENTRIES_VAR}={raw!r} is not a whole number") from None
        return cls(enabled, max_entries)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.id] = entry
        self._entries.move_to_end(entry.id)
        while len(self._entries) > self.max_entries:
            _, dropped = self._entries.popitem(last=False)
            dropped.cancel_task()

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)  # read counts as use: a live chain stays
        return entry

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._entries.pop(response_id, None)

    def running_tasks(self) -> list[asyncio.Task[None]]:
        return [e.task for e in self._entries.values() if e.task is not None and not e.task.done()]

    # -- for the routes --

    def require(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, or the error the routes answer: 404 naming the variable while the store is off,
        404 "not found" (vLLM's wording) for an id it does not hold."""
        if not self.enabled:
            raise APIError(404, f"stored responses are off on this server; {HOW_TO_ENABLE}", param=param,
                           code="not_found")
        entry = self.get(response_id)
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", param=param, code="not_found")
        return entry


RESPONSE_STORE = web.AppKey("responses_store", ResponseStore)


def install(app: web.Application) -> ResponseStore:
    """Give `app` its store (from the environment) and cancel background responses at shutdown."""
    store = ResponseStore.from_env()
    app[RESPONSE_STORE] = store

    async def cancel_background(app: web.Application) -> None:
        tasks = store.running_tasks()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.on_cleanup.append(cancel_background)
    return store
