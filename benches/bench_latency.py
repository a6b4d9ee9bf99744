"""Decode latency at batch 1 against the memory-bandwidth floor, plus start-up time.

    python benches/bench_latency.py                      # Llama-3.1-8B dummy weights, bf16, input 32, output 128
    python benches/bench_latency.py --enforce-eager      # without CUDA graphs

Each engine step is timed on the host (a step ends when its sampled tokens reach the CPU, so the
wall time is the GPU time plus any gap between steps). Two floors (benches/floor.py), both with
bandwidths measured in this run: the honest one first -- the bytes a step must read (weights
without the input embedding, plus the KV it attends at the run's mean context) over the best
streaming-read bandwidth -- then the older copy floor (every weight byte over device-to-device
copy bandwidth). Start-up is measured from process start (interpreter and imports included) to a
ready `LLM` and to the first generated token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402


class StepTimer:
    """Wraps EngineCore.step and records each call's wall time (ms)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.inner = engine.step
        self.times_ms: list[float] = []
        engine.step = self

    def __call__(self):
        start = time.perf_counter()
        out = self.inner()
        self.times_ms.append((time.perf_counter() - start) * 1e3)
        return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="ferrox decode latency (batch 1) vs the bandwidth floor")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG), help="config.json of the dummy model")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=5, help="timed generate calls")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)

    import torch
    from ferrox import LLM, SamplingParams

    config = json.loads(Path(args.config).read_text())
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    # The floors' bandwidths first: their 8 GiB buffers do not fit beside an engine that took 90% of an
    # 80 GB card. Their time is taken off the start-up figures below.
    measured_at = time.perf_counter()
    read_gbps = floor.measure_read_bandwidth_gbps() if on_gpu else None
    copy_gbps = bench_setup.measure_copy_bandwidth_gbps() if on_gpu else None
    if on_gpu:
        torch.cuda.empty_cache()
    measuring_s = time.perf_counter() - measured_at
    model_dir = bench_setup.make_model_dir(args.config)
    llm = LLM(model=model_dir, load_format="dummy", dtype=args.dtype, enforce_eager=args.enforce_eager,
              max_model_len=args.max_model_len, max_num_seqs=max(8, args.batch_size), device=args.device)
    ready_s = bench_setup.process_age_seconds() - measuring_s
    max_id = bench_setup.first_special_id(config)
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, args.input_len, max_id, seed=1), SamplingParams(max_tokens=1, **greedy),
                 use_tqdm=False)
    first_token_s = bench_setup.process_age_seconds() - measuring_s

    # Warm-up at the measured shape (kernel compilation, allocator growth), then timed runs.
    params = SamplingParams(max_tokens=args.output_len, **greedy)
    llm.generate(bench_setup.random_prompts(args.batch_size, args.input_len, max_id, seed=2), params, use_tqdm=False)
    timer = StepTimer(llm.engine)
    decode_ms: list[float] = []
    e2e_s: list[float] = []
    for i in range(args.num_iters):
        prompts = bench_setup.random_prompts(args.batch_size, args.input_len, max_id, seed=100 + i)
        timer.times_ms.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        e2e_s.append(time.perf_counter() - start)
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [args.output_len] * args.batch_size:
            raise RuntimeError(f"expected {args.output_len} tokens per request, got {got}")
        decode_ms.extend(timer.times_ms[1:])  # the first step is the prefill

    dtype_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8
    # The decode steps attend over input_len + 1 .. input_len + output_len - 1 positions: their mean.
    context = args.input_len + args.output_len // 2
    floors = (floor.floors(config, context, args.batch_size, dtype_bytes=dtype_bytes, read_gbps=read_gbps,
                           copy_gbps=copy_gbps) if on_gpu else {})
    honest_ms, copy_ms = floors.get("honest_floor_ms", float("nan")), floors.get("copy_floor_ms", float("nan"))
    step_ms = statistics.median(decode_ms)
    result = {
        "benchmark": "latency",
        **bench_setup.environment(),
        "model": Path(args.config).parent.name,
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "enforce_eager": args.enforce_eager,
        "startup_ready_s": round(ready_s, 2),
        "startup_first_token_s": round(first_token_s, 2),
        "cuda_graph_capture_s": getattr(llm.engine, "cuda_graph_capture_s", None),
        "decode_step_ms_median": round(step_ms, 3),
        "decode_step_ms_p90": round(sorted(decode_ms)[int(0.9 * (len(decode_ms) - 1))], 3),
        "e2e_latency_s_median": round(statistics.median(e2e_s), 3),
        **floors,  # honest floor (bytes a step reads / streaming-read bandwidth) first, then the copy floor
        "step_over_honest_floor": round(step_ms / honest_ms, 3) if on_gpu else None,
        "step_over_copy_floor": round(step_ms / copy_ms, 3) if on_gpu else None,
    }
    print(json.dumps(result, indent=1))
    print(f"\nbatch {args.batch_size}, input {args.input_len}, output {args.output_len}: median decode step "
          f"{step_ms:.2f} ms; honest floor {honest_ms:.2f} ms ({floors.get('bytes_read_gb')} GB read at "
          f"{floors.get('read_bandwidth_gbps', float('nan')) / 1e3:.2f} TB/s), ratio {result['step_over_honest_floor']}; "
          f"copy floor {copy_ms:.2f} ms ({floors.get('weight_gb')} GB at "
          f"{floors.get('copy_bandwidth_gbps', float('nan')) / 1e3:.2f} TB/s), ratio {result['step_over_copy_floor']}; "
          f"start-up {ready_s:.1f} s to ready, {first_token_s:.1f} s to first token")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
