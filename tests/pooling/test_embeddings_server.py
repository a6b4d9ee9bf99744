"""`ferrox serve` on the all-MiniLM-L6-v2 folder (a pooling model, detected from its architecture): the
official openai client's embeddings.create against transformers, every input shape, base64 and float,
usage, /pooling, /score and /rerank (cosine similarities of transformers' embeddings), the 400s naming the
field, the generation routes refused, and the probes and pages. One server for the file (the 2-core CI
box pays for each start)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from tests.pooling.conftest import SENTENCES, cosine, hf_sentence_embeddings, post_json
from tests.server.server_proc import ServerProcess

openai = pytest.importorskip("openai")

MODEL = "minilm"


@pytest.fixture(scope="module")
def server(minilm_folder):
    srv = ServerProcess(minilm_folder, "--max-model-len", "256", "--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-20:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_matches_transformers(client, hf_minilm):
    """The client's default (it asks for base64 and decodes it) on a batch of sentences: cosine >= 0.999
    with sentence-transformers' mean pooling + normalisation; usage counts the input tokens."""
    tokenizer, model = hf_minilm
    resp = client.embeddings.create(model=MODEL, input=SENTENCES)
    ref = hf_sentence_embeddings(tokenizer, model, SENTENCES)
    assert [d.index for d in resp.data] == list(range(len(SENTENCES)))
    for item, expected in zip(resp.data, ref, strict=True):
        assert cosine(item.embedding, expected) >= 0.999
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in SENTENCES)
    assert (resp.usage.prompt_tokens, resp.usage.total_tokens) == (num_tokens, num_tokens)
    assert resp.model == MODEL


def test_every_input_shape_and_both_encodings(server, client, hf_minilm):
    tokenizer, _ = hf_minilm
    one = client.embeddings.create(model=MODEL, input=SENTENCES[0], encoding_format="float").data[0].embedding
    ids = tokenizer(SENTENCES[0])["input_ids"]
    by_ids = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, one, atol=1e-6)
    pair = client.embeddings.create(model=MODEL, input=[ids, tokenizer(SENTENCES[1])["input_ids"]])
    np.testing.assert_allclose(pair.data[0].embedding, one, atol=1e-6)
    assert pair.usage.prompt_tokens == len(ids) + len(tokenizer(SENTENCES[1])["input_ids"])
    status, body = post_json(server, "/v1/embeddings", {"input": SENTENCES[0], "encoding_format": "base64"})
    assert status == 200
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.asarray(one, dtype=np.float32))
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"


def test_many_inputs_in_one_request_equal_one_at_a_time(client):
    texts = [f"sentence number {i} about {SENTENCES[i % len(SENTENCES)]}" for i in range(40)]
    batch = client.embeddings.create(model=MODEL, input=texts).data
    for i in (0, 17, 39):
        alone = client.embeddings.create(model=MODEL, input=texts[i]).data[0].embedding
        np.testing.assert_allclose(batch[i].embedding, alone, atol=2e-6)


