"""The aiohttp application: routes, auth, error shapes, body limit, and the serve loop.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (with GET and
DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel, GET /v1/responses/{id}/input_items),
POST /v1/audio/transcriptions and /v1/audio/translations (multipart forms; a model that takes audio),
POST /v1/messages (Anthropic), POST /v1/embeddings, POST /pooling, POST /score, POST /rerank and POST
/classify (a pooling model: the generation routes answer 400 then, as vLLM's do), POST /tokenize, POST /detokenize,
GET /health, GET|POST /ping, GET /version, GET /metrics, GET /openapi.json (built from this route
table), and the page for people at / (with GET /status, the JSON its live view reads).

Every error leaves as JSON in OpenAI's shape (Anthropic's on /v1/messages), whatever raised
it: our APIError, aiohttp's own HTTP errors (404 route, 405 method, 413 body), or a bug (500,
logged); a stream whose headers are out already (started early for --sse-keep-alive-interval's
comments) gets it as its last event instead. Handlers run with `handler_cancellation`, so a client that disconnects cancels its
handler, which closes its generator, which aborts the request in the engine core. Each request
leaves one access-log line (logger "ferrox.access") unless the server is built without it or its
path is one of ServerOptions.access_log_excluded_paths (--disable-access-log-for-endpoints).

ServerOptions holds what vLLM's serve flags set at this level: CORS (with preflight answers), a
root path behind a path-prefix proxy, request logging (logger "ferrox.requests"), and the defaults
the routes apply. Errors are logged with their request id: 4xx at debug, 5xx at error with the
traceback. `serve` takes a socket bound before the model loaded (`bind_socket`) and optional TLS.

Load and shutdown: a full engine (AsyncLLM.max_num_queued_reqs) answers 503 with Retry-After; a
request past AsyncLLM.request_timeout 504 (in-band on a stream); SIGTERM with a shutdown timeout
drains (`drain_middleware` refuses new API requests and counts the running ones; see `serve`).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import logging
import os
import signal
import socket
import ssl
import stat
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict

import ferrox
from ferrox.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestTimeoutError
from ferrox.engine.input_processor import prompt_size
from ferrox.engine.output_log import shorten
from ferrox.engine.profiler import profiler_dir
from ferrox.entrypoints import web as web_page
from ferrox.entrypoints.anthropic.protocol import MessagesCountRequest, MessagesRequest
from ferrox.entrypoints.anthropic.serving_messages import count_message_tokens, create_message
from ferrox.entrypoints.openai import serving_sleep
from ferrox.entrypoints.openai.errors import APIError
from ferrox.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from ferrox.entrypoints.openai.protocol_classify import ClassificationRequest
from ferrox.entrypoints.openai.protocol_embeddings import EmbeddingRequest, PoolingRequest
from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest
from ferrox.entrypoints.openai.protocol_score import RerankRequest, ScoreRequest
from ferrox.entrypoints.openai.protocol_transcription import TranscriptionRequest, TranslationRequest
from ferrox.entrypoints.openai.responses_store import install as install_response_store
from ferrox.entrypoints.openai.serving import (
    CTX,
    SSE_DONE,
    SSE_STARTED,
    ServerOptions,
    ServiceUnavailable,
    ServingContext,
    api_error,
    check_request_mm_kwargs,
    check_request_template,
    end_sse,
    json_response,
    parse_body,
    render_chat,
    sse_event,
)
from ferrox.entrypoints.openai.serving_chat import create_chat_completion
from ferrox.entrypoints.openai.serving_classify import create_classify
from ferrox.entrypoints.openai.serving_completion import create_completion
from ferrox.entrypoints.openai.serving_embeddings import (
    create_embedding,
    create_pooling,
    generation_only,
    is_classifier,
)
from ferrox.entrypoints.openai.serving_images import (
    expand_images,
    fetch_images,
    request_image_prompts,
    take_template_images,
)
from ferrox.entrypoints.openai.serving_lora import LoRARegistry, load_lora_adapter, unload_lora_adapter
from ferrox.entrypoints.openai.serving_responses import create_response
from ferrox.entrypoints.openai.serving_responses_store import (
    cancel_response,
    delete_response,
    list_input_items,
    retrieve_response,
)
from ferrox.entrypoints.openai.serving_score import create_rerank, create_score
from ferrox.entrypoints.openai.serving_tokenizer_info import get_tokenizer_info
from ferrox.entrypoints.openai.serving_transcription import (
    LOGGED_FORM,
    create_transcription,
    create_translation,
)
from ferrox.entrypoints.openai.tools import template_text
from ferrox.entrypoints.openapi import build_openapi
from ferrox.entrypoints.web.status import ThroughputMeter, server_status
from ferrox.gc_tuning import freeze_startup_heap
from ferrox.metrics.prometheus import CONTENT_TYPE, PrometheusStatLogger
from ferrox.metrics.tracing import extract_trace_headers, trace_headers_var

logger = logging.getLogger("ferrox.server")
access_logger = logging.getLogger("ferrox.access")
request_logger = logging.getLogger("ferrox.requests")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# Paths served without an API key (probes and scrapers carry no credentials).
# The page (/, /static/...) and its /status are open too: it asks for the key itself, for the API calls.
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/openapi.json", "/", "/status", "/load"})
# The routes whose requests run the model, which vLLM's --enable-server-load-tracking counts (GET /load).
LOAD_TRACKED_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/responses/{response_id}",
    "/v1/responses/{response_id}/cancel", "/v1/messages", "/v1/embeddings", "/pooling", "/classify", "/score",
    "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations", "/v1/audio/transcriptions",
    "/v1/audio/translations",
})
_OPEN_PREFIXES = ("/static/",)
# After the engine core dies, keep answering (503) this long before exiting, so load
# balancers and clients see a clear "unhealthy" rather than a refused connection.
DEAD_ENGINE_GRACE_S = 2.0

METRICS = web.AppKey("metrics", PrometheusStatLogger)
API_KEY = web.AppKey("api_key", str)
MAX_BODY = web.AppKey("max_body", int)
METER = web.AppKey("meter", ThroughputMeter)
OPENAPI = web.AppKey("openapi", dict)


OPTIONS = web.AppKey("options", ServerOptions)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _route_path(request: web.Request) -> str:
    """The path without the --root-path prefix (routes answer with and without it)."""
    root = request.app[OPTIONS].root_path
    path = request.path
    return path[len(root):] or "/" if root and (path == root or path.startswith(root + "/")) else path


def _is_anthropic(request: web.Request) -> bool:
    return _route_path(request).startswith("/v1/messages")


# Starlette's CORSMiddleware (vLLM's) answers a preflight for "*" methods with this list.
_ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _cors_origin(options: ServerOptions, origin: str, credentials: bool) -> str | None:
    """The Access-Control-Allow-Origin value for `origin`, or None when it is not allowed. With
    credentials a wildcard is not valid CORS: the origin itself is echoed."""
    if "*" in options.allowed_origins:
        return origin if credentials else "*"
    return origin if origin in options.allowed_origins else None


@web.middleware
async def cors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answers CORS preflights (OPTIONS with Access-Control-Request-Method) before routing, auth and
    the API key; other requests get their CORS headers in `_add_response_headers`."""
    origin = request.headers.get("Origin")
    wanted_method = request.headers.get("Access-Control-Request-Method")
    if request.method != "OPTIONS" or origin is None or wanted_method is None:
        return await handler(request)
    options = request.app[OPTIONS]
    allow_origin = _cors_origin(options, origin, options.allow_credentials)
    methods = _ALL_METHODS if "*" in options.allowed_methods else tuple(m.upper() for m in options.allowed_methods)
    wanted_headers = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",")
                      if h.strip()]
    allowed_headers = {h.lower() for h in options.allowed_headers}
    refused = [what for what, bad in (
        ("origin", allow_origin is None),
        ("method", wanted_method.upper() not in methods),
        ("headers", "*" not in allowed_headers and any(h.lower() not in allowed_headers for h in wanted_headers)),
    ) if bad]
    if refused:
        return web.Response(status=400, text=f"Disallowed CORS {', '.join(refused)}")
    headers = {
        "Access-Control-Allow-Origin": allow_origin or origin,
        "Access-Control-Allow-Methods": ", ".join(methods),
        "Access-Control-Allow-Headers": ", ".join(wanted_headers if "*" in allowed_headers else options.allowed_headers),
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }
    if options.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    return web.Response(status=200, text="OK", headers=headers)


