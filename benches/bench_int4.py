"""int4 AWQ decode on one GPU: Llama-3.1-8B with dummy AWQ weights (group 128) against its int4 read
floor and against the bf16 dummy model, plus the int4 kernels (kernels/int4_matmul.py) at the
model's projection shapes. Prints a table, the figure last.

    PYTHONPATH=python python benches/bench_int4.py             # ~4 min on an H200
    PYTHONPATH=python python benches/bench_int4.py --sweep     # plus GEMV launch configs per shape
    PYTHONPATH=python python benches/bench_int4.py --skip-decode --json out.json

Decode: each model runs in its own process (each takes the GPU's memory for its KV cache), with
CUDA graphs, batch 1 (--batch B: B requests at once), 32 prompt tokens, 128 generated; the engine step is timed on the host as in
bench_latency.py (median over the decode steps of 5 runs). The int4 floor is the bytes a step must
read over the streaming-read bandwidth measured here (floor.py): the packed weights (half a byte
each), one fp16 scale and one 4-bit zero per group of 128 (the checkpoint's 2.5 bytes; ferrox keeps
the zero in a byte, +0.4%), the bf16 norms and LM head, and the bf16 KV at the run's mean context.
The input embedding is a row gather, as in floor.py.

Kernels: every timing replays a CUDA graph over enough weight copies (>= 2 GB) that they stream
from HBM, as in bench_gemv.py. Per projection, batch 1: the int4 GEMV (us, and its packed bytes over
that time), bf16 cuBLAS and ferrox's bf16 gemv. Then, for gate_up, the three int4 paths and bf16
cuBLAS across batch sizes: where the GEMV, the GEMM and dequantize + cuBLAS cross over
(int4_matmul.GEMV_MAX_M is set from this; DEQUANT_MIN_M from a whole layer's four products in
bench_weight_only_gemm.py).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402

GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BATCHES = (1, 2, 4, 8, 16, 64, 256, 1024, 4096)


# ---- bytes -----------------------------------------------------------------------------------------
def linear_params(config: dict[str, Any]) -> int:
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    return layers * (hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * inter)


def int4_decode_bytes(config: dict[str, Any], context_len: int, group: int = GROUP) -> int:
    """What a batch-1 step reads with int4 projections: floor.py's bf16 bytes with every projection
    weight replaced by half a byte plus 2.5 bytes per group (fp16 scale, 4-bit zero)."""
    params = linear_params(config)
    other = floor.weight_bytes_read(config, 1, 2) - 2 * params  # norms, LM head (bf16)
    return int(params / 2 + params / group * 2.5 + other + floor.kv_bytes_read(config, context_len, 1, 2))


# ---- decode (one process per model) -------------------------------------------------------------------
def decode_child(variant: str, config_path: str, out: str, input_len: int, output_len: int, iters: int,
                 batch: int = 1) -> None:
    from ferrox import LLM, SamplingParams

    config = json.loads(Path(config_path).read_text())
    folder = bench_setup.make_model_dir(config_path, quantization_config=bench_setup.AWQ_INT4_G128
                                        if variant == "int4" else None)
    start = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=max(8, batch))
    ready_s = time.perf_counter() - start
    max_id = bench_setup.first_special_id(config)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, input_len, max_id, seed=1), params, use_tqdm=False)  # warm
    engine = llm.engine
    inner = engine.step
    times: list[float] = []

    def timed_step():
        t0 = time.perf_counter()
        result = inner()
        times.append((time.perf_counter() - t0) * 1e3)
        return result

    engine.step = timed_step
    decode_ms: list[float] = []
    for i in range(iters):
        times.clear()
        outs = llm.generate(bench_setup.random_prompts(batch, input_len, max_id, seed=100 + i), params,
                            use_tqdm=False)
        if any(len(o.outputs[0].token_ids) != output_len for o in outs):
            raise RuntimeError(f"{variant}: expected {output_len} tokens for each of {batch} prompts")
        decode_ms.extend(times[1:])  # the first step is the prefill
    Path(out).write_text(json.dumps({"variant": variant, "ready_s": round(ready_s, 1),
                                     "decode_step_ms": statistics.median(decode_ms),
                                     "decode_step_ms_p90": sorted(decode_ms)[int(0.9 * (len(decode_ms) - 1))]}))


def run_decode(variant: str, args) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", variant, "--json", f.name, "--config", args.config,
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--iters", str(args.iters),
               "--batch", str(args.batch)]
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


# ---- kernels -----------------------------------------------------------------------------------------
def int4_copies(n: int, k: int, total_bytes: float = 2e9):
    """Distinct random int4 weights of [n, k] (group 128), as many as fill total_bytes."""
    import torch
    from ferrox.kernels.int4_matmul import Int4Weights, interleave_words

    t = interleave_words(k, GROUP)
    copies = max(2, math.ceil(total_bytes / (n * k / 2)))
    out = []
    for _ in range(copies):
        packed = torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int64, device="cuda").to(torch.int32)
        scales = (0.002 + 0.004 * torch.rand(n, k // GROUP, device="cuda")).half()
        zeros = torch.full((n, k // GROUP), 8, dtype=torch.uint8, device="cuda")
        out.append(Int4Weights(packed, scales, zeros, GROUP, t))
    return out


def int4_bytes(w) -> int:
    return w.packed.numel() * 4 + w.scales.numel() * 2 + w.zeros.numel()


def kernels(rows: dict[str, Any], sweep: bool, read_gbps: float) -> None:
    import torch
    import torch.nn.functional as F
    from bench_gemv import graph_ms  # the same CUDA-graph timing as the bf16 GEMV sweep
    from ferrox.kernels import int4_matmul as km
    from ferrox.kernels.gemv import gemv

    dtype = torch.bfloat16
    for name, (n, k) in SHAPES.items():
        ws = int4_copies(n, k)
        x = torch.randn(1, k, device="cuda", dtype=dtype)
        int4_ms = graph_ms([partial(km.int4_gemv, x, w) for w in ws])
        del ws
        bf = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(max(2, math.ceil(2e9 / (n * k * 2))))]
        cublas_ms = graph_ms([partial(F.linear, x, w) for w in bf])
        gemv_ms = graph_ms([partial(gemv, x, w) for w in bf])
        del bf
        nbytes = n * k / 2 + n * (k // GROUP) * 3
        rows.setdefault("gemv", []).append(dict(
            shape=name, n=n, k=k, int4_us=round(int4_ms * 1e3, 1), int4_tbps=round(nbytes / int4_ms / 1e9, 2),
            int4_over_read_floor=round(int4_ms / (nbytes / read_gbps / 1e6), 2),
            bf16_cublas_us=round(cublas_ms * 1e3, 1), bf16_gemv_us=round(gemv_ms * 1e3, 1),
            speedup_vs_bf16_gemv=round(gemv_ms / int4_ms, 2)))
        print(rows["gemv"][-1], flush=True)
        if sweep:
            ws = int4_copies(n, k)
            results = []
            for block_n in (2, 4, 8, 16):
                for warps in (1, 2, 4):
                    cfg = km.GemvConfig(block_n, warps)
                    results.append((graph_ms([partial(km.int4_gemv, x, w, None, cfg) for w in ws]), str(cfg)))
            results.sort()
            rows.setdefault("gemv_sweep", []).append(dict(shape=name, heuristic=str(km.choose_gemv_config(n, k)),
                                                          top5=[(round(ms * 1e3, 1), c) for ms, c in results[:5]]))
            print(rows["gemv_sweep"][-1], flush=True)
            del ws

    n, k = SHAPES["gate_up"]
    ws = int4_copies(n, k)[:2]  # batches beyond a few tokens are compute-bound: L2 reuse does not matter
    bf = torch.randn(n, k, device="cuda", dtype=dtype)
    for m in BATCHES:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        row: dict[str, Any] = {"m": m, "bf16_cublas_us": round(graph_ms([partial(F.linear, x, bf)] * 2) * 1e3, 1)}
        if m <= 16:
            row["gemv_us"] = round(graph_ms([partial(km.int4_gemv, x, w) for w in ws]) * 1e3, 1)
        if m >= 2:
            row["gemm_us"] = round(graph_ms([partial(km.int4_gemm, x, w) for w in ws]) * 1e3, 1)
        if m >= 16:
            row["dequant_cublas_us"] = round(graph_ms(
                [lambda x=x, w=w: F.linear(x, km.int4_dequantize(w, dtype)) for w in ws]) * 1e3, 1)
        row["int4_linear_us"] = round(graph_ms([partial(km.int4_linear, x, w) for w in ws]) * 1e3, 1)
        rows.setdefault("batches", []).append(row)
        print(row, flush=True)


# ---- report ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="int4 AWQ decode vs its floor and vs bf16, and the int4 kernels")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together (the floor is batch 1's)")
    parser.add_argument("--sweep", action="store_true", help="GEMV launch configs per shape")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("int4", "bf16"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        decode_child(args.child, args.config, args.json, args.input_len, args.output_len, args.iters, args.batch)
        return {}

    config = json.loads(Path(args.config).read_text())
    rows: dict[str, Any] = {"benchmark": "int4", **bench_setup.environment()}
    read_gbps = floor.measure_read_bandwidth_gbps()
    rows["read_bandwidth_gbps"] = round(read_gbps, 1)
    if not args.skip_kernels:
        kernels(rows, args.sweep, read_gbps)
    context = args.input_len + args.output_len // 2
    int4_bytes_read = int4_decode_bytes(config, context)
    bf16_bytes_read = floor.decode_bytes(config, context, 1)
    rows["int4_floor_ms"] = round(int4_bytes_read / read_gbps / 1e6, 3)
    rows["bf16_floor_ms"] = round(bf16_bytes_read / read_gbps / 1e6, 3)
    rows["int4_bytes_read_gb"] = round(int4_bytes_read / 1e9, 3)
    if not args.skip_decode:
        rows["decode"] = {v: run_decode(v, args) for v in ("int4", "bf16")}

    print(json.dumps(rows, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print()
    if "gemv" in rows:
        print("| projection (batch 1) | int4 GEMV us | int4 TB/s | x int4 read time | bf16 cuBLAS us | bf16 gemv us | int4 speed-up |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows["gemv"]:
            print(f"| {r['shape']} {r['n']}x{r['k']} | {r['int4_us']} | {r['int4_tbps']} | {r['int4_over_read_floor']} "
                  f"| {r['bf16_cublas_us']} | {r['bf16_gemv_us']} | {r['speedup_vs_bf16_gemv']}x |")
        print()
        print("| gate_up, M tokens | bf16 cuBLAS us | int4 GEMV us | int4 GEMM us | dequant + cuBLAS us | int4_linear us |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows["batches"]:
            print(f"| {r['m']} | {r['bf16_cublas_us']} | {r.get('gemv_us', '-')} | {r.get('gemm_us', '-')} | "
                  f"{r.get('dequant_cublas_us', '-')} | {r['int4_linear_us']} |")
        print()
    if "decode" in rows:
        int4, bf16 = rows["decode"]["int4"], rows["decode"]["bf16"]
        print(f"| Llama-3.1-8B dummy, batch {args.batch} | decode step ms (median / p90) | floor ms (batch 1) | "
              "step / floor | ready s |")
        print("| --- | --- | --- | --- | --- |")
        for name, r, fl in (("int4 AWQ g128", int4, rows["int4_floor_ms"]), ("bf16", bf16, rows["bf16_floor_ms"])):
            print(f"| {name} | {r['decode_step_ms']:.3f} / {r['decode_step_ms_p90']:.3f} | {fl:.3f} | "
                  f"{r['decode_step_ms'] / fl:.2f} | {r['ready_s']} |")
        print()
        print(f"int4 AWQ Llama-3.1-8B batch-{args.batch} decode step {int4['decode_step_ms']:.3f} ms = "
              f"{int4['decode_step_ms'] / rows['int4_floor_ms']:.2f}x the int4 floor ({rows['int4_floor_ms']:.3f} ms, "
              f"{rows['int4_bytes_read_gb']} GB at {read_gbps / 1e3:.2f} TB/s; target <= 1.3x), "
              f"{bf16['decode_step_ms'] / int4['decode_step_ms']:.2f}x faster than bf16 ({bf16['decode_step_ms']:.3f} ms)")
    return rows


if __name__ == "__main__":
    main()
