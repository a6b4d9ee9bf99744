"""Prefill on the CPU: time to first token of one prompt of N tokens on the embedded model (its default
quantized path: the Rust decoder, whose attention runs in query tiles on the AVX2 kernel where the CPU
has it, rust/cpu/attention_simd.rs). Prefix caching off, so every run computes the whole prompt.

    python benches/bench_cpu_prefill.py [--lengths 256,512,1024,2048,4096] [--repeat 2]

`FERROX_CPU_KERNEL=portable` runs the portable kernels (matmuls and attention) for comparison. Each
length: one warm-up run, then the best of --repeat. The last line is `cpu_prefill_2048_s: <seconds>`
(or the largest length given when 2048 is not among them).
"""

from __future__ import annotations

import argparse
import platform
import time

from ferrox import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="256,512,1024,2048,4096")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    llm = LLM(max_model_len=max(lengths) + 16, enable_prefix_caching=False)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, detokenize=False)
    seconds: dict[int, float] = {}
    print(f"machine: {platform.node()} ({platform.machine()}), threads: {llm.engine.config.num_threads or 'all'}")
    for n in lengths:
        prompt = [{"prompt_token_ids": [(i * 37) % 40000 + 100 for i in range(n)]}]
        llm.generate(prompt, one, use_tqdm=False)
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        seconds[n] = best
        print(f"{n:>6} tokens: {best:7.2f} s  {n / best:7.0f} tok/s", flush=True)
    key = 2048 if 2048 in seconds else max(seconds)
    print(f"cpu_prefill_{key}_s: {seconds[key]:.2f}")


if __name__ == "__main__":
    main()
