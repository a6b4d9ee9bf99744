"""CPU engine benchmark: ferrox vs transformers on the embedded SmolLM2-135M, float32, one process.

    .venv/bin/python benches/bench_cpu.py [--tokens 128] [--batch 16] [--threads N] [--skip-hf-batch]

Measures (greedy, ignore_eos, every request produces exactly --tokens new tokens):
- single stream: one request, output tokens/s (wall time of the whole generate call);
- batch: --batch concurrent requests, aggregate output tokens/s.
transformers runs `generate` on the same GGUF file (batch with left padding).
Prints a table, then `cpu_batch16_over_single: <ferrox batch / ferrox single>` and, last,
`cpu_single_stream_ratio: <ferrox single / transformers single>`.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

PROMPT = "Hello, my name is"
BATCH_PROMPTS = [
    "Hello, my name is", "The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,",
    "Once upon a time", "def fibonacci(n):", "The three primary colors are", "The quick brown fox",
    "Python is a programming language that", "My favourite season is autumn because",
    "A list of fruits: apple, banana,", "Translate to French: I like apples.", "In the year 2050,",
    "The best way to learn is", "Dear diary, today", "import numpy as np\n",
]


def bench_ferrox(tokens: int, batch: int, threads: int) -> tuple[float, float]:
    from ferrox import LLM, SamplingParams

    llm = LLM(kv_cache_memory=512 << 20, num_threads=threads)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    llm.generate(BATCH_PROMPTS[:batch], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    single = len(out.outputs[0].token_ids) / (time.perf_counter() - t)
    prompts = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(batch)]
    llm.reset_prefix_cache()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    aggregate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    return single, aggregate


def bench_transformers(tokens: int, batch: int, skip_batch: bool) -> tuple[float, float | None]:
    from ferrox.loader.source import resolve_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(resolve_model(None).path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32).eval()
    kw = dict(do_sample=False, max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        ids = tok(PROMPT, return_tensors="pt")
        model.generate(**ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        t = time.perf_counter()
        out = model.generate(**ids, **kw)
        single = (out.shape[1] - ids["input_ids"].shape[1]) / (time.perf_counter() - t)
        if skip_batch:
            return single, None
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        prompts = [BATCH_PROMPTS[i % len(BATCH_PROMPTS)] for i in range(batch)]
        enc = tok(prompts, return_tensors="pt", padding=True)
        t = time.perf_counter()
        out = model.generate(**enc, **kw)
        aggregate = batch * (out.shape[1] - enc["input_ids"].shape[1]) / (time.perf_counter() - t)
    return single, aggregate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: all cores)")
    ap.add_argument("--skip-hf-batch", action="store_true", help="skip transformers' batched generate")
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)

    f_single, f_batch = bench_ferrox(args.tokens, args.batch, threads)
    torch.set_num_threads(threads)
    h_single, h_batch = bench_transformers(args.tokens, args.batch, args.skip_hf_batch)

    print(f"\nCPU, float32, SmolLM2-135M-Instruct (embedded GGUF), {threads} threads, {args.tokens} new tokens, greedy")
    print(f"| {'engine':<12} | {'single stream tok/s':>19} | {f'batch {args.batch} aggregate tok/s':>26} |")
    print(f"|{'-' * 14}|{'-' * 21}|{'-' * 28}|")
    print(f"| {'ferrox':<12} | {f_single:>19.1f} | {f_batch:>26.1f} |")
    hb = f"{h_batch:.1f}" if h_batch is not None else "skipped"
    print(f"| {'transformers':<12} | {h_single:>19.1f} | {hb:>26} |")
    print(f"cpu_batch{args.batch}_over_single: {f_batch / f_single:.2f}")
    print(f"cpu_single_stream_ratio: {f_single / h_single:.2f}")


if __name__ == "__main__":
    main()
