"""The aiohttp application: routes, auth, error shapes, body limit, and the serve loop.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
POST /v1/messages (Anthropic), POST /tokenize, POST /detokenize, GET /health, GET|POST /ping,
GET /version, GET /metrics, GET /openapi.json (built from this route table), and the page for
people at / (with GET /status, the JSON its live view reads).

Every error leaves as JSON in OpenAI's shape (Anthropic's on /v1/messages), whatever raised
it: our APIError, aiohttp's own HTTP errors (404 route, 405 method, 413 body), or a bug (500,
logged). Handlers run with `handler_cancellation`, so a client that disconnects cancels its
handler, which closes its generator, which aborts the request in the engine core. Each request
leaves one access-log line (logger "ferrox.access") unless the server is built without it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel

import ferrox
from ferrox.engine.async_llm import AsyncLLM, EngineDeadError
from ferrox.entrypoints import web as web_page
from ferrox.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from ferrox.entrypoints.anthropic.serving_messages import count_message_tokens, create_message
from ferrox.entrypoints.openai.errors import APIError
from ferrox.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest
from ferrox.entrypoints.openai.serving import ServingContext, json_response, parse_body, render_chat
from ferrox.entrypoints.openai.serving_chat import create_chat_completion
from ferrox.entrypoints.openai.serving_completion import create_completion
from ferrox.entrypoints.openai.serving_responses import create_response
from ferrox.entrypoints.openapi import build_openapi
from ferrox.entrypoints.web.status import ThroughputMeter, server_status
from ferrox.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger

logger = logging.getLogger("ferrox.server")
access_logger = logging.getLogger("ferrox.access")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# Paths served without an API key (probes and scrapers carry no credentials).
# The page (/, /static/...) and its /status are open too: it asks for the key itself, for the API calls.
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/openapi.json", "/", "/status"})
_OPEN_PREFIXES = ("/static/",)
# After the engine core dies, keep answering (503) this long before exiting, so load
# balancers and clients see a clear "unhealthy" rather than a refused connection.
DEAD_ENGINE_GRACE_S = 2.0

CTX = web.AppKey("ctx", ServingContext)
METRICS = web.AppKey("metrics", PrometheusStatLogger)
API_KEY = web.AppKey("api_key", str)
MAX_BODY = web.AppKey("max_body", int)
METER = web.AppKey("meter", ThroughputMeter)
OPENAPI = web.AppKey("openapi", dict)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request, after it ends (a stream: when it finishes). Outermost, so the status is
    the one the client got, errors included; the id is the response's X-Request-Id when it has one."""
    started = time.perf_counter()
    status: int | str = "-"
    request_id: str | None = None
    try:
        response = await handler(request)
        # A plain Response gets its X-Request-Id on prepare, after this: work it out the same way.
        status = response.status
        request_id = response.headers.get("X-Request-Id") or _request_id(request)
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = "disconnected"  # the client went away before the answer was complete
        raise
    finally:
        access_logger.info('%s "%s %s" %s %.1fms%s', request.remote, request.method, request.path_qs, status,
                           (time.perf_counter() - started) * 1000, f" request_id={request_id}" if request_id else "")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    anthropic = _is_anthropic(request)
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response(anthropic)
    except EngineDeadError as exc:  # e.g. a prompt handed to the prompt threads during shutdown
        return APIError(503, f"engine is not running: {exc}").response(anthropic)
    except web.HTTPRequestEntityTooLarge:
        return APIError(413, f"request body too large (limit {request.client_max_size} bytes)",
                        code="request_too_large").response(anthropic)
    except web.HTTPNotFound:
        return APIError(404, f"no route for {request.method} {request.path}").response(anthropic)
    except web.HTTPMethodNotAllowed as exc:
        return APIError(405, f"method {exc.method} not allowed on {request.path}").response(anthropic)
    except web.HTTPException:
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("internal error on %s %s", request.method, request.path)
        return APIError(500, "internal server error").response(anthropic)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    api_key = request.app[API_KEY]
    if api_key and request.path not in _OPEN_PATHS and not request.path.startswith(_OPEN_PREFIXES):
        given = request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(request)


@web.middleware
async def body_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Refuse early on a declared oversize body; a chunked one is caught by client_max_size.
    limit = request.app[MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        raise APIError(413, f"request body too large ({request.content_length} bytes; limit {limit})",
                       code="request_too_large")
    return await handler(request)


def _request_id(request: web.Request) -> str | None:
    # The client's own X-Request-Id comes back unchanged (as vLLM does); else the id a route gave
    # its request (request["request_id"]: the response's or message's id).
    return request.headers.get("X-Request-Id") or request.get("request_id")


async def _add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """X-Request-Id on every response that has one and that its route did not set itself, streams
    included: this runs just before the headers go out, whatever the route's response type."""
    request_id = _request_id(request)
    if request_id and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = request_id


# ---- small routes ----------------------------------------------------------------------------------


def _model_card(ctx: ServingContext) -> dict[str, Any]:
    return {
        "id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "ferrox",
        "root": ctx.engine.model_name, "parent": None, "max_model_len": ctx.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [_model_card(request.app[CTX])]})


