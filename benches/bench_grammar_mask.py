"""Grammar-mask fill and accept for a batch of JSON-schema rows, as the engine core does them.

16 rows (bench_structured.py's schema) each walk their grammar along random allowed tokens, one step at
a time: fill the batch's allow-bits (StructuredOutputManager.fill_bitmask, llguidance's executor), pick a
random allowed token per row, accept them (accept_tokens). The fill is on a mixed batch's critical path
under async scheduling (benches/RESULTS.md, "Mixed batches on the H200"), so it is timed per step.

    python benches/bench_grammar_mask.py [--model DIR] [--rows 16] [--steps 60] [--threads 1,4]

--model: a folder with tokenizer.json and config.json (default: the dummy Llama-3.1-8B folder of
bench_setup, whose synthetic 128k tokenizer the GPU benchmarks use). --threads: executor thread counts
to compare, in one process (default: llguidance's own default). The last line is
`grammar_mask_fill_ms_p50: <ms>` for the first setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import llguidance
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_setup  # noqa: E402
import bench_structured  # noqa: E402
from ferrox.structured.manager import StructuredOutputManager  # noqa: E402
from ferrox.structured.params import StructuredOutputsParams  # noqa: E402


def walk(manager: StructuredOutputManager, vocab: int, rows: int, steps: int, seed: int) -> tuple[list[float], list[float]]:
    """Per-step fill and accept times (s) of `rows` fresh JSON rows walking random allowed tokens."""
    ids = [f"row{i}" for i in range(rows)]
    manager.free(ids)
    for rid in ids:
        manager.submit(rid, StructuredOutputsParams(json=bench_structured.SCHEMA))
    while manager.num_pending():
        manager.wait_for_pending(1.0)
        manager.poll_ready()
    rng = random.Random(seed)  # the same walk for every setting
    fills, accepts = [], []
    for _ in range(steps):
        t = time.perf_counter()
        mask = manager.fill_bitmask(ids)
        fills.append(time.perf_counter() - t)
        assert mask is not None
        tokens = []
        for words in mask.numpy():
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab])
            tokens.append(int(rng.choice(allowed.tolist())))
        t = time.perf_counter()
        done = manager.accept_tokens(ids, np.array(tokens, dtype=np.int64))
        accepts.append(time.perf_counter() - t)
        if done.any():  # a grammar completed: the walk ends with the first one
            break
    return fills, accepts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--threads", default="default", help="comma-separated executor thread counts, or 'default'")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    folder = args.model or bench_setup.make_model_dir()
    with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
        tokenizer_json = f.read()
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    vocab = int(config["vocab_size"])
    eos = config.get("eos_token_id")
    manager = StructuredOutputManager(tokenizer_json, vocab, eos if isinstance(eos, list) else [eos])
    print(f"cpus {os.cpu_count()}  vocab {vocab}  rows {args.rows}")
    first = None
    for setting in args.threads.split(","):
        threads = None if setting == "default" else int(setting)
        manager._mask_executor = llguidance.LLExecutor(num_threads=threads)
        fills, accepts = walk(manager, vocab, args.rows, args.steps, args.seed)
        f, a = np.array(fills) * 1e3, np.array(accepts) * 1e3
        print(f"threads {setting:>7}  steps {len(f)}  fill ms mean {f.mean():.2f} p50 {np.median(f):.2f} "
              f"p90 {np.percentile(f, 90):.2f}  accept ms mean {a.mean():.3f}")
        first = float(np.median(f)) if first is None else first
    print(f"grammar_mask_fill_ms_p50: {first:.3f}")


if __name__ == "__main__":
    main()
