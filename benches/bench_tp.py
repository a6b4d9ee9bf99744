"""Tensor parallelism on one host's GPUs: batch-1 decode step against the per-GPU weight-read
floor, 1000 x (256, 256) throughput, and start-up time, for TP sizes side by side in one run.

    python benches/bench_tp.py                                   # 8B: TP=1 and TP=2; 70B: TP=2
    python benches/bench_tp.py --runs 8b:1,8b:2 --num-prompts 200

Each (model, TP) runs in its own process (start-up time is real; GPU memory returns between runs).
Floors of a batch-1 decode step, per GPU (benches/floor.py, bandwidths measured in the same
process): the honest one first -- the rank's share of the bytes a step must read (weights without
the input embedding, plus the KV it attends) over the best streaming-read bandwidth -- then the
older copy floor (the rank's share of all weight bytes over device-to-device copy bandwidth). The
figure printed last is the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = {"8b": HERE / "configs" / "llama-3.1-8b" / "config.json",
           "70b": HERE / "configs" / "llama-3.1-70b" / "config.json"}


def _phase(name: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {name}", flush=True)


def child(args: argparse.Namespace) -> dict:
    import faulthandler

    faulthandler.dump_traceback_later(args.stack_dump_s, exit=False)
    from ferrox import LLM, SamplingParams

    folder = bench_setup.make_model_dir(CONFIGS[args.model])
    config = json.loads(Path(CONFIGS[args.model]).read_text())
    _phase("starting the engine")
    llm = LLM(model=folder, load_format="dummy", tensor_parallel_size=args.tp, max_model_len=4096,
              max_num_seqs=512)
    startup_s = bench_setup.process_age_seconds()  # interpreter + imports + every rank's load and capture
    max_id = bench_setup.first_special_id(config) - 1
    prompt = bench_setup.random_prompts(1, 32, max_id)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=129, temperature=0.0, ignore_eos=True)
    _phase("batch-1 decode")
    llm.generate(prompt, many, use_tqdm=False)  # warm-up
    t1s, t129s = [], []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompt, one, use_tqdm=False)
        t1s.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate(prompt, many, use_tqdm=False)
        t129s.append(time.perf_counter() - t)
    step_ms = (min(t129s) - min(t1s)) / 128 * 1e3
    prompts = bench_setup.random_prompts(args.num_prompts, 256, max_id, seed=1)
    sp = SamplingParams(max_tokens=256, temperature=1.0, ignore_eos=True)
    _phase("throughput")
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # The timed steps attend over 33..160 positions (prompt 32, 129 tokens): their mean, 96.
    floors = floor.floors(config, 32 + 64, 1, tp=args.tp)
    return {"model": args.model, "tp": args.tp, "startup_s": startup_s, "step_ms": step_ms, **floors,
            "throughput_tok_s": out_tokens / elapsed, "num_prompts": args.num_prompts, "elapsed_s": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="8b:1,8b:2,70b:2", help="comma list of MODEL:TP")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="8b", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--stack-dump-s", type=float, default=600, help="dump every thread's stack if still "
                        "running after this many seconds (diagnosing a stuck run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        result = child(args)
        Path(args.json).write_text(json.dumps(result))
        os._exit(0)  # the engine's ranks stop with this process (no teardown to wait for)
    rows = []
    for run in args.runs.split(","):
        model, tp = run.split(":")
        fd, out = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [sys.executable, __file__, "--child", "--model", model, "--tp", tp, "--num-prompts",
               str(args.num_prompts), "--stack-dump-s", str(args.stack_dump_s), "--json", out]
        print(f"=== {model} TP={tp}", flush=True)
        proc = subprocess.run(cmd)
        if proc.returncode == 0 and Path(out).stat().st_size:
            rows.append(json.loads(Path(out).read_text()))
            print(json.dumps(rows[-1]), flush=True)
        else:
            print(f"=== {model} TP={tp} failed (exit {proc.returncode})", flush=True)
    print(json.dumps(bench_setup.environment()))
    base = {r["model"]: r for r in rows if r["tp"] == 1}
    print("| model | TP | start-up s | decode step ms | honest floor ms (per GPU) | step / honest floor "
          "| copy floor ms (per GPU) | step / copy floor | 1000x(256,256) tok/s | vs TP=1 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ref = base.get(r["model"])
        speedup = f"{r['throughput_tok_s'] / ref['throughput_tok_s']:.2f}x" if ref and ref is not r else ""
        print(f"| {r['model']} | {r['tp']} | {r['startup_s']:.1f} | {r['step_ms']:.2f} | {r['honest_floor_ms']:.2f} "
              f"| {r['step_ms'] / r['honest_floor_ms']:.2f} | {r['copy_floor_ms']:.2f} "
              f"| {r['step_ms'] / r['copy_floor_ms']:.2f} | {r['throughput_tok_s']:.0f} | {speedup} |")


if __name__ == "__main__":
    main()
