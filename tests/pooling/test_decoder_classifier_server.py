"""`ferrox serve` on a tiny Qwen2ForSequenceClassification of one label (a decoder reranker / reward model,
detected as a pooling model of the classify kind): /classify and /score (each pair one sequence, the
tokenizer's pair encoding, its last token scored) and /rerank's order, against transformers on the same
weights; generation refused. One server for the file."""

from __future__ import annotations

import pytest
import torch

from tests.pooling.conftest import post_json, sigmoid
from tests.pooling.decoder_classifiers import hf_decoder_logits, make_tiny_decoder_classifier
from tests.server.server_proc import ServerProcess

transformers = pytest.importorskip("transformers")

MODEL = "reward"
QUERY = "Where is Paris?"
DOCUMENTS = ["Hello world!", "Paris is the capital of France.", "The quick brown fox jumps over the lazy dog.", "42"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_tiny_decoder_classifier(tmp_path_factory.mktemp("reward"), family="qwen2", seed=5)


@pytest.fixture(scope="module")
def server(folder):
    srv = ServerProcess(folder, "--max-model-len", "128", "--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-20:])


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' tokenizer and a function: texts (or pairs) -> the one logit of each."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()

    def logits(first: list[str], second: list[str] | None = None) -> list[float]:
        ids = [tokenizer(a, b)["input_ids"] for a, b in zip(first, second or [None] * len(first), strict=True)]
        return hf_decoder_logits(model, ids)[:, 0].tolist()

    return tokenizer, logits


def test_classify_scores_each_texts_last_token(server, reference):
    tokenizer, logits = reference
    status, body = post_json(server, "/classify", {"model": MODEL, "input": DOCUMENTS})
    assert status == 200, body
    expected = sigmoid(logits(DOCUMENTS))
    for i, item in enumerate(body["data"]):
        assert item["index"] == i and item["label"] == "LABEL_0" and item["num_classes"] == 1
        assert item["probs"] == pytest.approx([expected[i]], abs=1e-5)
    tokens = sum(len(tokenizer(d)["input_ids"]) for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == tokens
    status, body = post_json(server, "/classify", {"input": DOCUMENTS[1], "use_activation": False})
    assert status == 200 and body["data"][0]["probs"] == pytest.approx(logits(DOCUMENTS[1:2]), abs=2e-5), body


def test_score_and_rerank_read_each_pair_as_one_sequence(server, reference):
    tokenizer, logits = reference
    status, body = post_json(server, "/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    expected = sigmoid(logits([QUERY] * len(DOCUMENTS), DOCUMENTS))
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    assert len({round(s, 4) for s in expected}) == len(DOCUMENTS)  # the documents really differ
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    status, body = post_json(server, "/v1/score", {"queries": DOCUMENTS[:2], "documents": [QUERY, QUERY],
                                               "use_activation": False})
    assert status == 200, body
    assert [d["score"] for d in body["data"]] == pytest.approx(logits(DOCUMENTS[:2], [QUERY, QUERY]), abs=2e-5)
    order = sorted(range(len(DOCUMENTS)), key=expected.__getitem__, reverse=True)
    status, body = post_json(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200 and [r["index"] for r in body["results"]] == order[:2], body


def test_generation_and_embeddings_are_refused(server):
    status, answer = post_json(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert status == 400 and answer["error"]["message"] == "The model does not support Completions API", answer
    status, answer = post_json(server, "/v1/embeddings", {"input": "hi"})
    assert status == 400 and "sequence-classification model" in answer["error"]["message"], answer