@web.middleware
async def trace_context_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The request's W3C trace headers, for the span its generation makes (metrics/tracing.py): set in this
    request's task, where AsyncLLM.generate reads them."""
    headers = extract_trace_headers(request.headers)
    if not headers:
        return await handler(request)
    token = trace_headers_var.set(headers)
    try:
        return await handler(request)
    finally:
        trace_headers_var.reset(token)


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One line per request, after it ends (a stream: when it finishes). Outermost, so the status is
    the one the client got, errors included; the id is the response's X-Request-Id when it has one.
    A path in --disable-access-log-for-endpoints (the path as sent, or without --root-path) leaves none."""
    excluded = request.app[OPTIONS].access_log_excluded_paths
    if excluded and (request.path in excluded or _route_path(request) in excluded):
        return await handler(request)
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
    try:
        return await handler(request)
    except (web.HTTPRequestEntityTooLarge, web.HTTPNotFound, web.HTTPMethodNotAllowed, APIError, EngineDeadError,
            EngineOverloadedError, RequestTimeoutError) as exc:
        return await _in_stream_if_started(request, _api_error(request, exc), exc)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        # The client left while its response was being written (a normal disconnect: the request's
        # generator was closed, which aborted it in the engine). Re-raising would make aiohttp log an
        # ERROR with a traceback; 499 ("client closed request", nginx's code) goes to the access log
        # only, and writing it to the closed transport fails quietly.
        return web.Response(status=499)
    except Exception as exc:
        return await _in_stream_if_started(request, APIError(500, "internal server error"), exc)


async def _in_stream_if_started(request: web.Request, error: APIError, cause: Exception) -> web.StreamResponse:
    """The error response; or, for a stream whose headers went out before the error (started early to send
    --sse-keep-alive-interval's comments: serving.first_output), the error as the stream's last event, as a
    stream reports its later errors."""
    response = _error_response(request, error, cause)  # (logged here either way)
    stream = request.get(SSE_STARTED)
    if not isinstance(stream, web.StreamResponse) or not stream.prepared:
        return response
    if _is_anthropic(request):
        await end_sse(stream, [sse_event(error.anthropic_body(), "error")])
    else:
        await end_sse(stream, [sse_event(error.openai_body()), SSE_DONE])
    return stream


def _api_error(request: web.Request, exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (EngineOverloadedError, RequestTimeoutError)):  # 503 + Retry-After; 504
        return api_error(exc)
    if isinstance(exc, EngineDeadError):  # e.g. a prompt handed to the prompt threads during shutdown
        return APIError(503, f"engine is not running: {exc}")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return APIError(413, f"request body too large (limit {request.client_max_size} bytes)",
                        code="request_too_large")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return APIError(405, f"method {exc.method} not allowed on {request.path}")
    return APIError(404, f"no route for {request.method} {request.path}")


def _error_response(request: web.Request, error: APIError, cause: Exception) -> web.Response:
    """The error in the route's API shape, logged with its request id (given to the request here when
    its route had not named it, so the client's X-Request-Id header and the log line match): 4xx at
    debug (at info with the traceback under --log-error-stack), 5xx at error with the traceback of what
    raised it."""
    request_id = _request_id(request)
    if request_id is None:
        request_id = request["request_id"] = f"err-{uuid.uuid4().hex}"
    if error.status >= 500:
        logger.error("request %s: %s %s -> %d: %s", request_id, request.method, request.path, error.status,
                     error, exc_info=cause)
    elif request.app[OPTIONS].log_error_stack:  # vLLM's --log-error-stack: every error response's stack
        logger.info("request %s: %s %s -> %d: %s", request_id, request.method, request.path, error.status, error,
                    exc_info=cause)
    else:
        logger.debug("request %s: %s %s -> %d: %s", request_id, request.method, request.path, error.status, error)
    return error.response(_is_anthropic(request))


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    api_key = request.app[API_KEY]
    path = _route_path(request)
    if api_key and path not in _OPEN_PATHS and not path.startswith(_OPEN_PREFIXES):
        given = request.headers.get("x-api-key")
        auth = request.headers.get("Authorization", "")
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
    return await handler(request)


# A draining server asks clients to come back after this long (by then another replica has them).
DRAIN_RETRY_AFTER_S = 5


@web.middleware
async def drain_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts the API requests in their handlers (what a drain waits for) and, once draining,
    refuses new ones with 503 + Retry-After; probes and /metrics stay open (/health says draining)."""
    path = _route_path(request)
    if path in _OPEN_PATHS or path.startswith(_OPEN_PREFIXES) or request.method == "OPTIONS":
        return await handler(request)
    ctx = request.app[CTX]
    if ctx.draining:
        raise ServiceUnavailable("the server is shutting down and takes no new requests",
                                 code="server_shutting_down", retry_after=DRAIN_RETRY_AFTER_S)
    tracked = ctx.options.enable_server_load_tracking and path in LOAD_TRACKED_PATHS
    ctx.active_requests += 1
    ctx.server_load += tracked
    try:
        return await handler(request)
    finally:
        ctx.active_requests -= 1
        ctx.server_load -= tracked


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


async def _add_response_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Runs just before the headers go out, whatever the route's response type (streams included):
    X-Request-Id on every response that has one and that its route did not set itself; the CORS
    headers for a request from an allowed origin; the request log line (--enable-log-requests), here
    because the route has named the request by now."""
    request_id = _request_id(request)
    if request_id and "X-Request-Id" not in response.headers:
        response.headers["X-Request-Id"] = request_id
    options = request.app[OPTIONS]
    origin = request.headers.get("Origin")
    if origin is not None and "Access-Control-Allow-Origin" not in response.headers:
        allow_origin = _cors_origin(options, origin, options.allow_credentials or "cookie" in request.headers)
        if allow_origin is not None:
            response.headers["Access-Control-Allow-Origin"] = allow_origin
            if options.allow_credentials:
                response.headers["Access-Control-Allow-Credentials"] = "true"
            if allow_origin != "*":
                response.headers.add("Vary", "Origin")
    if options.enable_log_requests and request.method == "POST":
        await _log_request(request, response.headers.get("X-Request-Id") or request_id, options.max_log_len)


async def _log_request(request: web.Request, request_id: str | None, max_log_len: int | None) -> None:
    """One info line per API request: its id, route and parameters (the JSON body, or a speech route's form:
    its text fields and its file's name, type and size; strings longer than --max-log-len cut). The body was read
    by the route already (aiohttp keeps it)."""
    body: Any = request.get(LOGGED_FORM)
    if body is None:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = "<not JSON>"
    request_logger.info("request %s: %s %s %s", request_id or "-", request.method, request.path,
                        json.dumps(shorten(body, max_log_len), ensure_ascii=False))


# ---- small routes ----------------------------------------------------------------------------------


def _model_card(ctx: ServingContext, name: str | None = None) -> dict[str, Any]:
    return {
        "id": name or ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "ferrox",
        "root": ctx.engine.model_name, "parent": None, "max_model_len": ctx.max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    adapters = ctx.loras.model_cards(ctx.created, ctx.max_model_len)
    # One card per --served-model-name, as vLLM lists them.
    return json_response({"object": "list", "data": [*(_model_card(ctx, n) for n in ctx.model_names), *adapters]})


async def retrieve_model(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    name = request.match_info["model"]
    ctx.check_model(name)
    adapter = [card for card in ctx.loras.model_cards(ctx.created, ctx.max_model_len) if card["id"] == name]
    return json_response(adapter[0] if adapter else _model_card(ctx, name if name in ctx.model_names else None))


async def health(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    ctx.check_engine()
    if ctx.draining:  # not ready: load balancers stop sending, the running requests finish
        raise ServiceUnavailable("draining", code="server_shutting_down", retry_after=DRAIN_RETRY_AFTER_S)
    return web.Response(status=200)


async def ping(request: web.Request) -> web.Response:
    """Liveness, as vLLM answers it (200 while the engine runs, else 503): an alias of /health."""
    return await health(request)


class _InvocationBody(BaseModel):
    """Only what /invocations reads to pick the API; the API's own model validates the whole body."""

    model_config = ConfigDict(extra="allow")
    messages: Any = None
    prompt: Any = None
    input: Any = None


async def invocations(request: web.Request) -> web.StreamResponse:
    """SageMaker's inference route (beside /ping), as vLLM's: the body's shape picks the API -- `messages`
    chat completions, `prompt` completions, `input` embeddings (classify, when the model is a sequence
    classifier), `query` + `documents` rerank, `text_1` (or `data_1`, `queries`) score -- and that route
    answers it whole."""
    body = await parse_body(request, _InvocationBody)  # (aiohttp keeps the bytes: the route reads them again)
    ctx = request.app[CTX]
    if body.messages is not None:
        return await generation_only(create_chat_completion, "Chat Completions API")(ctx, request)
    if body.prompt is not None:
        return await generation_only(create_completion, "Completions API")(ctx, request)
    if body.input is not None:
        return await (create_classify if is_classifier(ctx) else create_embedding)(ctx, request)
    extra = body.model_extra or {}
    if "query" in extra and "documents" in extra:
        return await create_rerank(ctx, request)
    if any(key in extra for key in ("text_1", "data_1", "queries")):
        return await create_score(ctx, request)
    raise APIError(400, "/invocations: the body names no API: give `messages` (chat completions), `prompt` "
                   "(completions), `input` (embeddings), `query` + `documents` (rerank) or `text_1` / `data_1` / "
                   "`queries` (score)", param="messages")


async def version(request: web.Request) -> web.Response:
    return json_response({"version": ferrox.__version__})


# ---- operator routes, on as vLLM turns them on ------------------------------------------------------
async def start_profile(request: web.Request) -> web.Response:
    """POST /start_profile (registered when VLLM_TORCH_PROFILER_DIR is set): the engine cores' torch profiler."""
    await request.app[CTX].engine.start_profile()
    return web.Response(status=200)


async def stop_profile(request: web.Request) -> web.Response:
    """POST /stop_profile: stop it; each engine core writes its trace into VLLM_TORCH_PROFILER_DIR."""
    await request.app[CTX].engine.stop_profile()
    return web.Response(status=200)


async def load(request: web.Request) -> web.Response:
    """GET /load (vLLM's): {"server_load": requests now in the model routes}; counted only with
    --enable-server-load-tracking (0 otherwise, as vLLM)."""
    return web.json_response({"server_load": request.app[CTX].server_load})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """POST /reset_prefix_cache (registered when VLLM_SERVER_DEV_MODE=1, as vLLM's): empty the prefix cache
    (for benchmarks that must start cold); a 409 while requests hold cached blocks (nothing is reset then)."""
    if not await request.app[CTX].engine.reset_prefix_cache():
        raise APIError(409, "the prefix cache was not reset: requests still hold KV blocks (retry when idle)",
                       code="prefix_cache_in_use")
    return web.Response(status=200)


def _dev_mode() -> bool:
    return os.environ.get("VLLM_SERVER_DEV_MODE", "").strip().lower() in ("1", "true")


async def status(request: web.Request) -> web.Response:
    """What the page's live view shows: requests running and waiting, throughput, KV-cache usage."""
    return json_response(server_status(request.app[CTX], request.app[METER]))


# Route path -> the pydantic model of its JSON body, for /openapi.json.
_REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest, "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": MessagesCountRequest, "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest, "/v1/embeddings": EmbeddingRequest, "/pooling": PoolingRequest,
    "/score": ScoreRequest, "/v1/score": ScoreRequest, "/rerank": RerankRequest, "/v1/rerank": RerankRequest,
    "/v2/rerank": RerankRequest, "/classify": ClassificationRequest,
}
# Route path -> the pydantic model of its multipart form (its file part a binary string), for /openapi.json.
_FORM_MODELS: dict[str, type[BaseModel]] = {
    "/v1/audio/transcriptions": TranscriptionRequest, "/v1/audio/translations": TranslationRequest,
}


async def openapi(request: web.Request) -> web.Response:
    """This description of the API (OpenAPI 3.1), generated from the route table."""
    cache = request.app[OPENAPI]  # the routes are fixed once serving: build it once (pydantic's schemas are slow)
    if "spec" not in cache:
        spec = build_openapi(request.app.router, _REQUEST_MODELS, _OPEN_PATHS, api_key=bool(request.app[API_KEY]),
                             form_models=_FORM_MODELS)
        root = request.app[OPTIONS].root_path
        if root:  # each route once, under the prefix the clients use
            spec["paths"] = {p: v for p, v in spec["paths"].items() if not p.startswith(root + "/")}
            spec["servers"] = [{"url": root}]
        cache["spec"] = spec
    return json_response(cache["spec"])


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(), headers={"Content-Type": CONTENT_TYPE})


