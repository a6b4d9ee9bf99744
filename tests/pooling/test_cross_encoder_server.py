"""`ferrox serve` on a tiny BERT cross-encoder (BertForSequenceClassification, one label; detected as a pooling
model of the classify kind): /v1/score and /score with every pair read as one sequence, /rerank ordering and
top_n, /classify's labels and probs, /invocations and /pooling, against transformers on the same weights; the
400s naming the field and the embeddings / generation routes refused. One server for the file."""

from __future__ import annotations

import pytest
import torch

from tests.pooling.conftest import make_tiny_classifier, post_json, sigmoid
from tests.server.server_proc import ServerProcess

transformers = pytest.importorskip("transformers")

MODEL = "reranker"
QUERY = "where is paris"
DOCUMENTS = ["a man is eating food", "paris is the capital of france", "hi", "the quick brown fox jumps over"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_tiny_classifier(tmp_path_factory.mktemp("reranker"), seed=3)


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(folder, "--max-model-len", "64", "--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-20:])


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' tokenizer and a function: pairs (or texts) -> logits of one padded batch."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def logits(first: list[str], second: list[str] | None = None) -> list[float]:
        batch = tokenizer(first, second, padding=True, return_tensors="pt")
        return model(**batch).logits[:, 0].tolist()

    return tokenizer, logits


def test_score_reads_each_pair_as_one_sequence(server, reference):
    """1:N on /v1/score: the sigmoid of transformers' logit of tokenizer(query, document); usage counts every
    pair's tokens. N:N on /score (text_1/text_2), and use_activation false gives the logits."""
    tokenizer, logits = reference
    status, body = post_json(server, "/v1/score", {"model": MODEL, "queries": QUERY, "documents": DOCUMENTS})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert {d["object"] for d in body["data"]} == {"score"} and body["object"] == "list" and body["model"] == MODEL
    expected = sigmoid(logits([QUERY] * len(DOCUMENTS), DOCUMENTS))
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == tokens
    status, body = post_json(server, "/score", {"text_1": DOCUMENTS[:2], "text_2": [QUERY, QUERY], "use_activation": False})
    assert status == 200, body
    assert [d["score"] for d in body["data"]] == pytest.approx(logits(DOCUMENTS[:2], [QUERY, QUERY]), abs=2e-5)


def test_rerank_orders_by_the_cross_encoder(server, reference):
    _, logits = reference
    expected = sigmoid(logits([QUERY] * len(DOCUMENTS), DOCUMENTS))
    order = sorted(range(len(DOCUMENTS)), key=expected.__getitem__, reverse=True)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        status, body = post_json(server, path, {"model": MODEL, "query": QUERY, "documents": DOCUMENTS, "top_n": 3})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == order[:3]
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx([expected[j] for j in order[:3]],
                                                                                abs=1e-5)
        assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[j] for j in order[:3]]
    # /invocations picks rerank from the body's shape.
    status, body = post_json(server, "/invocations", {"query": QUERY, "documents": DOCUMENTS})
    assert status == 200 and [r["index"] for r in body["results"]] == order, body


def test_classify_labels_and_probs(server, reference):
    tokenizer, logits = reference
    status, body = post_json(server, "/classify", {"model": MODEL, "input": DOCUMENTS})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == MODEL and body["id"].startswith("classify-")
    expected = sigmoid(logits(DOCUMENTS))
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["label"] == "LABEL_0" and item["num_classes"] == 1
        assert item["probs"] == pytest.approx([expected[i]], abs=1e-5)
    tokens = sum(len(tokenizer(d)["input_ids"]) for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                             "prompt_tokens_details": None}
    # Token ids are an input too; use_activation false gives the logit; /invocations and /pooling agree.
    ids = tokenizer(DOCUMENTS[1])["input_ids"]
    status, body = post_json(server, "/classify", {"input": ids, "use_activation": False})
    assert status == 200 and body["data"][0]["probs"] == pytest.approx(logits(DOCUMENTS[1:2]), abs=2e-5), body
    status, body = post_json(server, "/invocations", {"input": DOCUMENTS[0]})
    assert status == 200 and body["data"][0]["probs"] == pytest.approx(expected[:1], abs=1e-5), body
    status, body = post_json(server, "/pooling", {"input": DOCUMENTS[0]})
    assert status == 200 and body["data"][0]["data"] == pytest.approx(expected[:1], abs=1e-5), body


@pytest.mark.parametrize(("path", "body", "param", "needle"), [
    ("/classify", {"input": []}, "input", "empty array"),
    ("/classify", {"input": "word " * 80}, "input", "maximum context length of 64"),
    ("/classify", {"input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens", "never truncated"),
    ("/classify", {"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages", "not supported"),
    ("/classify", {"input": [5, 99999]}, "input", "outside the vocabulary"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", "word " * 80]}, "text_2",
     r"the pair text_1 + text_2[1] has"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "at least one text"),
    ("/pooling", {"input": "hi", "task": "embed"}, "task", "does not embed"),
])
def test_bad_requests_name_the_field(server, path, body, param, needle):
    status, answer = post_json(server, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert needle in answer["error"]["message"]


def test_embeddings_and_generation_are_refused(server):
    status, answer = post_json(server, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and answer["error"]["message"].startswith(
        "The model does not support Embeddings API: it is a sequence-classification model"), answer
    status, answer = post_json(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and answer["error"]["message"] == "The model does not support Chat Completions API", answer
