"""Long-context latency at batch 1: time to first token (TTFT) of 8k / 32k / 122k-token prompts and
the decode steps that follow at that context, through `ferrox.LLM` on the dummy Llama-3.1-8B (bf16),
against the machine's own floors and vLLM 0.26 (FlashAttention 3) on the same GPU (issue 17).

    python benches/bench_long_context.py                          # 8192, 32768, 122880; 64 decode steps
    python benches/bench_long_context.py --lengths 32768 --block-size 128

One request per length: TTFT = first_token_time - arrival_time of its RequestMetrics (the prompt
runs as chunked prefill, max_num_batched_tokens per step); the decode step is (last_token_time -
first_token_time) / decode_steps, and the median engine step over the same tokens. Prefix caching
is off, so every prompt is computed.

Floors, measured in the same run:
  prefill  (linear-layer FLOPs + causal attention FLOPs) / bf16 matmul rate (8192^3 cuBLAS)
  decode   (weight bytes without the input embedding + KV bytes at that context) / streaming-read
           bandwidth of a read-only kernel (benches/floor.py when present, else the local one here)
Prints a table, the figure last; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from bench_latency import StepTimer  # noqa: E402

# Issue 17, one H200, batch 1: (TTFT s, decode step ms); None where the issue gives no number.
VLLM_FA3 = {8192: (0.221, 5.20), 32768: (1.205, None), 122880: (9.28, 6.79)}
FERROX_BEFORE = {8192: (0.233, 4.55), 32768: (1.658, None), 122880: (16.71, 8.20)}


def read_bandwidth_gbps() -> tuple[float, str]:
    """Best streaming-read bandwidth (GB/s) and where the number comes from."""
    try:
        import floor  # benches/floor.py (the honest-floor helpers), when it exists

        return float(floor.measure_read_bandwidth_gbps()), "floor.py"
    except ImportError:
        return _local_read_bandwidth_gbps(), "local read kernel"


@triton.jit
def _read_only_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(STEPS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def _local_read_bandwidth_gbps() -> float:
    """A kernel that only reads a 4 GiB bf16 buffer (one float per program is written): the best of
    a few launch shapes, median time of each."""
    import torch

    n = 1 << 31
    x = torch.ones(n, dtype=torch.bfloat16, device="cuda")
    best = 0.0
    for block, steps, warps in ((2048, 16, 4), (4096, 8, 8), (8192, 4, 8)):
        grid = triton.cdiv(n, block * steps)
        out = torch.empty(grid, dtype=torch.float32, device="cuda")

        def read(grid=grid, out=out, block=block, steps=steps, warps=warps):
            _read_only_kernel[(grid,)](x, out, n, BLOCK=block, STEPS=steps, num_warps=warps)

        best = max(best, n * 2 / bench_setup._median_ms(read, 20) / 1e6)
    return best


def decode_bytes(config: dict[str, Any], context_len: int, batch: int = 1, dtype_bytes: int = 2,
                 kv_dtype_bytes: int | None = None) -> int:
    """Bytes one decode step must read: every weight but the input embedding (one row per token;
    a tied LM head still reads the matrix) plus the KV cache attended over (kv_dtype_bytes: 1 for an
    FP8 cache; None: dtype_bytes)."""
    kv = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    try:
        import floor

        return int(floor.decode_bytes(config, context_len, batch, dtype_bytes, kv))
    except ImportError:
        embedding = 0 if config.get("tie_word_embeddings") else config["vocab_size"] * config["hidden_size"]
        weights = (bench_setup.num_params(config) - embedding) * dtype_bytes
        return weights + batch * context_len * bench_setup.kv_bytes_per_token(config, kv)


def prefill_flops(config: dict[str, Any], prompt_len: int) -> float:
    """Linear layers over every prompt token (the LM head over the last one only) + causal attention
    (QK^T and PV over positions 0..i for token i)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    linear = 2.0 * prompt_len * (bench_setup.num_params(config) - embeddings) + 2.0 * vocab * hidden
    attention = bench_setup.attention_flops_per_token(config, 1.0) * prompt_len * (prompt_len + 1) / 2
    return linear + attention


