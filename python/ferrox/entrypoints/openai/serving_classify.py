"""POST /classify (vLLM's Classification API), served by a sequence-classification model: each input's class
scores (pooling/classify.py: softmax over several labels, a sigmoid for one) and its most likely label,
named by config.json id2label.

    {"id": "classify-...", "object": "list", "created", "model",
     "data": [{"index", "label", "probs": [...], "num_classes"}],
     "usage": {"prompt_tokens", "total_tokens", "completion_tokens": 0, "prompt_tokens_details": null}}

Every input is one engine request, all queued together (as /v1/embeddings queues its inputs) and validated
before any is queued. An embedding model and a generation model refuse the route with vLLM's 400 "The model
does not support Classification API".
"""

from __future__ import annotations

import numpy as np
from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints.openai.protocol_classify import ClassificationRequest
from ferrox.entrypoints.openai.serving import (
    ServingContext,
    api_error,
    check_priority,
    parse_body,
    request_ids,
)
from ferrox.entrypoints.openai.serving_embeddings import (
    encode_all,
    is_classifier,
    list_response,
    not_supported,
    tokenize_inputs,
    validate_inputs,
)
from ferrox.errors import FerroxError
from ferrox.pooling.params import PoolingParams


async def create_classify(ctx: ServingContext, request: web.Request) -> web.Response:
    if ctx.engine.runner != "pooling":
        raise not_supported("Classification API")
    if not is_classifier(ctx):
        raise not_supported("Classification API", "it is an embedding model (use /v1/embeddings, /score or /rerank)")
    req = await parse_body(request, ClassificationRequest)
    ctx.check_model(req.model)
    ctx.check_engine()
    check_priority(ctx, req.priority)
    try:
        params = PoolingParams(task="classify", use_activation=req.resolved_activation())
    except FerroxError as exc:
        raise api_error(exc) from None
    # Encoding many or long texts takes a while: off the event loop (a few short ones inline).
    inputs = req.inputs()
    prompts = await ctx.engine.prompt_work(prompt_size(inputs), tokenize_inputs, ctx, inputs, req.add_special_tokens)
    validate_inputs(ctx, prompts, params)
    request_id, header_id = request_ids(request, req, "classify")
    outputs = await encode_all(ctx, prompts, params, request_id, req.priority)
    labels = ctx.engine.pooler_config.labels or []  # type: ignore[union-attr]
    data = []
    for i, out in enumerate(outputs):
        probs = out.outputs.data
        best = int(np.argmax(probs))
        data.append({"index": i, "label": labels[best] if best < len(labels) else None, "probs": probs.tolist(),
                     "num_classes": int(probs.size)})
    return list_response(ctx, request_id, header_id, data, sum(len(ids) for ids in prompts), completion_tokens=0,
                         prompt_tokens_details=None)
