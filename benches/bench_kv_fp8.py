"""FP8 KV cache on one GPU: the tokens the cache holds and the decode step at long context, bf16
cache ("auto") against kv_cache_dtype="fp8", on the dummy Llama-3.1-8B (bf16 weights).

    python benches/bench_kv_fp8.py                        # 32 requests x 8192-token contexts, 64 decode steps
    python benches/bench_kv_fp8.py --batch 16 --context 16384 --gpu-memory-utilization 0.85

For each cache dtype one engine is built at the same gpu_memory_utilization (same profiled budget)
and torn down before the next:
  KV tokens   the cache's capacity (EngineCore.kv_capacity_tokens): the target is 2x for fp8.
  decode      `batch` prompts of `context` random tokens (prefix caching off) prefill, then decode;
              the step time is the median of the last engine steps, when every request decodes
              (CUDA graphs), against the honest floor: weight bytes without the input embedding +
              the K/V bytes the step attends (1 byte per element for fp8), over the streaming-read
              bandwidth measured in the same run (benches/floor.py).
Prints a table, the figure last; --json writes the rows. Needs a CUDA GPU (< 5 min on an H200).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402
from bench_latency import StepTimer  # noqa: E402

CACHE_DTYPES = ("auto", "fp8")
KV_BYTES = {"auto": 2, "fp8": 1}  # per K/V element: bf16 / float8_e4m3fn


def run_cache_dtype(model_dir: str, config: dict[str, Any], kv_cache_dtype: str, args: argparse.Namespace
                    ) -> dict[str, float]:
    from ferrox import LLM, SamplingParams

    max_model_len = -(-(args.context + args.decode_steps + 1) // 16) * 16
    llm = LLM(model=model_dir, load_format="dummy", dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=max_model_len,
              max_num_seqs=args.batch, enable_prefix_caching=False)
    try:
        capacity = int(llm.engine.kv_capacity_tokens)
        prompts = bench_setup.random_prompts(args.batch, args.context, bench_setup.first_special_id(config), seed=7)
        params = SamplingParams(max_tokens=args.decode_steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
        timer = StepTimer(llm.engine)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.engine.step = timer.inner
        if any(len(o.outputs[0].token_ids) != args.decode_steps + 1 for o in outs):
            raise RuntimeError("a request ended early")
        # The last steps: every request past its prefill, one token each (the graphed decode step).
        tail = timer.times_ms[-max(1, args.decode_steps * 3 // 4):]
        return {"kv_tokens": capacity, "decode_step_ms": statistics.median(tail)}
    finally:
        bench_setup.release_engine(llm)
        del llm


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG), help="config.json of the dummy model")
    parser.add_argument("--batch", type=int, default=32, help="requests decoding together")
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens per request")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_kv_fp8.py needs a CUDA GPU")
    config = json.loads(Path(args.config).read_text())
    model_dir = bench_setup.make_model_dir(args.config)
    results = {dtype: run_cache_dtype(model_dir, config, dtype, args) for dtype in CACHE_DTYPES}
    read_gbps = floor.measure_read_bandwidth_gbps()
    # Attended K/V at the median decode step: each request holds its prompt plus about half the outputs.
    context = args.context + args.decode_steps // 2
    rows = []
    for dtype, r in results.items():
        weights = floor.weight_bytes_read(config, args.batch)
        kv = floor.kv_bytes_read(config, context, args.batch, KV_BYTES[dtype])
        floor_ms = (weights + kv) / (read_gbps * 1e6)
        rows.append({
            "benchmark": "kv_fp8", **bench_setup.environment(), "kv_cache_dtype": dtype, "batch": args.batch,
            "context": args.context, "gpu_memory_utilization": args.gpu_memory_utilization,
            "kv_tokens": r["kv_tokens"], "kv_tokens_vs_auto": round(r["kv_tokens"] / results["auto"]["kv_tokens"], 3),
            "decode_step_ms": round(r["decode_step_ms"], 3), "decode_floor_ms": round(floor_ms, 3),
            "decode_over_floor": round(r["decode_step_ms"] / floor_ms, 3),
            "speedup_vs_auto": round(results["auto"]["decode_step_ms"] / r["decode_step_ms"], 3),
            "read_gbps": round(read_gbps, 1),
        })
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    print(f"\n{r0['gpu']}  torch {r0['torch']}  triton {r0['triton']}; dummy Llama-3.1-8B bf16 weights, "
          f"gpu_memory_utilization {r0['gpu_memory_utilization']}, streaming read {r0['read_gbps'] / 1e3:.2f} TB/s; "
          f"decode step of {r0['batch']} requests at {r0['context']} tokens of context")
    header = (f"{'kv cache':>8} | {'KV tokens':>10} {'x auto':>6} | {'step ms':>7} {'floor':>6} {'x floor':>7} "
              f"{'speedup':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['kv_cache_dtype']:>8} | {r['kv_tokens']:>10} {r['kv_tokens_vs_auto']:>6.2f} | "
              f"{r['decode_step_ms']:>7.2f} {r['decode_floor_ms']:>6.2f} {r['decode_over_floor']:>7.2f} "
              f"{r['speedup_vs_auto']:>7.2f}")
    fp8 = rows[-1]
    print(f"\nfp8 KV cache: {fp8['kv_tokens_vs_auto']:.2f}x the tokens of the bf16 cache at the same memory; "
          f"{fp8['batch']}x{fp8['context']} decode step {fp8['decode_step_ms']:.2f} ms vs "
          f"{r0['decode_step_ms']:.2f} ms ({fp8['speedup_vs_auto']:.2f}x faster, {fp8['decode_over_floor']:.2f}x "
          f"its floor)")


if __name__ == "__main__":
    main()
