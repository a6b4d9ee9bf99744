"""Time to first token of short prompts (the eager prefill step, host launches included) and the
device ops one short prefill issues: where a model's eager path waits on the host.

    python benches/bench_short_ttft.py --config benches/configs/llama-3.1-8b/config.json
    python benches/bench_short_ttft.py --moe qwen3-30b-a3b            # bench_moe.py's config

Each length: `generate` with max_tokens=1, six prompts, the median of the last five. The figure
printed last is the shortest prompt's TTFT.
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


def main() -> None:
    parser = argparse.ArgumentParser(description="short-prompt TTFT on dummy weights")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--moe", default=None, help="a bench_moe.py config name instead of --config")
    parser.add_argument("--lengths", default="32,256,1024,4096")
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()

    import torch
    from ferrox import LLM, SamplingParams

    folder, max_id = bench_setup.dummy_model_dir(args.config, args.moe)
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16",
              max_model_len=args.max_model_len)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0, detokenize=False)
    lengths = [int(n) for n in args.lengths.split(",")]
    ttft: dict[int, float] = {}
    for n in lengths:
        times = []
        for rep in range(6):
            prompts = bench_setup.random_prompts(1, n, max_id, seed=100 + rep + n)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        ttft[n] = statistics.median(times[1:])
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    with prof:
        llm.generate(bench_setup.random_prompts(1, lengths[0], max_id, seed=5), one, use_tqdm=False)
        torch.cuda.synchronize()
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in device_events) / 1e3
    print(json.dumps({"ttft_ms": {str(n): round(ms, 1) for n, ms in ttft.items()},
                      "short_prefill_device_ops": len(device_events), "short_prefill_gpu_ms": round(gpu_ms, 2)}))
    print("TTFT ms: " + ", ".join(f"{n} tokens {ms:.1f}" for n, ms in ttft.items())
          + f"; a {lengths[0]}-token prefill issues {len(device_events)} device ops ({gpu_ms:.2f} ms of GPU time); "
          f"short-prompt TTFT {ttft[lengths[0]]:.1f} ms")


if __name__ == "__main__":
    main()
