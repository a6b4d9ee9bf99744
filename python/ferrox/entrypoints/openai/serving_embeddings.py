"""POST /v1/embeddings (OpenAI's shape) and POST /pooling (vLLM's), served by a pooling model.

Every input of a request becomes one engine request (AsyncLLM.encode), all queued together, so they
are batched with each other and with other clients' requests under the engine's token budget. Every
input passes the pooling rules before any is queued: a request is answered whole or refused whole.

    {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": [...] | "<base64>"}],
     "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

base64 is the vector's float32 bytes, little-endian unless `endianness` says otherwise (what the openai
client decodes: it asks for base64 by default). A generation model answers these routes, and a pooling
model the generation routes (`generation_only`), with vLLM's 400 "The model does not support ... API".
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints.openai.errors import APIError
from ferrox.entrypoints.openai.protocol_embeddings import EmbeddingRequest, PoolingRequest
from ferrox.entrypoints.openai.serving import (
    STREAM_ERRORS,
    ServingContext,
    api_error,
    check_priority,
    json_response,
    parse_body,
    request_ids,
)
from ferrox.errors import FerroxError
from ferrox.outputs import PoolingRequestOutput
from ferrox.pooling.params import PoolingParams, validate_pooling_request

Route = Callable[[ServingContext, web.Request], Awaitable[web.StreamResponse]]

# The engine's names of the prompt; an error naming one names the field the route's inputs came in ("input").
PROMPT_FIELDS = ("prompt", "prompt_token_ids")


def not_supported(api: str, why: str = "") -> APIError:
    """vLLM's answer when the served model cannot serve a route's API (why: what to use instead)."""
    return APIError(400, f"The model does not support {api}{': ' + why if why else ''}", code="model_not_supported")


def is_classifier(ctx: ServingContext) -> bool:
    """The served model is a sequence classifier (a cross-encoder), not an embedding model."""
    pooler = ctx.engine.pooler_config
    return pooler is not None and pooler.task == "classify"


CLASSIFIER_HINT = ("it is a sequence-classification model (a cross-encoder), which classifies texts and scores "
                   "pairs; use /classify, /score or /rerank")


def generation_only(route: Route, api: str) -> Route:
    """A generation route (completions, chat, ...) that a pooling model refuses by name."""

    async def handler(ctx: ServingContext, request: web.Request) -> web.StreamResponse:
        if ctx.engine.runner == "pooling":
            raise not_supported(api)
        return await route(ctx, request)

    handler.__name__ = getattr(route, "__name__", "handler")
    return handler


async def create_embedding(ctx: ServingContext, request: web.Request) -> web.Response:
    if ctx.engine.runner != "pooling":
        raise not_supported("Embeddings API")
    if is_classifier(ctx):
        raise not_supported("Embeddings API", CLASSIFIER_HINT)
    req = await parse_body(request, EmbeddingRequest)
    return await _serve(ctx, request, req, prefix="embd", item="embedding", key="embedding")


async def create_pooling(ctx: ServingContext, request: web.Request) -> web.Response:
    if ctx.engine.runner != "pooling":
        raise not_supported("Pooling API")
    req = await parse_body(request, PoolingRequest)
    return await _serve(ctx, request, req, prefix="pool", item="pooling", key="data")


async def _serve(ctx: ServingContext, request: web.Request, req: EmbeddingRequest, *, prefix: str, item: str,
                 key: str) -> web.Response:
    ctx.check_model(req.model)
    ctx.check_engine()
    check_priority(ctx, req.priority)
    try:
        # /pooling's task; None: the model's own output (a classifier's class scores, an embedder's vector).
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, task=getattr(req, "task", None))
    except FerroxError as exc:
        raise api_error(exc) from None
    # Encoding many or long texts takes a while: off the event loop (a few short ones inline).
    inputs = req.inputs()
    prompts = await ctx.engine.prompt_work(prompt_size(inputs), tokenize_inputs, ctx, inputs, req.add_special_tokens)
    validate_inputs(ctx, prompts, params)
    request_id, header_id = request_ids(request, req, prefix)
    outputs = await encode_all(ctx, prompts, params, request_id, req.priority)
    data = [{"index": i, "object": item, key: _encode_vector(out.outputs.data, req)}
            for i, out in enumerate(outputs)]
    return list_response(ctx, request_id, header_id, data, sum(len(ids) for ids in prompts))


def list_response(ctx: ServingContext, request_id: str, header_id: str, data: list[dict[str, Any]],
                  num_tokens: int, **usage: Any) -> web.Response:
    """A pooling route's answer: vLLM's list object with the prompt tokens as usage (`usage`: a route's
    extra usage fields)."""
    return json_response({
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, **usage},
    }, headers={"X-Request-Id": header_id})


def tokenize_inputs(ctx: ServingContext, inputs: Sequence[str | list[int]],
                    add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of every input, a text or its token ids (blocking: runs in the engine's prompt threads).
    Texts are encoded in one batch with the model's special tokens (add_special_tokens), as transformers
    encodes them."""
    texts = [(i, x) for i, x in enumerate(inputs) if isinstance(x, str)]
    prompts: list[list[int]] = [x if isinstance(x, list) else [] for x in inputs]
    if texts:
        encoded = ctx.engine.tokenizer.encode_batch([t for _, t in texts], add_special_tokens=add_special_tokens)
        for (i, _), ids in zip(texts, encoded, strict=True):
            prompts[i] = ids
    return prompts


