"""Weight-only quantized products in batches on one GPU: int4 (AWQ/GPTQ layout, group 128:
kernels/int4_matmul.py) and FP8 W8A16 (kernels/fp8_weight_gemm.py) against bf16 cuBLAS, summed over
one decoder layer's four projections of Llama-3.1-8B (qkv, o_proj, gate_up, down), at the batch sizes
a serving step reaches. What a quantized server's throughput is bound by once batches form (batch-1
decode has its own benchmarks: bench_int4.py, bench_fp8.py). Prints a table, the figure last.

    PYTHONPATH=python python benches/bench_weight_only_gemm.py             # ~1 min on an H200
    PYTHONPATH=python python benches/bench_weight_only_gemm.py --tokens 16,128 --json out.json
    PYTHONPATH=python python benches/bench_weight_only_gemm.py --throughput 400   # plus the engines

--throughput N: each model (bf16, an AWQ-layout int4 folder, a compressed-tensors W8A16 folder, all
dummy weights) in its own process serves N prompts of 256 random ids, 256 output tokens each
(ignore_eos), submitted at once: output tokens/s. --dequant-min-m M sets the runners' switch to
dequantize + cuBLAS (both kernels' DEQUANT_MIN_M) in those processes, for an A/B of the threshold.

Each time is the mean of 10 back-to-back calls on one weight (every shape is larger than L2 except
o_proj's int4 and fp8 copies, which are read once per call either way), after a warm-up call; the
quantized paths are the runners' (`int4_linear`, `fp8_weight_linear`), so each batch size takes the
kernel and tile shape the engine would. The twenty-second session's tables in benches/RESULTS.md
were measured with the out-of-tree drivers this script replaces.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

GROUP = 128
QUANTIZATION_CONFIGS: dict[str, dict[str, Any] | None] = {
    "bf16": None, "int4": bench_setup.AWQ_INT4_G128, "w8a16": bench_setup.W8A16_CHANNEL}


def _mean_us(fn, iters: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1e3


def _dequantized(dequantize, x, *weight):
    """The dequantize-then-cuBLAS path, forced at any batch size."""
    import torch.nn.functional as F

    return F.linear(x, dequantize(*weight, x.dtype))


def layer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def measure(config: dict[str, Any], tokens: list[int]) -> dict[int, dict[str, float]]:
    """Per batch size: the layer's us for bf16 cuBLAS, int4 and W8A16 as the runners pick their path
    ("int4", "w8a16"), and each one's two candidate paths forced: its Triton GEMM ("int4_gemm",
    "w8a16_gemm") and dequantize-then-cuBLAS ("int4_deq", "w8a16_deq"), which decide the thresholds."""
    import torch
    import torch.nn.functional as F
    from bench_int4 import int4_copies
    from ferrox.kernels.fp8_weight_gemm import fp8_dequantize, fp8_weight_gemm, fp8_weight_linear
    from ferrox.kernels.int4_matmul import int4_dequantize, int4_gemm, int4_linear
    from ferrox.layers.quant.fp8_linear import quantize_per_row

    kinds = ("bf16", "int4", "int4_gemm", "int4_deq", "w8a16", "w8a16_gemm", "w8a16_deq")
    sums: dict[int, dict[str, float]] = {m: dict.fromkeys(kinds, 0.0) for m in tokens}
    for n, k in layer_shapes(config).values():
        bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        fp8, scale = quantize_per_row(bf16)
        int4 = int4_copies(n, k, total_bytes=1)[0]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            runs = {"bf16": partial(F.linear, x, bf16), "int4": partial(int4_linear, x, int4),
                    "int4_gemm": partial(int4_gemm, x, int4),
                    "int4_deq": partial(_dequantized, int4_dequantize, x, int4),
                    "w8a16": partial(fp8_weight_linear, x, fp8, scale),
                    "w8a16_gemm": partial(fp8_weight_gemm, x, fp8, scale),
                    "w8a16_deq": partial(_dequantized, fp8_dequantize, x, fp8, scale)}
            for kind, fn in runs.items():
                sums[m][kind] += _mean_us(fn)
        del bf16, fp8, scale, int4
    return sums


def throughput_child(kind: str, config_path: str, out: str, num_prompts: int, dequant_min_m: int | None) -> None:
    import ferrox.kernels.fp8_weight_gemm as fwg
    import ferrox.kernels.int4_matmul as km
    from ferrox import LLM, SamplingParams

    if dequant_min_m is not None:
        km.DEQUANT_MIN_M = fwg.DEQUANT_MIN_M = dequant_min_m
    config = json.loads(Path(config_path).read_text())
    folder = bench_setup.make_model_dir(config_path, quantization_config=QUANTIZATION_CONFIGS[kind])
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
    prompts = bench_setup.random_prompts(num_prompts, 256, bench_setup.first_special_id(config), seed=7)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    Path(out).write_text(json.dumps({"output_tok_s": round(tokens / seconds, 1), "seconds": round(seconds, 2)}))


def run_throughput(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", kind, "--json", f.name, "--config", args.config,
               "--throughput", str(args.throughput)]
        if args.dequant_min_m is not None:
            cmd += ["--dequant-min-m", str(args.dequant_min_m)]
        subprocess.run(cmd, check=True)
        return json.loads(Path(f.name).read_text())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--tokens", default="8,16,32,64,128,256,512", help="comma list of batch sizes (rows)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--throughput", type=int, default=0, metavar="N",
                        help="also N x (256, 256) through each engine, output tok/s (module docstring)")
    parser.add_argument("--dequant-min-m", type=int, default=None, metavar="M",
                        help="the runners' dequantize + cuBLAS threshold in the --throughput engines")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--child", choices=tuple(QUANTIZATION_CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        throughput_child(args.child, args.config, args.json, args.throughput, args.dequant_min_m)
        return {}

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_weight_only_gemm.py needs a CUDA GPU")
    config = json.loads(Path(args.config).read_text())
    result: dict[str, Any] = {"benchmark": "weight_only_gemm", **bench_setup.environment(),
                              "model": Path(args.config).parent.name}
    figure = ""
    if not args.skip_kernels:
        tokens = [int(t) for t in args.tokens.split(",")]
        if min(tokens) < 2:
            raise SystemExit("--tokens: batches of 2 rows or more (one row is the GEMVs': bench_int4.py, bench_fp8.py)")
        sums = measure(config, tokens)
        result["layer_us"] = {str(m): {k: round(v, 1) for k, v in s.items()} for m, s in sums.items()}
        print(f"{result['model']}, one layer's four projections, {result['gpu']}, torch {result['torch']}, "
              f"triton {result['triton']}")
        print("| tokens | bf16 cuBLAS us | int4 g128 us (x bf16) | its GEMM / dequantize + cuBLAS | "
              "FP8 W8A16 us (x bf16) | its GEMM / dequantize + cuBLAS |")
        print("| --- | --- | --- | --- | --- | --- |")
        for m, s in sums.items():
            print(f"| {m} | {s['bf16']:.1f} | {s['int4']:.1f} ({s['int4'] / s['bf16']:.2f}) "
                  f"| {s['int4_gemm']:.1f} / {s['int4_deq']:.1f} "
                  f"| {s['w8a16']:.1f} ({s['w8a16'] / s['bf16']:.2f}) | {s['w8a16_gemm']:.1f} / {s['w8a16_deq']:.1f} |")
        m = 128 if 128 in sums else tokens[-1]
        figure = (f"at {m} tokens a layer takes {sums[m]['int4'] / sums[m]['bf16']:.2f}x bf16's time in int4 and "
                  f"{sums[m]['w8a16'] / sums[m]['bf16']:.2f}x in W8A16")
    if args.throughput:
        tput = {kind: run_throughput(kind, args) for kind in QUANTIZATION_CONFIGS}
        result["throughput"] = tput
        threshold = "as committed" if args.dequant_min_m is None else f"dequantize from {args.dequant_min_m} rows"
        print(f"\n| {args.throughput} x (256, 256), {threshold} | output tok/s | x bf16 |\n| --- | --- | --- |")
        for kind, r in tput.items():
            print(f"| {kind} | {r['output_tok_s']:,.0f} | {r['output_tok_s'] / tput['bf16']['output_tok_s']:.2f} |")
        figure = (f"{args.throughput} x (256, 256): int4 {tput['int4']['output_tok_s']:,.0f} and W8A16 "
                  f"{tput['w8a16']['output_tok_s']:,.0f} output tok/s against bf16's {tput['bf16']['output_tok_s']:,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(figure)
    return result


if __name__ == "__main__":
    main()
