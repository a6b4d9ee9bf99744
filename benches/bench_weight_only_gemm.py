"""Weight-only quantized products in batches on one GPU: int4 (AWQ/GPTQ layout, group 128:
kernels/int4_matmul.py) and FP8 W8A16 (kernels/fp8_weight_gemm.py) against bf16 cuBLAS, summed over
one decoder layer's four projections of Llama-3.1-8B (qkv, o_proj, gate_up, down), at the batch sizes
a serving step reaches. What a quantized server's throughput is bound by once batches form (batch-1
decode has its own benchmarks: bench_int4.py, bench_fp8.py). Prints a table, the figure last.

    PYTHONPATH=python python benches/bench_weight_only_gemm.py             # ~1 min on an H200
    PYTHONPATH=python python benches/bench_weight_only_gemm.py --tokens 16,128 --json out.json

Each time is the mean of 10 back-to-back calls on one weight (every shape is larger than L2 except
o_proj's int4 and fp8 copies, which are read once per call either way), after a warm-up call; the
quantized paths are the runners' (`int4_linear`, `fp8_weight_linear`), so each batch size takes the
kernel and tile shape the engine would. The twenty-second session's tables in benches/RESULTS.md
were measured with the out-of-tree drivers this script replaces.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

GROUP = 128


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


def layer_shapes(config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter)}


def measure(config: dict[str, Any], tokens: list[int]) -> dict[int, dict[str, float]]:
    """Per batch size: the layer's us for bf16 cuBLAS, int4 and W8A16."""
    import torch
    import torch.nn.functional as F
    from bench_int4 import int4_copies
    from ferrox.kernels.fp8_weight_gemm import fp8_weight_linear
    from ferrox.kernels.int4_matmul import int4_linear
    from ferrox.layers.quant.fp8_linear import quantize_per_row

    sums: dict[int, dict[str, float]] = {m: {"bf16": 0.0, "int4": 0.0, "w8a16": 0.0} for m in tokens}
    for n, k in layer_shapes(config).values():
        bf16 = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        fp8, scale = quantize_per_row(bf16)
        int4 = int4_copies(n, k, total_bytes=1)[0]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            sums[m]["bf16"] += _mean_us(partial(F.linear, x, bf16))
            sums[m]["int4"] += _mean_us(partial(int4_linear, x, int4))
            sums[m]["w8a16"] += _mean_us(partial(fp8_weight_linear, x, fp8, scale))
    return sums


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--tokens", default="8,16,32,64,128,256,512", help="comma list of batch sizes (rows)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_weight_only_gemm.py needs a CUDA GPU")
    config = json.loads(Path(args.config).read_text())
    tokens = [int(t) for t in args.tokens.split(",")]
    if min(tokens) < 2:
        raise SystemExit("--tokens: batches of 2 rows or more (one row is the GEMVs': bench_int4.py, bench_fp8.py)")
    sums = measure(config, tokens)
    result = {"benchmark": "weight_only_gemm", **bench_setup.environment(), "model": Path(args.config).parent.name,
              "layer_us": {str(m): {k: round(v, 1) for k, v in s.items()} for m, s in sums.items()}}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{result['model']}, one layer's four projections, {result['gpu']}, torch {result['torch']}, "
          f"triton {result['triton']}")
    print("| tokens | bf16 cuBLAS us | int4 g128 us (x bf16) | FP8 W8A16 us (x bf16) |")
    print("| --- | --- | --- | --- |")
    for m, s in sums.items():
        print(f"| {m} | {s['bf16']:.1f} | {s['int4']:.1f} ({s['int4'] / s['bf16']:.2f}) "
              f"| {s['w8a16']:.1f} ({s['w8a16'] / s['bf16']:.2f}) |")
    m = 128 if 128 in sums else tokens[-1]
    print(f"at {m} tokens a layer takes {sums[m]['int4'] / sums[m]['bf16']:.2f}x bf16's time in int4 and "
          f"{sums[m]['w8a16'] / sums[m]['bf16']:.2f}x in W8A16 (weight-only batches are bound by the kernels, "
          f"not by bytes)")
    return result


if __name__ == "__main__":
    main()
