"""POST /score (and /v1/score) and POST /rerank (and /v1/rerank, /v2/rerank), vLLM's scoring APIs, served by an
embedding (bi-encoder) model: a pair's score is the cosine similarity of the two texts' embeddings, each
made by the same pooling /v1/embeddings uses (ferrox.pooling.score has the pairing rules).

Each distinct text of a request is embedded once (a query against N documents embeds the query once), all
queued together as /v1/embeddings queues its inputs; usage counts the tokens embedded. vLLM counts each
pair's tokens instead (the first text's, a pad token, the second's), so its count for 1:N is larger.

    /score   {"id": "score-...", "object": "list", "created", "model",
              "data": [{"index", "object": "score", "score"}], "usage": {"prompt_tokens", "total_tokens", ...}}
    /rerank  {"id": "rerank-...", "model", "usage": {"prompt_tokens", "total_tokens"},
              "results": [{"index", "document": {"text", "multi_modal": null}, "relevance_score"}]}

Rerank results are sorted by relevance_score, highest first (ties in document order), cut to top_n when
it is positive. A generation model refuses both with vLLM's 400 "The model does not support ... API".

Served by a sequence classifier (a cross-encoder or decoder reranker), each pair is ONE request instead: the two
texts in the tokenizer's pair encoding (`[CLS] a [SEP] b [SEP]`, BERT's token types 0 then 1; joined into one
string when config.json sets use_pad_token false, as vLLM does), scored by the
model's head and activation (pooling/classify.py; use_activation false: the raw logit). Usage counts every
pair's tokens, as vLLM's does.
"""

from __future__ import annotations

import time

from aiohttp import web

from ferrox.engine.input_processor import prompt_size
from ferrox.entrypoints.openai.protocol_score import BaseScoringRequest, RerankRequest, ScoreRequest, as_list
from ferrox.entrypoints.openai.serving import (
    ServingContext,
    api_error,
    check_priority,
    json_response,
    parse_body,
    request_ids,
)
from ferrox.entrypoints.openai.serving_embeddings import (
    encode_all,
    is_classifier,
    not_supported,
    tokenize_inputs,
    validate_inputs,
)
from ferrox.errors import FerroxError
from ferrox.pooling.params import PoolingParams
from ferrox.pooling.score import cosine_similarity, distinct, pair_labels, score_pairs

Side = tuple[str, list[str]]  # a field's name and its texts


async def create_score(ctx: ServingContext, request: web.Request) -> web.Response:
    _check_scorer(ctx, "Score API")
    req = await parse_body(request, ScoreRequest)
    _check(ctx, req)
    try:
        sides = req.sides()
        pairs = score_pairs(len(sides[0][1]), len(sides[1][1]), (sides[0][0], sides[1][0]))
    except FerroxError as exc:
        raise api_error(exc) from None
    request_id, header_id = request_ids(request, req, "score")
    scores, num_tokens = await _score(ctx, req, sides, pairs, request_id)
    return json_response({
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": ctx.model_name,
        "data": [{"index": k, "object": "score", "score": s} for k, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    }, headers={"X-Request-Id": header_id})


async def create_rerank(ctx: ServingContext, request: web.Request) -> web.Response:
    _check_scorer(ctx, "Rerank (Score) API")
    req = await parse_body(request, RerankRequest)
    _check(ctx, req)
    documents = as_list(req.documents)
    try:
        pairs = score_pairs(1, len(documents), ("query", "documents"))
    except FerroxError as exc:
        raise api_error(exc) from None
    request_id, header_id = request_ids(request, req, "rerank")
    scores, num_tokens = await _score(ctx, req, (("query", [req.query]), ("documents", documents)), pairs, request_id)
    order = sorted(range(len(documents)), key=scores.__getitem__, reverse=True)  # stable: ties keep their order
    if req.top_n > 0:
        order = order[:req.top_n]
    results = [{"index": j, "document": {"text": documents[j], "multi_modal": None}, "relevance_score": scores[j]}
               for j in order]
    return json_response({
        "id": request_id,
        "model": ctx.model_name,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        "results": results,
    }, headers={"X-Request-Id": header_id})


def _check_scorer(ctx: ServingContext, api: str) -> None:
    """A pooling model that gives one score a pair: an embedding model, or a classifier of one label."""
    if ctx.engine.runner != "pooling":
        raise not_supported(api)
    labels = ctx.engine.pooler_config.labels if is_classifier(ctx) else None  # type: ignore[union-attr]
    if labels is not None and len(labels) != 1:
        raise not_supported(api, f"its classification head has {len(labels)} labels, and a pair's score needs one "
                                 "(use /classify)")


def _check(ctx: ServingContext, req: BaseScoringRequest) -> None:
    ctx.check_model(req.model)
    ctx.check_engine()
    check_priority(ctx, req.priority)


async def _score(ctx: ServingContext, req: BaseScoringRequest, sides: tuple[Side, Side], pairs: list[tuple[int, int]],
                 request_id: str) -> tuple[list[float], int]:
    """Each pair's cosine similarity, and the tokens embedded: every distinct text once (a cross-encoder:
    each pair's score, and every pair's tokens)."""
    if is_classifier(ctx):
        return await _cross_encode(ctx, req, sides, pairs, request_id)
    try:
        params = PoolingParams(normalize=req.normalize())
    except FerroxError as exc:
        raise api_error(exc) from None
    texts = [text for _, side in sides for text in side]
    labels = [(name, f"{name}[{i}]" if len(side) > 1 else None) for name, side in sides for i in range(len(side))]
    first, where = distinct(texts)
    unique = [texts[i] for i in first]
    # Encoding many or long texts takes a while: off the event loop (a few short ones inline).
    prompts = await ctx.engine.prompt_work(prompt_size(unique), tokenize_inputs, ctx, unique)
    validate_inputs(ctx, prompts, params, [labels[i] for i in first])
    outputs = await encode_all(ctx, prompts, params, request_id, req.priority, param=sides[0][0])
    offset = len(sides[0][1])
    scores = [cosine_similarity(outputs[where[i]].outputs.data, outputs[where[offset + j]].outputs.data)
              for i, j in pairs]
    return scores, sum(len(ids) for ids in prompts)


async def _cross_encode(ctx: ServingContext, req: BaseScoringRequest, sides: tuple[Side, Side],
                        pairs: list[tuple[int, int]], request_id: str) -> tuple[list[float], int]:
    """Each pair read as one sequence by a cross-encoder, all queued together."""
    (first, texts_1), (second, texts_2) = sides
    try:
        base = PoolingParams(task="score", use_activation=req.normalize())
    except FerroxError as exc:
        raise api_error(exc) from None
    texts = [(texts_1[i], texts_2[j]) for i, j in pairs]
    join = ctx.engine.pooler_config.join_pair_texts  # type: ignore[union-attr]
    encoded = await ctx.engine.prompt_work(sum(len(a) + len(b) for a, b in texts), ctx.engine.tokenizer.encode_pairs,
                                           texts, join_texts=join)
    prompts = [ids for ids, _ in encoded]
    params = [base.clone(second_text_start=start) for _, start in encoded]
    # A pair too long names the second side's field: documents are what grows.
    labels = [(second, pair_labels(len(texts_1), len(texts_2), i, j, (first, second))) for i, j in pairs]
    validate_inputs(ctx, prompts, params, labels)
    outputs = await encode_all(ctx, prompts, params, request_id, req.priority, param=second)
    return [float(out.outputs.data[0]) for out in outputs], sum(len(ids) for ids in prompts)