def validate_inputs(ctx: ServingContext, prompts: list[list[int]], params: PoolingParams | Sequence[PoolingParams],
                    labels: Sequence[tuple[str, str | None]] | None = None) -> None:
    """The pooling rules on every input before any is queued: a 400 naming `input` (too long: OpenAI's
    context_length_exceeded) or `dimensions`. params: one for every input, or one each. labels: each
    input's (field, name in messages), for routes whose inputs come in other fields."""
    engine = ctx.engine
    assert engine.pooler_config is not None
    for i, ids in enumerate(prompts):
        param, what = labels[i] if labels is not None else ("input", f"input {i}" if len(prompts) > 1 else None)
        try:
            validate_pooling_request(ids, params if isinstance(params, PoolingParams) else params[i],
                                     engine.pooler_config, max_model_len=engine.max_model_len,
                                     vocab_size=engine.limits.vocab_size, what=what, prompt_param=param,
                                     model_name=f"model {ctx.model_name!r}")
        except FerroxError as exc:
            raise api_error(exc) from None


async def encode_all(ctx: ServingContext, prompts: list[list[int]], params: PoolingParams | Sequence[PoolingParams],
                     request_id: str, priority: int, *, param: str = "input") -> list[PoolingRequestOutput]:
    """Every input through the engine at once (params: one for every input, or one each); if one fails (or
    the client leaves), the others are cancelled, which aborts them in the engine. An engine error names
    `param`, the field of the inputs."""
    single = len(prompts) == 1

    async def one(i: int, ids: list[int]) -> PoolingRequestOutput:
        final: PoolingRequestOutput | None = None
        outputs = ctx.engine.encode({"prompt_token_ids": ids}, params if isinstance(params, PoolingParams)
                                    else params[i], request_id if single else f"{request_id}-{i}", priority=priority)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                final = out
        if final is None:
            raise APIError(500, f"input {i}: the engine ended the request without a vector")
        return final

    tasks = [asyncio.ensure_future(one(i, ids)) for i, ids in enumerate(prompts)]
    try:
        return list(await asyncio.gather(*tasks))
    except STREAM_ERRORS as exc:
        raise api_error(exc, default_param=param, rename=dict.fromkeys(PROMPT_FIELDS, param)) from None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _encode_vector(vector: npt.NDArray[np.float32], req: EmbeddingRequest) -> Any:
    if req.encoding_format == "float":
        return vector.tolist()
    order = sys.byteorder if req.endianness == "native" else req.endianness
    raw = vector.astype("<f4" if order == "little" else ">f4").tobytes()
    return base64.b64encode(raw).decode("ascii")
