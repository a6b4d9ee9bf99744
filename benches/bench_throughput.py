"""Offline throughput, vLLM style: N prompts of random token ids, fixed input/output lengths,
`ignore_eos`, all submitted at once to `LLM.generate`.

    python benches/bench_throughput.py                                   # 1000 x (256 in, 256 out)
    python benches/bench_throughput.py --shapes 256x256,1024x128,128x1024

Prints requests/s, total tokens/s (prompt + output) and output tokens/s, and the ratio to a floor
stated here and computed from ceilings measured in the same run:

    floor time = max(compute, weight reads)
      compute      = sum over tokens of (2 * params + attention FLOPs at that token's context)
                     / bf16 matmul rate (8192^3 on random data)
      weight reads = minimum number of decode steps (ceil(N / max_num_seqs) * output_len)
                     * weight bytes / device copy bandwidth

so the floor ignores KV-cache traffic, sampling and every overhead: a ratio of 1.0 is unreachable.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        try:
            inp, out = item.lower().split("x")
            shapes.append((int(inp), int(out)))
        except ValueError:
            raise SystemExit(f"--shapes: {item!r} is not INPUTxOUTPUT (e.g. 256x256)") from None
    return shapes


def floor_seconds(config: dict, n: int, input_len: int, output_len: int, max_num_seqs: int, tflops: float,
                  copy_gbps: float, dtype_bytes: int) -> float:
    params = bench_setup.num_params(config)
    prompt_flops = n * input_len * (2 * params + bench_setup.attention_flops_per_token(config, input_len / 2))
    output_flops = n * output_len * (2 * params + bench_setup.attention_flops_per_token(config, input_len + output_len / 2))
    compute_s = (prompt_flops + output_flops) / (tflops * 1e12)
    steps = math.ceil(n / max_num_seqs) * output_len
    weights_s = steps * params * dtype_bytes / (copy_gbps * 1e9)
    return max(compute_s, weights_s)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description="ferrox offline throughput (vLLM-style)")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--shapes", default="256x256", help="comma list of INPUTxOUTPUT lengths")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=512, help="the engine's CUDA default")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=1.0, help="vLLM's benchmark samples at 1.0")
    parser.add_argument("--detokenize", action="store_true", help="also detokenize outputs (off: ids only)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    from ferrox import LLM, SamplingParams

    config = json.loads(Path(args.config).read_text())
    max_id = bench_setup.first_special_id(config)
    engine_args = dict(load_format="dummy", dtype=args.dtype, enforce_eager=args.enforce_eager, device=args.device,
                       max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    if args.max_num_batched_tokens:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model=bench_setup.make_model_dir(args.config), **engine_args)
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    tflops = bench_setup.measure_matmul_tflops() if on_gpu else float("nan")
    copy_gbps = bench_setup.measure_copy_bandwidth_gbps() if on_gpu else float("nan")
    dtype_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8

    # Warm-up: kernels compile and the allocator grows outside the timed runs.
    llm.generate(bench_setup.random_prompts(16, 64, max_id, seed=7),
                 SamplingParams(max_tokens=16, ignore_eos=True, temperature=args.temperature), use_tqdm=False)

    results = []
    for i, (input_len, output_len) in enumerate(parse_shapes(args.shapes)):
        prompts = bench_setup.random_prompts(args.num_prompts, input_len, max_id, seed=1000 + i)
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=args.temperature, top_p=1.0,
                                detokenize=args.detokenize)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if out_tokens != args.num_prompts * output_len:
            raise RuntimeError(f"expected {args.num_prompts * output_len} output tokens, got {out_tokens}")
        total = out_tokens + sum(len(o.prompt_token_ids) for o in outs)
        floor_s = (floor_seconds(config, args.num_prompts, input_len, output_len, args.max_num_seqs, tflops, copy_gbps,
                                 dtype_bytes) if on_gpu else float("nan"))
        result = {
            "benchmark": "throughput",
            **bench_setup.environment(),
            "model": Path(args.config).parent.name,
            "num_prompts": args.num_prompts,
            "input_len": input_len,
            "output_len": output_len,
            "enforce_eager": args.enforce_eager,
            "elapsed_s": round(elapsed, 2),
            "requests_per_s": round(args.num_prompts / elapsed, 2),
            "total_tokens_per_s": round(total / elapsed, 1),
            "output_tokens_per_s": round(out_tokens / elapsed, 1),
            "floor_total_tokens_per_s": round(total / floor_s, 1) if on_gpu else None,
            "ratio_to_floor": round(floor_s / elapsed, 3) if on_gpu else None,
            "matmul_tflops": round(tflops, 1),
            "copy_bandwidth_gbps": round(copy_gbps, 1),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
        print(f"Throughput {input_len}x{output_len}: {result['requests_per_s']} requests/s, "
              f"{result['total_tokens_per_s']} total tokens/s, {result['output_tokens_per_s']} output tokens/s "
              f"(floor {result['floor_total_tokens_per_s']} total tokens/s, ratio {result['ratio_to_floor']})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