async def tokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    req = await parse_body(request, TokenizeRequest)
    ctx.check_model(req.model)
    check_request_mm_kwargs(ctx, mm_processor_kwargs=req.mm_processor_kwargs)
    # A chat's images count as the tokens the model gives them (vLLM's /tokenize): fetched first.
    images = await fetch_images(ctx, [m.to_template_dict() for m in req.messages]) if req.messages else []
    ids = await ctx.engine.prompt_work(prompt_size(req), _tokenize, ctx, req, images)  # long texts off the loop
    return json_response({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids})


def _tokenize(ctx: ServingContext, req: TokenizeRequest, images: list[Any]) -> list[int]:
    if req.messages is not None:
        check_request_template(ctx, req.chat_template)
        messages = [m.to_template_dict() for m in req.messages]
        if images:
            messages = take_template_images(ctx, messages, template_text(ctx, req.chat_template, None))
        text = render_chat(ctx, messages, add_generation_prompt=req.add_generation_prompt,
                           chat_template=req.chat_template, template_kwargs=req.chat_template_kwargs)
        ids = ctx.engine.tokenizer.encode(text, add_special_tokens=False)
        prompts = request_image_prompts(ctx, req.mm_processor_kwargs)  # (checked with or without images)
        return expand_images(ctx, ids, images, prompts)[0] if images else ids
    return ctx.engine.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)