def run_length(llm, config: dict[str, Any], length: int, decode_steps: int) -> dict[str, float]:
    from ferrox import SamplingParams

    max_id = bench_setup.first_special_id(config)
    prompt = bench_setup.random_prompts(1, length, max_id, seed=length)
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
    timer = StepTimer(llm.engine)
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
    finally:
        llm.engine.step = timer.inner
    got = len(out.outputs[0].token_ids)
    if got != decode_steps + 1:
        raise RuntimeError(f"{length}-token prompt: expected {decode_steps + 1} tokens, got {got}")
    m = out.metrics
    if m is None or m.first_token_time is None or m.last_token_time is None:
        raise RuntimeError("the request output carries no token timestamps")
    return {
        "ttft_s": m.first_token_time - m.arrival_time,
        "decode_ms": (m.last_token_time - m.first_token_time) / decode_steps * 1e3,
        "decode_step_ms_median": statistics.median(timer.times_ms[-decode_steps:]),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG), help="config.json of the dummy model")
    parser.add_argument("--lengths", default="8192,32768,122880", help="comma list of prompt lengths")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="prefill chunk (engine default)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"),
                        help="the engine's KV cache (fp8: E4M3; the decode floor then counts one byte a value)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)

    import torch
    from ferrox import LLM, SamplingParams

    if not torch.cuda.is_available():
        raise SystemExit("bench_long_context.py needs a CUDA GPU")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    config = json.loads(Path(args.config).read_text())
    max_model_len = -(-(max(lengths) + args.decode_steps + 1) // args.block_size) * args.block_size
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    # The floors first: their buffers (8 GiB) would not fit beside the engine's KV cache on an 80 GB GPU.
    matmul_tflops = bench_setup.measure_matmul_tflops()
    read_gbps, read_source = read_bandwidth_gbps()
    torch.cuda.empty_cache()  # (their buffers back to the device before the engine sizes its cache)
    llm = LLM(model=bench_setup.make_model_dir(args.config), load_format="dummy", dtype="bfloat16",
              max_model_len=max_model_len, max_num_seqs=8, enable_prefix_caching=False, block_size=args.block_size,
              kv_cache_dtype=args.kv_cache_dtype, **extra)
    # Warm-up: a two-chunk prompt compiles the prefill path (fresh chunk + chunk over context) and decode.
    warm = bench_setup.random_prompts(1, 9000, bench_setup.first_special_id(config), seed=1)
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False),
                 use_tqdm=False)

    # A length listed twice runs twice (the second run shows what the first paid once).
    results = [(length, run_length(llm, config, length, args.decode_steps)) for length in lengths]
    rows = []
    for length, r in results:
        compute_floor_s = prefill_flops(config, length) / (matmul_tflops * 1e12)
        decode_floor_ms = decode_bytes(config, length, kv_dtype_bytes=1 if args.kv_cache_dtype == "fp8" else None) / (
            read_gbps * 1e6)
        # The recorded vLLM / earlier ferrox figures are for a 16-bit cache.
        same_cache = args.kv_cache_dtype == "auto"
        vllm_ttft, vllm_decode = VLLM_FA3.get(length, (None, None)) if same_cache else (None, None)
        before_ttft, before_decode = FERROX_BEFORE.get(length, (None, None)) if same_cache else (None, None)
        rows.append({
            "benchmark": "long_context", **bench_setup.environment(), "prompt_len": length,
            "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype, "ttft_s": round(r["ttft_s"], 3), "vllm_fa3_ttft_s": vllm_ttft,
            "ferrox_before_ttft_s": before_ttft, "prefill_compute_floor_s": round(compute_floor_s, 3),
            "ttft_over_floor": round(r["ttft_s"] / compute_floor_s, 3),
            "decode_step_ms": round(r["decode_ms"], 3), "decode_step_ms_median": round(r["decode_step_ms_median"], 3),
            "vllm_fa3_decode_ms": vllm_decode, "ferrox_before_decode_ms": before_decode,
            "decode_floor_ms": round(decode_floor_ms, 3), "decode_over_floor": round(r["decode_ms"] / decode_floor_ms, 3),
            "matmul_tflops": round(matmul_tflops, 1), "read_gbps": round(read_gbps, 1), "read_source": read_source,
        })
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    r0 = rows[0]
    print(f"\n{r0['gpu']}  torch {r0['torch']}  triton {r0['triton']}  block_size {r0['block_size']}; "
          f"bf16 matmul {r0['matmul_tflops']:.0f} TFLOP/s, streaming read {r0['read_gbps'] / 1e3:.2f} TB/s "
          f"({r0['read_source']})")
    header = (f"{'prompt':>7} | {'TTFT s':>7} {'vLLM':>6} {'before':>6} {'floor':>6} {'x floor':>7} | "
              f"{'decode ms':>9} {'median':>6} {'vLLM':>5} {'before':>6} {'floor':>6} {'x floor':>7}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['prompt_len']:>7} | {r['ttft_s']:>7.3f} {_fmt(r['vllm_fa3_ttft_s'], '6.3f'):>6} "
              f"{_fmt(r['ferrox_before_ttft_s'], '6.3f'):>6} {r['prefill_compute_floor_s']:>6.3f} "
              f"{r['ttft_over_floor']:>7.2f} | {r['decode_step_ms']:>9.2f} {r['decode_step_ms_median']:>6.2f} "
              f"{_fmt(r['vllm_fa3_decode_ms'], '5.2f'):>5} {_fmt(r['ferrox_before_decode_ms'], '6.2f'):>6} "
              f"{r['decode_floor_ms']:>6.2f} {r['decode_over_floor']:>7.2f}")
    last = rows[-1]
    print(f"\n{last['prompt_len']} tokens: TTFT {last['ttft_s']:.2f} s ({last['ttft_over_floor']:.2f}x the compute floor; "
          f"vLLM FA3 {_fmt(last['vllm_fa3_ttft_s'], '.2f')} s), decode step {last['decode_step_ms']:.2f} ms "
          f"({last['decode_over_floor']:.2f}x the bandwidth floor; vLLM FA3 {_fmt(last['vllm_fa3_decode_ms'], '.2f')} ms)")


if __name__ == "__main__":
    main()
