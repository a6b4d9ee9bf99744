"""The rejection sampler's cost in a verify step (layers/rejection_sampler.py), on the device.

What a speculating engine pays each step beyond a plain step's sampling: the host time to issue the
verification (index uploads, small launches) and its time to a finished result. Greedy rows (the usual
serving case) and sampled rows, k drafts a request, the vocabulary of Qwen3.5 (248,320 logits a row).

    python benches/bench_rejection.py [--baseline path/to/old/rejection_sampler.py]

With --baseline, that file's `rejection_sample` runs beside this tree's in the same process (a ratio
per row). Prints a table; the last line is this tree's batch-1 k=1 greedy time to result.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import numpy as np
import torch
from ferrox.layers.rejection_sampler import rejection_sample


def load(path: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("baseline_rejection_sampler", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.rejection_sample


def measure(fn, batch: int, k: int, vocab: int, greedy: bool, reps: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(host ms to issue, ms to a finished result) medians."""
    device = torch.device("cuda")
    rows = batch * (k + 1)
    logits = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16)
    probs = logits if greedy else torch.softmax(logits.float(), dim=-1)
    drafts = torch.randint(0, vocab, (batch * k,))
    counts = np.full(batch, k, dtype=np.int32)
    mask = torch.full((batch,), greedy)
    gen = torch.Generator(device=device).manual_seed(0)
    host, total = [], []
    for i in range(reps + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(probs, drafts, counts, greedy=mask, default_generator=gen)
        t1 = time.perf_counter()
        out.num_sampled.cpu()
        t2 = time.perf_counter()
        if i >= 5:
            host.append(t1 - t0)
            total.append(t2 - t0)
    return float(np.median(host)) * 1e3, float(np.median(total)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    impls = {"tree": rejection_sample}
    if args.baseline:
        impls = {"baseline": load(args.baseline), **impls}
    print("| rows | k | batch | " + " | ".join(f"{n} host / total ms" for n in impls)
          + (" | total ratio |" if len(impls) == 2 else " |"))
    last = 0.0
    for greedy in (True, False):
        for batch in (1, 32):
            for k in (1, 3):
                res = {n: measure(f, batch, k, args.vocab, greedy, args.reps) for n, f in impls.items()}
                cells = " | ".join(f"{h:.3f} / {t:.3f}" for h, t in res.values())
                ratio = ""
                if len(res) == 2:
                    (_, base), (_, new) = res.values()
                    ratio = f" | {base / new:.2f}x"
                print(f"| {'greedy' if greedy else 'sampled'} | {k} | {batch} | {cells}{ratio} |")
                if greedy and batch == 1 and k == 1:
                    last = res["tree"][1]
    print(f"batch-1 k=1 greedy verification, time to result: {last:.3f} ms")


if __name__ == "__main__":
    main()
