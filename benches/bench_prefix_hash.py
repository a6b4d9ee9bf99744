"""What the prefix cache's block hash costs the host (rust/prefix_cache.rs; --prefix-caching-hash-algo).

Times Scheduler.add_request (which hashes every full block of the prompt) for long prompts, and a
decode loop's schedule() + update_from_output() (a block hashed every block_size tokens per
request), once per algorithm, interleaved round by round on the same machine; prints the medians
and, last, the ratio sha256 / xxhash of the add_request time per 1,000 blocks.

    python benches/bench_prefix_hash.py [--prompt-tokens 131072] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from ferrox._core import Scheduler

BLOCK = 16
ALGOS = ("sha256", "xxhash")


def scheduler(algo: str, prompt_tokens: int, seqs: int) -> Scheduler:
    blocks = 1 + seqs * (prompt_tokens + 256) // BLOCK + 64
    return Scheduler(num_blocks=blocks, max_model_len=prompt_tokens + 256, block_size=BLOCK, max_num_seqs=seqs,
                     max_num_batched_tokens=max(8192, seqs), prefix_caching_hash_algo=algo)


def add_us_per_kblock(algo: str, prompt: np.ndarray, n: int) -> float:
    s = scheduler(algo, len(prompt), n)
    t = time.perf_counter()
    for i in range(n):
        s.add_request(f"r{i}", prompt, max_tokens=1, detokenize=False)
    return (time.perf_counter() - t) * 1e6 / (n * len(prompt) // BLOCK / 1000)


def decode_step_us(algo: str, seqs: int, steps: int, rng: np.random.Generator) -> float:
    s = scheduler(algo, 64, seqs)
    for i in range(seqs):
        s.add_request(f"d{i}", rng.integers(5, 30000, 64), max_tokens=steps + 8, ignore_eos=True, detokenize=False)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = s.schedule()
        s.update_from_output(rng.integers(5, 30000, out.num_reqs))
        times.append(time.perf_counter() - t)
    return statistics.median(times[steps // 4:]) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt-tokens", type=int, default=131072)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(5, 30000, args.prompt_tokens).astype(np.int64)
    add = {a: [] for a in ALGOS}
    step = {a: [] for a in ALGOS}
    for _ in range(args.rounds):
        for algo in ALGOS:  # interleaved: the machine's noise falls on both
            add[algo].append(add_us_per_kblock(algo, prompt, args.prompts))
            step[algo].append(decode_step_us(algo, args.seqs, args.steps, rng))
    print(f"{'algo':8} {'add_request us / 1k blocks':>28} {'decode step us (' + str(args.seqs) + ' seqs)':>26}")
    for algo in ALGOS:
        print(f"{algo:8} {statistics.median(add[algo]):28.1f} {statistics.median(step[algo]):26.1f}")
    ratio = statistics.median(add["sha256"]) / statistics.median(add["xxhash"])
    step_ratio = statistics.median(step["sha256"]) / statistics.median(step["xxhash"])
    print(f"decode step ratio sha256/xxhash: {step_ratio:.3f}")
    print(f"add_request ratio sha256/xxhash: {ratio:.2f}")


if __name__ == "__main__":
    main()