def test_pooling_route(server, client):
    status, body = post_json(server, "/pooling", {"model": MODEL, "input": SENTENCES[:2]})
    assert status == 200, body
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    embedded = client.embeddings.create(model=MODEL, input=SENTENCES[:2]).data
    for item, ref in zip(body["data"], embedded, strict=True):
        np.testing.assert_allclose(item["data"], ref.embedding, atol=1e-6)
    assert body["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"input": []}, "input", "empty array"),
    ({"input": ""}, "input", "empty string"),
    ({"input": [1.5]}, "input", "array of token ids"),
    ({"input": [[101, 102], []]}, "input", "input 1"),
    ({"input": "word " * 300}, "input", "maximum context length of 256"),
    ({"input": [[101] * 257]}, "input", "maximum context length of 256"),
    ({"input": [101, 99999, 102]}, "input", "outside the vocabulary"),
    ({"input": "hi", "dimensions": 64}, "dimensions", "Matryoshka"),
    ({"input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "never truncated"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format", ""),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, needle):
    status, answer = post_json(server, "/v1/embeddings", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert needle in answer["error"]["message"]


def test_openai_client_sees_the_error(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.embeddings.create(model=MODEL, input=["fine", "word " * 300])
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="hi")


def test_generation_routes_are_refused_and_probes_work(server):
    for path, body, api in (("/v1/completions", {"prompt": "hi"}, "Completions API"),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
                             "Chat Completions API")):
        status, answer = post_json(server, path, {"model": MODEL, **body})
        assert status == 400 and answer["error"]["message"] == f"The model does not support {api}", answer
    # A sequence classifier's API: an embedding model refuses it, saying what it serves instead.
    status, answer = post_json(server, "/classify", {"model": MODEL, "input": "hi"})
    assert status == 400 and answer["error"]["message"].startswith("The model does not support Classification "
                                                                   "API: it is an embedding model"), answer
    for path in ("/health", "/metrics", "/", "/status", "/v1/models"):
        with urllib.request.urlopen(server.base_url + path, timeout=10) as resp:
            assert resp.status == 200, path
    with urllib.request.urlopen(server.base_url + "/v1/models", timeout=10) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == MODEL
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as resp:
        assert b"ferrox:request_success_total" in resp.read()


@torch.inference_mode()
def test_normalize_false_gives_the_raw_mean(server, hf_minilm):
    tokenizer, model = hf_minilm
    status, body = post_json(server, "/v1/embeddings", {"input": SENTENCES[:1], "normalize": False})
    assert status == 200
    expected = hf_sentence_embeddings(tokenizer, model, SENTENCES[:1], normalize=False)[0]
    torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), expected, atol=1e-5, rtol=1e-4)


# ---- /score and /rerank: cosine similarity of the embeddings (vLLM's scoring APIs for a bi-encoder) ----

def _reference_scores(hf_minilm, texts_1: list[str], texts_2: list[str]) -> list[float]:
    """transformers' normalised mean-pooled embeddings, one text at a time against its pair: dot products."""
    tokenizer, model = hf_minilm
    a = hf_sentence_embeddings(tokenizer, model, texts_1).double()
    b = hf_sentence_embeddings(tokenizer, model, texts_2).double()
    return (a * b).sum(-1).tolist()


def _prompt_tokens_counted(server) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("ferrox:prompt_tokens_total"))


def test_score_one_against_many_matches_transformers(server, hf_minilm):
    """1:N: the query's score against each text is the cosine of transformers' embeddings, and equals the
    dot product of /v1/embeddings' vectors. The query is also among the texts: every distinct text is
    embedded once (usage and the engine's own prompt-token counter say so)."""
    tokenizer, _ = hf_minilm
    before = _prompt_tokens_counted(server)
    status, body = post_json(server, "/score", {"model": MODEL, "text_1": SENTENCES[4], "text_2": SENTENCES})
    assert status == 200, body
    assert body["id"].startswith("score-") and body["object"] == "list" and body["model"] == MODEL
    assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score") for i in range(len(SENTENCES))]
    scores = [d["score"] for d in body["data"]]
    np.testing.assert_allclose(scores, _reference_scores(hf_minilm, [SENTENCES[4]] * len(SENTENCES), SENTENCES),
                               atol=1e-5)
    assert scores[4] == pytest.approx(1.0, abs=1e-6)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in SENTENCES)
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    assert _prompt_tokens_counted(server) - before == num_tokens
    _, embedded = post_json(server, "/v1/embeddings", {"input": SENTENCES})
    vectors = np.array([d["embedding"] for d in embedded["data"]], dtype=np.float64)
    np.testing.assert_allclose(scores, vectors @ vectors[4], atol=1e-6)


@pytest.mark.parametrize(("path", "names"), [("/v1/score", ("text_1", "text_2")), ("/score", ("data_1", "data_2")),
                                             ("/score", ("queries", "documents")), ("/score", ("queries", "items"))])