async def detokenize(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    req = await parse_body(request, DetokenizeRequest)
    ctx.check_model(req.model)
    text = await ctx.engine.prompt_work(prompt_size(req), _detokenize, ctx, req)  # long lists off the event loop
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


def _bind_loras(fn: Callable[[LoRARegistry, web.Request], Awaitable[web.StreamResponse]]) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await fn(request.app[CTX].loras, request)

    handler.__name__, handler.__doc__ = fn.__name__, fn.__doc__
    return handler


def build_app(engine: AsyncLLM, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              access_log: bool = True, options: ServerOptions | None = None) -> web.Application:
    middlewares = [error_middleware, cors_middleware, drain_middleware, body_limit_middleware, auth_middleware,
                   trace_context_middleware]
    app = web.Application(
        middlewares=[access_log_middleware, *middlewares] if access_log else middlewares,
        client_max_size=max_request_body_bytes,
    )
    options = options or ServerOptions()
    app[OPTIONS] = options
    ctx = ServingContext(engine, served_model_name, options)
    app[CTX] = ctx
    app[API_KEY] = api_key or ""
    app[MAX_BODY] = max_request_body_bytes
    stat_logger = PrometheusStatLogger(ctx.model_name, prefix=options.metrics_prefix,
                                       mm_cache=getattr(engine.image_prompts, "processor_cache", None))
    stat_logger.on_scheduler_stats(engine.last_stats)
    engine.stat_loggers.append(stat_logger)
    app[METRICS] = stat_logger
    app[METER] = ThroughputMeter()
    app[OPENAPI] = {}
    app.on_response_prepare.append(_add_response_headers)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", _bind(generation_only(create_completion, "Completions API")))
    app.router.add_post("/v1/chat/completions", _bind(generation_only(create_chat_completion, "Chat Completions API")))
    app.router.add_post("/v1/responses", _bind(generation_only(create_response, "Responses API")))
    install_response_store(app)  # stored responses (on with VLLM_ENABLE_RESPONSES_API_STORE=1)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_post("/v1/messages", _bind(generation_only(create_message, "Messages API")))
    app.router.add_post("/v1/audio/transcriptions",
                        _bind(generation_only(create_transcription, "Transcriptions API")))
    app.router.add_post("/v1/audio/translations", _bind(generation_only(create_translation, "Translations API")))
    app.router.add_post("/v1/embeddings", _bind(create_embedding))
    app.router.add_post("/pooling", _bind(create_pooling))
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, _bind(create_score))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, _bind(create_rerank))
    app.router.add_post("/classify", _bind(create_classify))
    app.router.add_post("/v1/messages/count_tokens", _bind(count_message_tokens))
    app.router.add_post("/v1/load_lora_adapter", _bind_loras(load_lora_adapter))
    app.router.add_post("/v1/unload_lora_adapter", _bind_loras(unload_lora_adapter))
    app.router.add_post("/invocations", invocations)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", ping)
    app.router.add_post("/ping", ping)
    app.router.add_get("/version", version)
    if profiler_dir() is not None:  # as vLLM: the routes exist only with the variable set
        app.router.add_post("/start_profile", start_profile)
        app.router.add_post("/stop_profile", stop_profile)
    if _dev_mode():
        app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
        serving_sleep.add_routes(app.router)  # /sleep, /wake_up, /is_sleeping
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/status", status)
    app.router.add_get("/load", load)
    if options.enable_tokenizer_info_endpoint:
        app.router.add_get("/tokenizer_info", get_tokenizer_info)
    if not options.disable_fastapi_docs:
        app.router.add_get("/openapi.json", openapi)
    web_page.add_routes(app.router)
    if options.root_path:
        _add_prefixed_routes(app.router, options.root_path)
    return app


