"""Where a step's time goes on the GPU: per-step wall times by step kind, and a torch-profiler
summary (top GPU kernels and host ops) over a window of decode steps.

    python benches/profile_step.py                          # batch 1 and batch 256, async scheduling
    python benches/profile_step.py --no-async --batches 1   # the synchronous engine, batch 1

Step kinds: "decode" (one token per request, CUDA graph), "mixed" (prefill chunks, eager). The
GPU-busy fraction is the sum of kernel times over the profiled wall time; below 1 the GPU waits
for the host.
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


class ScheduleSpy:
    """Stands in for the engine's Rust scheduler and records each scheduled step's shape."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.shapes: list[tuple[int, int]] = []

    def schedule(self, **kwargs):
        so = self._inner.schedule(**kwargs)
        self.shapes.append((so.num_reqs, so.num_tokens))
        return so

    def __getattr__(self, name):
        return getattr(self._inner, name)


def run(llm, prompts, params, profile_steps: int, label: str) -> dict:
    import torch

    engine = llm.engine
    spy = ScheduleSpy(engine.scheduler)
    engine.scheduler = spy
    inner_step = engine.step
    times: list[float] = []
    prof_holder: dict = {}

    def timed_step():
        n = len(times)
        if n == 40 and profile_steps:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
            prof_holder["prof"] = prof
            prof_holder["start"] = time.perf_counter()
        start = time.perf_counter()
        out = inner_step()
        times.append((time.perf_counter() - start) * 1e3)
        if n == 40 + profile_steps - 1 and "prof" in prof_holder:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof_holder["wall"] = time.perf_counter() - prof_holder["start"]
            prof_holder["prof"].__exit__(None, None, None)
        return out

    engine.step = timed_step
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        engine.step = inner_step
        engine.scheduler = spy._inner
    decode = [t for t, (r, n) in zip(times[1:], spy.shapes[1:], strict=False) if r == n]
    mixed = [t for t, (r, n) in zip(times[1:], spy.shapes[1:], strict=False) if r != n]
    result = {
        "label": label, "elapsed_s": round(elapsed, 2), "steps": len(times),
        "decode_steps": len(decode), "decode_ms_median": round(statistics.median(decode), 3) if decode else None,
        "mixed_steps": len(mixed), "mixed_ms_median": round(statistics.median(mixed), 3) if mixed else None,
        "mixed_ms_total": round(sum(mixed), 1), "decode_ms_total": round(sum(decode), 1),
    }
    prof = prof_holder.get("prof")
    if prof is not None:
        events = prof.key_averages()
        kernel_us = sum(e.self_device_time_total for e in events if str(e.device_type).endswith("CUDA"))
        result["profiled_steps"] = profile_steps
        result["gpu_busy_fraction"] = round(kernel_us / 1e6 / prof_holder["wall"], 3)
        print(f"\n--- {label}: top GPU time ({profile_steps} steps, wall {prof_holder['wall'] * 1e3:.1f} ms)")
        print(events.table(sort_by="self_device_time_total", row_limit=18, max_name_column_width=60))
        print(f"\n--- {label}: top host time")
        print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="profile ferrox steps on the GPU")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--no-async", action="store_true")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-num-seqs", type=int, default=512, help="the engine's CUDA default")
    parser.add_argument("--quantization", choices=("fp8", "awq"), default=None,
                        help="fp8: online FP8 weights; awq: the folder declares an int4 AWQ g128 checkpoint")
    args = parser.parse_args()

    from ferrox import LLM, SamplingParams

    config = json.loads(Path(args.config).read_text())
    max_id = bench_setup.first_special_id(config)
    folder = bench_setup.make_model_dir(args.config)
    if args.quantization == "awq":
        cfg = json.loads((Path(folder) / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                      "version": "gemm"}
        (Path(folder) / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=args.max_num_seqs, async_scheduling=not args.no_async,
              quantization="fp8" if args.quantization == "fp8" else None)
    llm.generate(bench_setup.random_prompts(16, 64, max_id, seed=7),
                 SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    for batch in (int(b) for b in args.batches.split(",")):
        n, inp, out = (1, 32, 128) if batch == 1 else (batch, 256, 256)
        temp = 0.0 if batch == 1 else args.temperature
        params = SamplingParams(max_tokens=out, ignore_eos=True, temperature=temp, detokenize=False)
        run(llm, bench_setup.random_prompts(n, inp, max_id, seed=batch), params, args.profile_steps,
            f"batch {batch} ({n} x {inp} in / {out} out, {'async' if not args.no_async else 'sync'})")


if __name__ == "__main__":
    main()