def test_score_pairwise_under_each_spelling(server, hf_minilm, path, names):
    """N:N pairs the two lists up one to one, whichever of vLLM's field names carry them."""
    tokenizer, _ = hf_minilm
    first, second = SENTENCES[:3], SENTENCES[2:5]
    status, body = post_json(server, path, {names[0]: first, names[1]: second})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], _reference_scores(hf_minilm, first, second),
                               atol=1e-5)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in SENTENCES)  # SENTENCES[2] is on both sides: once
    assert (body["usage"]["prompt_tokens"], body["usage"]["total_tokens"]) == (num_tokens, num_tokens)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance_and_keeps_top_n(server, hf_minilm, path):
    tokenizer, _ = hf_minilm
    query, documents = "Which city is the capital of France?", SENTENCES
    expected = _reference_scores(hf_minilm, [query] * len(documents), documents)
    status, body = post_json(server, path, {"model": MODEL, "query": query, "documents": documents})
    assert status == 200, body
    assert body["id"].startswith("rerank-") and body["model"] == MODEL
    order = sorted(range(len(documents)), key=lambda j: expected[j], reverse=True)
    assert [r["index"] for r in body["results"]] == order
    assert order[0] == 4  # "Paris is the capital of France."
    for r in body["results"]:
        assert r["document"] == {"text": documents[r["index"]], "multi_modal": None}
        assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
    num_tokens = sum(len(tokenizer(t)["input_ids"]) for t in [query, *documents])
    assert body["usage"] == {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    status, top = post_json(server, path, {"query": query, "documents": documents, "top_n": 2})
    assert status == 200 and [r["index"] for r in top["results"]] == order[:2], top
    assert top["usage"] == body["usage"]  # every document is scored; top_n cuts the answer
    if path == "/rerank":  # SageMaker's /invocations takes the same body to the same route
        status, via = post_json(server, "/invocations", {"query": query, "documents": documents, "top_n": 2})
        assert status == 200 and [r["index"] for r in via["results"]] == order[:2], via
        assert [r["relevance_score"] for r in via["results"]] == pytest.approx(
            [r["relevance_score"] for r in top["results"]], abs=1e-5)  # (another batch: other float rounding)
        status, scored = post_json(server, "/invocations", {"text_1": query, "text_2": documents[:2]})
        assert status == 200 and scored["object"] == "list" and len(scored["data"]) == 2, scored


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/score", {"text_1": SENTENCES[:2], "text_2": SENTENCES[:3]}, "text_1", "2 texts against 3 in text_2"),
    ("/score", {"queries": SENTENCES[:3], "items": SENTENCES[:1]}, "queries", "3 texts against 1 in items"),
    ("/score", {"text_1": [], "text_2": "hi"}, "text_1", "at least one text"),
    ("/score", {"text_1": "hi"}, "text_2", "required with text_1"),
    ("/score", {"text_1": "a", "text_2": "b", "data_1": "c"}, "data_1", "one pair of inputs"),
    ("/score", {"text_1": {"content": []}, "text_2": "b"}, "text_1", "multimodal"),
    ("/score", {"text_1": "a", "text_2": [1, 2]}, "text_2", "array of strings"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "never truncated"),
    ("/score", {"text_1": "a", "text_2": "b", "mm_processor_kwargs": {"fps": 1}}, "mm_processor_kwargs", "text only"),
    ("/score", {"text_1": "a", "text_2": ["b", "word " * 300]}, "text_2", "text_2[1] has"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "at least one text"),
    ("/rerank", {"query": ["a"], "documents": ["b"]}, "query", "must be a string"),
    ("/rerank", {"query": "a", "documents": ["b"], "padding": "max_length"}, "padding", "do_not_pad"),
    ("/rerank", {"query": "a", "documents": ["b"], "truncation_side": "left"}, "truncation_side", "never truncated"),
    ("/rerank", {"query": "word " * 300, "documents": ["b"]}, "query", "maximum context length of 256"),
])
def test_bad_score_requests_are_a_400_naming_the_field(server, path, body, param, needle):
    status, answer = post_json(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert needle in answer["error"]["message"], answer
