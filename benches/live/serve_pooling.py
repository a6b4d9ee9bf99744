"""Live `ferrox serve` of a tiny BERT embedder on the GPU: /v1/embeddings, /v1/score, /v1/rerank, /invocations;
scores checked against the cosine of the served embeddings."""
from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.pooling.conftest import make_tiny_encoder  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base, path, body):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


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
              and inv["results"] == rr["results"])
        print("pooling live:", "OK" if ok else "MISMATCH", score, cos, rr["results"])
    finally:
        code = srv.stop()
    print("exit", code)
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