def _add_prefixed_routes(router: web.UrlDispatcher, root: str) -> None:
    """Every route also under `root` (vLLM's --root-path: a proxy that forwards /root/v1/... as is)."""
    for resource in list(router.resources()):
        if isinstance(resource, web.StaticResource):
            info = resource.get_info()
            router.add_static(root + info["prefix"], info["directory"], append_version=False)
            continue
        for route in resource:
            router.add_route(route.method, root + resource.canonical, route.handler)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening address, taken before the model loads so that a taken port fails at once.
    Bound only: connections are refused, not left waiting, until the server accepts them."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


def bind_unix_socket(path: str) -> socket.socket:
    """vLLM's --uds: listen on a Unix domain socket instead of host:port. A socket file left by a
    server that is gone is replaced; any other file at the path is an error, not deleted."""
    if os.path.exists(path):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(errno.EEXIST, f"cannot listen on {path}: the path exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens there: a stale socket file
        else:
            raise OSError(errno.EADDRINUSE, f"cannot listen on {path}: another server listens there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {path}: {exc.strerror}") from None
    return sock


def ssl_context(certfile: str, keyfile: str | None = None, ca_certs: str | None = None,
                cert_reqs: int = ssl.CERT_NONE, ciphers: str | None = None) -> ssl.SSLContext:
    """HTTPS with this certificate (vLLM's --ssl-certfile/--ssl-keyfile; --ssl-ca-certs and
    --ssl-cert-reqs to ask clients for certificates; --ssl-ciphers: the TLS 1.2-and-below cipher
    suites offered, an OpenSSL cipher list; TLS 1.3's suites are not chosen this way)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certfile, keyfile)
    if ca_certs:
        context.load_verify_locations(ca_certs)
    context.verify_mode = ssl.VerifyMode(cert_reqs)
    if ciphers:
        try:
            context.set_ciphers(ciphers)
        except ssl.SSLError:
            raise ValueError(f"--ssl-ciphers: no cipher suite matches {ciphers!r} (an OpenSSL cipher list, e.g. "
                             "'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305')") from None
    return context


async def serve(engine: AsyncLLM, *, host: str, port: int, served_model_name: str | list[str] | None = None,
                api_key: str | None = None, max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
                on_ready: Callable[[str], None] | None = None, access_log: bool = True,
                options: ServerOptions | None = None, sock: socket.socket | None = None,
                ssl_context: ssl.SSLContext | None = None, shutdown_timeout: float = 0.0) -> int:
    """Serve until a signal (exit code 0) or the engine core dies (exit code 1). sock: a socket
    bound beforehand (bind_socket), else host:port is bound now.

    SIGINT, or SIGTERM with shutdown_timeout 0 (vLLM's default), shuts down at once: running
    requests end with an error. SIGTERM with shutdown_timeout > 0 drains first (vLLM's
    --shutdown-timeout): new API requests get 503 and /health 503 "draining" while running ones
    may finish for up to that many seconds; those still running then end with an error saying
    so. A second signal during the drain stops waiting."""
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key,
                    max_request_body_bytes=max_request_body_bytes, access_log=access_log, options=options)
    ctx = app[CTX]
    for module in app[OPTIONS].lora_modules:  # before listening: a bad adapter stops the start
        try:
            await ctx.loras.load(module.name, module.path)
        except Exception as exc:  # noqa: BLE001 - reported, then the server exits non-zero
            logger.error("--lora-modules %s=%s: %s", module.name, module.path, getattr(exc, "message", exc))
            engine.shutdown("--lora-modules: an adapter could not be loaded")
            return 1
    head = app[OPTIONS]  # (a request head past these limits gets aiohttp's 400)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0,
                           max_line_size=head.h11_max_incomplete_event_size,
                           max_field_size=head.h11_max_incomplete_event_size, max_headers=head.h11_max_header_count)
    await runner.setup()
    site = web.SockSite(runner, sock or bind_socket(host, port), ssl_context=ssl_context)
    await site.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()  # shut down now
    drain = asyncio.Event()  # stop taking requests; let the running ones finish first
    exit_code = 0
    reason = "engine is shutting down"

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        ctx.draining = True
        if signum == signal.SIGTERM and shutdown_timeout > 0 and not drain.is_set():
            logger.info("received %s: draining (no new requests; %d running may finish within %gs; "
                        "a second signal stops at once)", name, ctx.active_requests, shutdown_timeout)
            drain.set()
            return
        logger.info("received %s, shutting down%s", name, " now" if drain.is_set() else "")
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
    addresses = runner.addresses  # (host, port, ...) per listening socket; port 0 resolved; a path (--uds)
    if addresses and isinstance(addresses[0], str):
        url = f"unix:{addresses[0]}{app[OPTIONS].root_path}"
    else:
        bound_port = addresses[0][1] if addresses else port
        url = f"{'https' if ssl_context else 'http'}://{host}:{bound_port}{app[OPTIONS].root_path}"
    freeze_startup_heap()
    if on_ready is not None:
        on_ready(url)
    try:
        stopped, drained = asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait())
        await asyncio.wait((stopped, drained), return_when=asyncio.FIRST_COMPLETED)
        drained.cancel()
        if drain.is_set() and not stop.is_set():
            deadline = loop.time() + shutdown_timeout
            while ctx.active_requests and not stop.is_set() and loop.time() < deadline:
                await asyncio.wait((stopped,), timeout=0.05)
            if ctx.active_requests:
                logger.warning("shutting down with %d requests still running (aborted)", ctx.active_requests)
                reason = ("the server is shutting down: the request did not finish within the shutdown timeout "
                          f"({shutdown_timeout:g} s) and was aborted" if not stop.is_set()
                          else "the server is shutting down (a second signal ended the drain) and aborted the request")
            else:
                logger.info("drained: no request left running")
        stopped.cancel()
    finally:
        # A further signal (or a supervisor repeating it) must not interrupt the shutdown half-way
        # and leave the core process behind: keep handling the signals until it is done.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, logger.info, "already shutting down")
        # Fail in-flight requests at once (their handlers send an error and finish), stop the
        # core process, then close the listener and connections.
        engine.shutdown(reason)
        await runner.cleanup()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return exit_code


def run_server_blocking(engine: AsyncLLM, **kwargs: Any) -> int:
    return asyncio.run(serve(engine, **kwargs))