async def retrieve_model(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    ctx.check_model(request.match_info["model"])
    return json_response(_model_card(ctx))


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    ctx.check_engine()
    return web.Response(status=200)


async def ping(request: web.Request) -> web.Response:
    """Liveness, as vLLM answers it (200 while the engine runs, else 503): an alias of /health."""
    return await health(request)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": ferrox.__version__})


async def status(request: web.Request) -> web.Response:
    """What the page's live view shows: requests running and waiting, throughput, KV-cache usage."""
    return json_response(server_status(request.app[CTX], request.app[METER]))


# Route path -> the pydantic model of its JSON body, for /openapi.json.
_REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": MessagesCountRequest, "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


async def openapi(request: web.Request) -> web.Response:
    """This description of the API (OpenAPI 3.1), generated from the route table."""
    cache = request.app[OPENAPI]  # the routes are fixed once serving: build it once (pydantic's schemas are slow)
    if "spec" not in cache:
        cache["spec"] = build_openapi(request.app.router, _REQUEST_MODELS, _OPEN_PATHS,
                                      api_key=bool(request.app[API_KEY]))
    return json_response(cache["spec"])


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    req = await parse_body(request, TokenizeRequest)
    ctx.check_model(req.model)
    ids = await ctx.engine.run_in_prompt_pool(_tokenize, ctx, req)  # long texts: off the event loop
    return json_response({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids})


def _tokenize(ctx: ServingContext, req: TokenizeRequest) -> list[int]:
    if req.messages is not None:
        text = render_chat(ctx, [m.to_template_dict() for m in req.messages],
                           add_generation_prompt=req.add_generation_prompt,
                           template_kwargs=req.chat_template_kwargs)
        return ctx.engine.tokenizer.encode(text, add_special_tokens=False)
    return ctx.engine.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    req = await parse_body(request, DetokenizeRequest)
    ctx.check_model(req.model)
    text = await ctx.engine.run_in_prompt_pool(_detokenize, ctx, req)  # long lists: off the event loop
    return json_response({"prompt": text})


def _detokenize(ctx: ServingContext, req: DetokenizeRequest) -> str:
    vocab = getattr(ctx.engine.tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in req.tokens):
        raise APIError(400, f"tokens: token id outside the vocabulary (size {vocab})", param="tokens")
    return ctx.engine.tokenizer.decode(req.tokens, skip_special_tokens=False)


def _bind(fn: Callable[[ServingContext, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[CTX], request)

    handler.__name__ = fn.__name__
    return handler


def build_app(engine: AsyncLLM, *, served_model_name: str | None = None, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              access_log: bool = True) -> web.Application:
    middlewares = [error_middleware, body_limit_middleware, auth_middleware]
    app = web.Application(
        middlewares=[access_log_middleware, *middlewares] if access_log else middlewares,
        client_max_size=max_request_body_bytes,
    )
    ctx = ServingContext(engine, served_model_name)
    app[CTX] = ctx
    app[API_KEY] = api_key or ""
    app[MAX_BODY] = max_request_body_bytes
    stat_logger = PrometheusStatLogger(ctx.model_name)
    stat_logger.on_scheduler_stats(engine.last_stats)
    engine.stat_loggers.append(stat_logger)
    app[METRICS] = stat_logger
    app[METER] = ThroughputMeter()
    app[OPENAPI] = {}
    app.on_response_prepare.append(_add_request_id_header)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", _bind(create_completion))
    app.router.add_post("/v1/chat/completions", _bind(create_chat_completion))
    app.router.add_post("/v1/responses", _bind(create_response))
    app.router.add_post("/v1/messages", _bind(create_message))
    app.router.add_post("/v1/messages/count_tokens", _bind(count_message_tokens))
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_get("/openapi.json", openapi)
    web_page.add_routes(app.router)
    return app


async def serve(engine: AsyncLLM, *, host: str, port: int, served_model_name: str | None = None,
                api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                on_ready: Callable[[str], None] | None = None, access_log: bool = True) -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or the engine core dies (exit code 1)."""
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key,
                    max_request_body_bytes=max_request_body_bytes, access_log=access_log)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    exit_code = 0

    def on_signal(signum: int) -> None:
        logger.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    def on_engine_dead(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        logger.error("engine core died (%s); exiting in %.1f s", reason, DEAD_ENGINE_GRACE_S)
        loop.call_later(DEAD_ENGINE_GRACE_S, stop.set)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    engine.dead_callbacks.append(on_engine_dead)
    engine.client.ensure_reader()  # watch the core from now on, not only once a request comes
    addresses = runner.addresses  # (host, port, ...) per listening socket; port 0 resolved
    bound_port = addresses[0][1] if addresses else port
    url = f"http://{host}:{bound_port}"
    if on_ready is not None:
        on_ready(url)
    try:
        await stop.wait()
    finally:
        # A second Ctrl-C (or a supervisor repeating the signal) must not interrupt the shutdown
        # half-way and leave the core process behind: keep handling the signals until it is done.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, logger.info, "already shutting down")
        # Fail in-flight requests at once (their handlers send an error and finish), stop the
        # core process, then close the listener and connections.
        engine.shutdown()
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return exit_code


def run_server_blocking(engine: AsyncLLM, **kwargs: Any) -> int:
    return asyncio.run(serve(engine, **kwargs))
