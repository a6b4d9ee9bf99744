"""All GPU benchmarks in one go (one H200, bf16, Llama-3.1-8B config with dummy weights), a short
table last. Each benchmark runs in its own process, so start-up time is real and GPU memory is
returned between them.

    python benches/bench_gpu.py                    # latency + start-up, throughput x3, transformers peer
    python benches/bench_gpu.py --quick            # 200 prompts per throughput shape
    python benches/bench_gpu.py --kernels          # also the kernel microbenchmarks
    python benches/bench_gpu.py --peer             # (internal) only the transformers peer, prints JSON

The transformers peer is `LlamaForCausalLM.generate` (sdpa attention, greedy, exactly
max_new_tokens) on a random-weight model of the same config: batch 1 (input 32, output 128) and
one batched run (256 prompts, input 256, output 256).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_child(name: str, cmd: list[str], timeout: int, env: dict[str, str] | None = None) -> tuple[object | None, str]:
    """Run one benchmark script (with extra environment variables); returns (its --json result, error text or '')."""
    fd, out_path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run([*cmd, "--json", out_path], timeout=timeout, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    print(f"=== {name} finished in {time.perf_counter() - start:.0f} s (exit {proc.returncode})", flush=True)
    if proc.returncode != 0:
        return None, f"exit code {proc.returncode}"
    return json.loads(Path(out_path).read_text()), ""


def transformers_peer(config_path: str, batch_in: int, batch_out: int, batch_size: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_json_file(config_path)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU only for a dry run of this script
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)  # random init on the GPU, directly in bf16
    finally:
        torch.set_default_dtype(default)
    model.eval()
    max_id = bench_setup.first_special_id(json.loads(Path(config_path).read_text()))

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def timed_generate(batch: int, input_len: int, output_len: int) -> float:
        ids = torch.randint(0, max_id, (batch, input_len), device=device)
        kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
        with torch.inference_mode():
            model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                           "attention_mask": torch.ones_like(ids[:, :16])})  # warm-up
            sync()
            start = time.perf_counter()
            out = model.generate(ids, **kwargs)
            sync()
        elapsed = time.perf_counter() - start
        assert out.shape == (batch, input_len + output_len), out.shape
        return elapsed

    b1 = timed_generate(1, 32, 128)
    bn = timed_generate(batch_size, batch_in, batch_out)
    return {
        "benchmark": "transformers",
        **bench_setup.environment(),
        "batch1_e2e_s": round(b1, 3),
        "batch1_ms_per_token": round(b1 / 128 * 1e3, 3),
        "batched": f"{batch_size} x ({batch_in} in, {batch_out} out)",
        "batched_total_tokens_per_s": round(batch_size * (batch_in + batch_out) / bn, 1),
        "batched_output_tokens_per_s": round(batch_size * batch_out / bn, 1),
    }


def _f(value: object, spec: str = ".2f") -> str:
    """Formats a number; None / NaN (CPU dry runs, failed parts) print as n/a."""
    if not isinstance(value, (int, float)) or value != value:
        return "n/a"
    return format(value, spec)


def table(results: dict[str, object], errors: dict[str, str]) -> str:
    lat = results.get("latency") or {}
    thr = results.get("throughput") or []
    peer = results.get("transformers") or {}
    env = lat or (thr[0] if thr else peer) or {}
    lines = [f"ferrox GPU benchmarks — {env.get('date', '?')}, {env.get('gpu', '?')}, torch {env.get('torch', '?')}, "
             f"triton {env.get('triton', '?')}; Llama-3.1-8B config, dummy weights, bf16", "",
             "| metric | ferrox | target / reference |", "| --- | --- | --- |"]
    unfused = results.get("latency_unfused") or {}
    if lat:
        if unfused:
            lines.append(
                f"| same, one-token kernels off (FERROX_FUSED_DECODE=0) | {_f(unfused['decode_step_ms_median'])} ms | "
                f"fused is {unfused['decode_step_ms_median'] / lat['decode_step_ms_median']:.3f}x faster |")
        lines += [
            f"| decode step, batch 1, in 32 / out 128 (median) | {_f(lat['decode_step_ms_median'])} ms | "
            f"honest floor {_f(lat.get('honest_floor_ms'))} ms ({lat.get('bytes_read_gb')} GB read at "
            f"{_f(lat.get('read_bandwidth_gbps', math.nan) / 1e3)} TB/s streaming), ratio "
            f"**{_f(lat.get('step_over_honest_floor'))}x** (target <= 1.15x); "
            f"copy floor {_f(lat.get('copy_floor_ms'))} ms "
            f"({lat.get('weight_gb')} GB at {_f(lat.get('copy_bandwidth_gbps', math.nan) / 1e3)} TB/s copy), ratio "
            f"{_f(lat.get('step_over_copy_floor'))}x |",
            f"| start-up to ready / first token | {_f(lat['startup_ready_s'], '.1f')} s / "
            f"{_f(lat['startup_first_token_s'], '.1f')} s (CUDA graph capture {_f(lat.get('cuda_graph_capture_s'), '.1f')} s)"
            " | target <= 30 s |",
        ]
    for r in thr:
        target = " (target >= 30,000; vLLM H100 22,728)" if (r["input_len"], r["output_len"]) == (256, 256) else ""
        lines.append(
            f"| throughput {r['num_prompts']} x ({r['input_len']} in, {r['output_len']} out) | "
            f"{_f(r['total_tokens_per_s'], ',.0f')} total tok/s, {_f(r['output_tokens_per_s'], ',.0f')} out tok/s, "
            f"{r['requests_per_s']} req/s | floor {_f(r['floor_total_tokens_per_s'], ',.0f')} tok/s, "
            f"ratio {_f(r['ratio_to_floor'])}{target} |")
    if peer:
        line = f"| transformers batch 1 (in 32 / out 128) | {_f(peer['batch1_ms_per_token'])} ms/token |"
        if lat:
            line += f" ferrox decode step is {peer['batch1_ms_per_token'] / lat['decode_step_ms_median']:.1f}x faster |"
        lines.append(line)
        line = f"| transformers batched {peer['batched']} | {_f(peer['batched_total_tokens_per_s'], ',.0f')} total tok/s |"
        match = [r for r in thr if (r["input_len"], r["output_len"]) == (256, 256)]
        if match:
            line += f" ferrox / transformers = {match[0]['total_tokens_per_s'] / peer['batched_total_tokens_per_s']:.1f}x |"
        lines.append(line)
    for name, err in errors.items():
        lines.append(f"| {name} | FAILED: {err} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="run every ferrox GPU benchmark and print a table")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--quick", action="store_true", help="200 prompts per throughput shape instead of 1000")
    parser.add_argument("--num-prompts", type=int, default=None, help="override the throughput prompt count")
    parser.add_argument("--shapes", default="256x256,1024x128,128x1024")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kernels", action="store_true", help="also run benches/bench_kernels.py")
    parser.add_argument("--skip", default="", help="comma list of: latency,throughput,transformers")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.peer:
        batch = 256 if args.num_prompts is None else args.num_prompts
        result = transformers_peer(args.config, 256, 256, batch)
        print(json.dumps(result, indent=1))
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        return

    py = sys.executable
    eager = ["--enforce-eager"] if args.enforce_eager else []
    skip = set(filter(None, args.skip.split(",")))
    jobs = [
        ("latency", [py, str(HERE / "bench_latency.py"), "--config", args.config, *eager], 600),
        # The same run without the one-token fused kernels (kernels/gemv.py): the side-by-side ratio.
        ("latency_unfused", [py, str(HERE / "bench_latency.py"), "--config", args.config, *eager], 600),
        ("throughput", [py, str(HERE / "bench_throughput.py"), "--config", args.config, "--shapes", args.shapes,
                        "--num-prompts", str(args.num_prompts or (200 if args.quick else 1000)), *eager], 1800),
        ("transformers", [py, str(HERE / "bench_gpu.py"), "--peer", "--config", args.config,
                          *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])], 900),
    ]
    results: dict[str, object] = {}
    errors: dict[str, str] = {}
    for name, cmd, timeout in jobs:
        if name in skip or (name == "latency_unfused" and "latency" in skip):
            continue
        env = {"FERROX_FUSED_DECODE": "0"} if name == "latency_unfused" else None
        result, err = run_child(name, cmd, timeout, env)
        if err:
            errors[name] = err
        else:
            results[name] = result
    if args.kernels:
        subprocess.run([py, str(HERE / "bench_kernels.py")], timeout=900)
    text = table(results, errors)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gpu.json").write_text(json.dumps(results, indent=1))
        Path(os.environ["OUT"], "bench_gpu_table.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
