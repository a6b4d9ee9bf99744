"""The effective cost of each kernel in a batch-1 decode step.

Under programmatic dependent launch (kernels/pdl.py) the one-token kernels start while the
previous one drains, so a profiler's kernel durations overlap and add up to more than the step.
What each kernel costs the step is the time between the end of the kernel before it and its own
end, in stream order: that is what this prints, per kernel name and grid, per decode step.

    python benches/profile_chain.py                       # Llama-3.1-8B dummy, bf16
    python benches/profile_chain.py --moe qwen3-30b-a3b    # bench_moe.py's config
    python benches/profile_chain.py --quantization fp8

Gaps over --gap-us (the lm_head's ~240 us, host gaps between steps) are counted apart. The figure
printed last is the sum of the per-step effective costs.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description="effective per-kernel cost of batch-1 decode steps")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--moe", default=None, help="a bench_moe.py config name instead of --config")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--steps", type=int, default=40, help="tokens generated in the profiled run")
    parser.add_argument("--gap-us", type=float, default=200.0)
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()

    import torch
    from ferrox import LLM, SamplingParams

    folder, max_id = bench_setup.dummy_model_dir(args.config, args.moe)
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16",
              max_model_len=4096, quantization=args.quantization)
    prompts = bench_setup.random_prompts(1, 32, max_id, seed=1)
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=0.0, detokenize=False)
    for _ in range(2):
        llm.generate(prompts, params, use_tqdm=False)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    trace = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"] + e["dur"])
    ends = [e["ts"] + e["dur"] for e in events]
    effective: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    gaps: list[float] = []
    for i in range(1, len(events)):
        cost = ends[i] - ends[i - 1]
        if cost > args.gap_us:
            gaps.append(cost)
            continue
        effective[(events[i]["name"][:44], str(events[i].get("args", {}).get("grid", "")))].append(cost)
    steps = args.steps - 1  # decode steps (the first is the prefill, whose kernels are listed too)
    print(f"{'kernel':44s} {'grid':16s} {'per step':>8s} {'us each':>8s} {'us / step':>10s}")
    for (name, grid), costs in sorted(effective.items(), key=lambda kv: -sum(kv[1]))[: args.rows]:
        print(f"{name:44s} {grid:16s} {len(costs) / steps:8.1f} {sum(costs) / len(costs):8.2f} "
              f"{sum(costs) / steps:10.1f}")
    print(f"gaps over {args.gap_us:.0f} us: {len(gaps)} ({sum(gaps) / 1e3:.2f} ms; the lm_head is one a step)")
    total = sum(sum(c) for c in effective.values()) / steps / 1e3
    print(f"sum of effective costs below the gap bound: {total:.3f} ms a decode step")


if __name__ == "__main__":
    main()
