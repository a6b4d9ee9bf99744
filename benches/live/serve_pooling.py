"""Live `ferrox serve` of a tiny BERT embedder on the GPU: /v1/embeddings, /v1/score, /v1/rerank, /invocations;
scores checked against the cosine of the served embeddings. Then tiny cross-encoders (BERT with token types,
XLM-R) and a 3-label classifier in float32: /v1/score, /v1/rerank and /classify against transformers."""
from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.pooling.conftest import hf_classifier_logits, make_tiny_classifier, make_tiny_encoder  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def cross_encoders(tmp: Path) -> bool:
    """Served scores against transformers' sigmoid (one label) / softmax (three) of the same pairs."""
    import tokenizers
    import torch
    import transformers

    ok = True
    query, docs = "capital of france", ["paris is in france", "the cat sat", "hello world"]
    for family, labels in (("bert", 1), ("xlm-roberta", 1), ("bert", 3)):
        folder = make_tiny_classifier(tmp / f"{family}-{labels}", family=family, num_labels=labels, seed=3)
        tok = tokenizers.Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))  # the pair encoding as served
        ref = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
        pad = 0 if family == "bert" else 1
        srv = ServerProcess(folder, "--served-model-name", "c", "--dtype", "float32", "--max-model-len", "48",
                            startup_timeout=300)
        try:
            with torch.no_grad():
                if labels == 1:
                    enc = [tok.encode(query, d) for d in docs]
                    logits = hf_classifier_logits(ref, [e.ids for e in enc], [e.type_ids for e in enc], pad_id=pad)
                    want = torch.sigmoid(logits[:, 0]).tolist()
                    got = [d["score"] for d in post(srv.base_url, "/v1/score", {"text_1": query, "text_2": docs})["data"]]
                    rr = post(srv.base_url, "/v1/rerank", {"query": query, "documents": docs})["results"]
                    good = (all(abs(a - b) < 1e-4 for a, b in zip(got, want, strict=True))
                            and [r["index"] for r in rr] == sorted(range(len(docs)), key=lambda j: -want[j]))
                else:
                    enc = [tok.encode(d) for d in docs]
                    want = hf_classifier_logits(ref, [e.ids for e in enc], pad_id=pad).softmax(-1).tolist()
                    got = [d["probs"] for d in post(srv.base_url, "/classify", {"input": docs})["data"]]
                    good = all(abs(a - b) < 1e-4 for row, wrow in zip(got, want, strict=True)
                               for a, b in zip(row, wrow, strict=True))
        finally:
            code = srv.stop()
        print(f"cross-encoder {family} labels={labels}:", "OK" if good and code == 0 else "MISMATCH", got, want)
        ok = ok and good and code == 0
    return ok


def main() -> int:
    folder = make_tiny_encoder(Path(tempfile.mkdtemp()) / "bert", pooling="mean", normalize=True)
    srv = ServerProcess(folder, "--runner", "pooling", "--served-model-name", "e", "--max-model-len", "48", startup_timeout=300)
    try:
        docs = ["paris is in france", "the cat sat", "hello world", "a b c"]
        emb = [d["embedding"] for d in post(srv.base_url, "/v1/embeddings", {"input": ["capital of france", *docs]})["data"]]
        cos = [sum(a * b for a, b in zip(emb[0], e, strict=True)) for e in emb[1:]]
        score = [d["score"] for d in post(srv.base_url, "/v1/score", {"text_1": "capital of france", "text_2": docs})["data"]]
        rr = post(srv.base_url, "/v1/rerank", {"query": "capital of france", "documents": docs, "top_n": 2})
        inv = post(srv.base_url, "/invocations", {"query": "capital of france", "documents": docs, "top_n": 2})
        ok = (all(abs(a - b) < 1e-3 for a, b in zip(score, cos, strict=True))
              and [r["index"] for r in rr["results"]] == sorted(range(4), key=lambda j: -cos[j])[:2]
              # (equal up to rounding: the CPU engine's thread count follows the machine's load)
              and [r["index"] for r in inv["results"]] == [r["index"] for r in rr["results"]]
              and all(abs(a["relevance_score"] - b["relevance_score"]) < 1e-6
                      for a, b in zip(inv["results"], rr["results"], strict=True)))
        print("pooling live:", "OK" if ok else "MISMATCH", score, cos, rr["results"])
    finally:
        code = srv.stop()
    print("exit", code)
    ok = ok and code == 0 and cross_encoders(Path(tempfile.mkdtemp()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
