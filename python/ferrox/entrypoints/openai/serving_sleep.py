"""vLLM's sleep-mode routes, registered (as vLLM's) only with VLLM_SERVER_DEV_MODE=1, since they
let any client take the model off the GPU:

- `POST /sleep?level=1` (level 0, 1, 2; `mode=abort|wait|keep` for the requests in flight; `tags=kv_cache`,
  repeatable, instead of a level): stop scheduling and give the GPU memory back.
- `POST /wake_up` (`tags=weights` / `tags=kv_cache` for one part): take it again.
- `GET /is_sleeping`: `{"is_sleeping": true|false}`.
- `POST /collective_rpc` `{"method": "reload_weights"}`: the checkpoint read again into the weights
  (after `/sleep?level=2` and `/wake_up?tags=weights`); other worker methods are a 400.

The rules and the memory are the engine's (ferrox/sleep_mode.py, worker/sleep_memory.py); a bad
argument or an engine started without --enable-sleep-mode is a 400 naming the parameter; a call the
engine's state refuses (reload_weights while the weights sleep) a 409.
Requests that arrive while the engine sleeps wait for the wake-up.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from ferrox.entrypoints.openai.errors import APIError, bad_request, from_exception
from ferrox.entrypoints.openai.serving import CTX
from ferrox.errors import EngineDeadError, InvalidArgumentError


async def _call(coro: Awaitable[Any]) -> Any:
    """A bad argument is a 400 naming it; a call the engine's state refuses (reload_weights while the
    weights sleep, a LoRA engine's reload) a 409 with the engine's words; a dead engine a 503."""
    try:
        return await coro
    except (InvalidArgumentError, EngineDeadError) as exc:
        raise from_exception(exc) from None
    except RuntimeError as exc:  # the engine core's answer to a utility call (engine/core_client.py)
        raise APIError(409, str(exc), code="sleep_mode_state") from None


def _tags(request: web.Request) -> list[str] | None:
    tags = [t for value in request.query.getall("tags", []) for t in value.split(",") if t]
    return tags or None


async def sleep(request: web.Request) -> web.Response:
    raw = request.query.get("level", "1")
    try:
        level = int(raw)
    except ValueError:
        raise bad_request(f"level: must be an integer, got {raw!r}", param="level") from None
    await _call(request.app[CTX].engine.sleep(level, request.query.get("mode", "abort"), _tags(request)))
    return web.Response(status=200)


async def wake_up(request: web.Request) -> web.Response:
    await _call(request.app[CTX].engine.wake_up(_tags(request)))
    return web.Response(status=200)


async def collective_rpc(request: web.Request) -> web.Response:
    """POST /collective_rpc {"method": "reload_weights", "timeout": ..., "args": [], "kwargs": {}} (vLLM's):
    {"results": [one per rank]}."""
    try:
        body = await request.json()
    except ValueError:
        raise bad_request("the body must be a JSON object with a `method`", param="method") from None
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        raise bad_request("method: a worker method's name is required", param="method")
    results = await _call(request.app[CTX].engine.collective_rpc(
        body["method"], body.get("timeout"), tuple(body.get("args") or ()), body.get("kwargs") or None))
    return web.json_response({"results": results})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": await request.app[CTX].engine.is_sleeping()})


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_post("/sleep", sleep)
    router.add_post("/wake_up", wake_up)
    router.add_get("/is_sleeping", is_sleeping)
    router.add_post("/collective_rpc", collective_rpc)
