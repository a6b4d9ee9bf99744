"""One-token products at Llama-3.1-8B's decode shapes: the tensor-core kernel for weights as they load
(kernels/dense_gemv_cuda.py) against the Triton kernels it replaces (gemv.py for bf16, w8a8_dot_gemv.py for
FP8 W8A8, and for block-wise FP8 checkpoints), with the one-token path's fusions, on one GPU. Prints a
table last, then the decoder layer's
four products summed, Triton / CUDA.

    PYTHONPATH=python python benches/bench_dense_gemv.py            # default configs, PDL on and off
    PYTHONPATH=python python benches/bench_dense_gemv.py --sweep    # plus every config of SWEEP per shape

Timings as bench_gemv.py takes them: a CUDA graph calling the product once per weight copy, with enough
copies (>= 2 GB) that the weights stream from HBM. TB/s = weight bytes / time, next to the best streaming
read (floor.py) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from functools import partial
from pathlib import Path

import torch
from ferrox.kernels import dense_gemv_cuda
from ferrox.kernels.dense_gemv_cuda import DenseGemvConfig, dense_mma_product, dense_qkv_rope
from ferrox.kernels.gemv import gemv, qkv_rope_gemv
from ferrox.kernels.w8a8_dot_gemv import w8a8_dot_gemv
from ferrox.layers.quant.fp8_linear import quantize_per_row

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemv import HIDDEN, HKV, HQ, INTER, SHAPES, VOCAB, D, graph_ms  # noqa: E402
from floor import measure_read_bandwidth_gbps  # noqa: E402

SWEEP = tuple(DenseGemvConfig(w, c, s) for w in (4, 8, 16) for c in (1, 2, 4) for s in (2, 3, 4, 8)
              if DenseGemvConfig(w, c, s).ring_bytes(True) <= 160 * 1024)
# (label, shape, fusions): the decoder layer's four products, as the one-token path runs them (qkv with
# the norm, rotary and the KV write), and the LM head.
CASES = (("qkv + norm + rotary + KV write", "qkv", dict(norm=True, rope=True)),
         ("o_proj + residual", "o_proj", dict(residual=True)),
         ("gate_up + norm + SiLU", "gate_up", dict(norm=True, silu_mul=True)),
         ("down + residual", "down", dict(residual=True)),
         ("lm_head, fp32 logits", "lm_head", dict(f32=True)))


def _copies(n: int, k: int, elem: int) -> int:
    return max(2, math.ceil(2e9 / (n * k * elem)))


def _calls(k: int, n_out: int, fus: dict, fp8: bool):
    """(triton(pair), cuda(pair, config, pdl)) for one case; pair = (weight, row scales or None)."""
    dev = torch.device("cuda")
    dt = torch.bfloat16
    x = torch.randn(1, k, device=dev, dtype=dt)
    g = torch.ones(k, device=dev, dtype=dt) if fus.get("norm") else None
    res = torch.randn(1, n_out, device=dev, dtype=dt) if fus.get("residual") else None
    out_dtype = torch.float32 if fus.get("f32") else None
    if fus.get("rope"):
        rope = torch.randn(D, device=dev)
        slots = torch.tensor([1234], device=dev)
        cache = torch.zeros(2, 512, 16, HKV, D, device=dev, dtype=dt)
        ones = torch.ones(2, device=dev)
        geometry = dict(rope_row=rope, slot_mapping=slots, kv_cache=cache, num_q_heads=HQ, num_kv_heads=HKV,
                        head_dim=D)

        def triton_rope(pair):
            return qkv_rope_gemv(x, pair[0], None, norm_weight=g, eps=1e-5, weight_scale=pair[1], w8a8=fp8,
                                 **geometry)

        def cuda_rope(pair, config=None, pdl=None):
            return dense_qkv_rope(x, pair[0], None, weight_scale=pair[1], norm_weight=g, eps=1e-5, kv_scale=ones,
                                  config=config, pdl=pdl, **geometry)

        return triton_rope, cuda_rope
    kw = dict(norm_weight=g, eps=1e-5, silu_mul=bool(fus.get("silu_mul")), residual=res)

    def triton_call(pair):
        w, s = pair
        if s is None:
            return gemv(x, w, out_dtype=out_dtype, **kw)
        return w8a8_dot_gemv(x, w, s, **kw)

    def cuda_call(pair, config=None, pdl=None):
        return dense_mma_product(x, pair[0], weight_scale=pair[1], out_dtype=out_dtype, config=config, pdl=pdl, **kw)

    return triton_call, cuda_call


def run(kind: str, sweep: bool, rows: list[dict], products: tuple[str, ...] = ()) -> None:
    fp8 = kind == "fp8"
    for label, shape, fus in CASES:
        if products and shape not in products:
            continue
        if fp8 and fus.get("f32"):
            continue  # the LM head stays bf16 in FP8 models
        n, k = SHAPES[shape]
        n_out = n // 2 if fus.get("silu_mul") else n
        elem = 1 if fp8 else 2
        ws = []
        for _ in range(_copies(n, k, elem)):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            ws.append(quantize_per_row(w) if fp8 else (w, None))
            del w
        triton_call, cuda_call = _calls(k, n_out, fus, fp8)
        os.environ["FERROX_DENSE_MMA"] = "0"
        t_triton = graph_ms([partial(triton_call, p) for p in ws])
        if not fp8 and fus.get("silu_mul"):
            # Not compiled for 16-bit weights (dense_gemv_cuda.FUSIONS_16): Triton runs it.
            rows.append(dict(kind=kind, product=label, mbytes=n * k * elem / 1e6, triton_us=t_triton * 1e3,
                             cuda_us=t_triton * 1e3, cuda_nopdl_us=float("nan"), config="Triton"))
            print(rows[-1], flush=True)
            continue
        os.environ["FERROX_DENSE_MMA"] = "1"
        t_cuda = graph_ms([partial(cuda_call, p) for p in ws])
        t_nopdl = graph_ms([partial(cuda_call, p, pdl=False) for p in ws])
        tiles = -(-n_out // 16)
        row = dict(kind=kind, product=label, mbytes=n * k * elem / 1e6, triton_us=t_triton * 1e3,
                   cuda_us=t_cuda * 1e3, cuda_nopdl_us=t_nopdl * 1e3,
                   config=str(dense_gemv_cuda.choose_config(tiles, k * elem, fp8)))
        if sweep:
            best = None
            for cfg in SWEEP:
                if k * elem % (64 * cfg.chunks):
                    continue
                t = graph_ms([partial(cuda_call, p, cfg) for p in ws]) * 1e3
                if best is None or t < best[1]:
                    best = (cfg, t)
                row.setdefault("sweep", {})[str(cfg)] = t
            assert best is not None
            row["best"], row["best_us"] = str(best[0]), best[1]
        rows.append(row)
        print(row, flush=True)
        del ws
        torch.cuda.empty_cache()


def run_block(rows: list[dict], products: tuple[str, ...] = ()) -> None:
    """Block-wise FP8 (128 x 128 blocks, Qwen3-FP8 / DeepSeek layout) as the one-token path runs it (qkv
    with the norm, rotary after): w8a8_dot_gemv(block=) on Triton (FERROX_DENSE_MMA=0) and on this kernel."""
    from ferrox.layers.quant.fp8_block import quantize_fp8_blocks

    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.ones(HIDDEN, device=dev, dtype=dt)
    cases = (("qkv + norm", "qkv", dict(norm_weight=g)), ("o_proj + residual", "o_proj", dict(residual=True)),
             ("gate_up + norm + SiLU", "gate_up", dict(norm_weight=g, silu_mul=True)),
             ("down + residual", "down", dict(residual=True)))
    for label, shape, kw in cases:
        if products and shape not in products:
            continue
        n, k = SHAPES[shape]
        x = torch.randn(1, k, device=dev, dtype=dt)
        n_out = n // 2 if kw.get("silu_mul") else n
        args = dict(kw, residual=torch.randn(1, n_out, device=dev, dtype=dt) if kw.get("residual") else None)
        ws = [quantize_fp8_blocks(torch.randn(n, k, device=dev) / k ** 0.5, (128, 128)) for _ in range(_copies(n, k, 1))]
        times = {}
        for switch in ("0", "1"):
            os.environ["FERROX_DENSE_MMA"] = switch
            times[switch] = graph_ms([partial(w8a8_dot_gemv, x, w, s, eps=1e-5, block=(128, 128), **args)
                                      for w, s in ws]) * 1e3
        tiles = -(-n_out // 16)
        rows.append(dict(kind="fp8-block", product=label, mbytes=n * k / 1e6, triton_us=times["0"], cuda_us=times["1"],
                         cuda_nopdl_us=float("nan"), config=str(dense_gemv_cuda.choose_config(tiles, k, True))))
        print(rows[-1], flush=True)
        del ws
        torch.cuda.empty_cache()


def prebuild(sweep: bool) -> None:
    """Compile every module the run loads, on threads (NVRTC compiles one program per call), into the disk
    cache the loads then read."""
    from concurrent.futures import ThreadPoolExecutor

    from ferrox.kernels import nvrtc

    arch = nvrtc.device_arch(torch.device("cuda"))
    sets = [dense_gemv_cuda.CONFIGS] + ([(cfg,) for cfg in SWEEP if cfg not in dense_gemv_cuda.CONFIGS] if sweep else [])
    modules = [dense_gemv_cuda._module("Bf16", fp8, configs) for configs in sets for fp8 in (False, True)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda m: nvrtc.compile_cubin(m.source, arch, m.options, m.name), modules))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--kinds", default="bf16,fp8,fp8-block")
    parser.add_argument("--products", default="", help="a comma list of qkv, o_proj, gate_up, down, lm_head (default: all)")
    args = parser.parse_args()
    products = tuple(p for p in args.products.split(",") if p)
    unknown = sorted(set(products) - {shape for _, shape, _ in CASES})
    if unknown:
        parser.error(f"--products: unknown {', '.join(unknown)} (choose from {', '.join(s for _, s, _ in CASES)})")
    torch.manual_seed(0)
    prebuild(args.sweep)
    read_tbps = measure_read_bandwidth_gbps() / 1e3
    rows: list[dict] = []
    for kind in args.kinds.split(","):
        if kind == "fp8-block":
            run_block(rows, products)
        else:
            run(kind, args.sweep, rows, products)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_dense_gemv.json").write_text(json.dumps(rows, indent=1))
    print(f"\nbest streaming read {read_tbps:.2f} TB/s ({torch.cuda.get_device_name()}, torch {torch.__version__}); "
          f"shapes: hidden {HIDDEN}, intermediate {INTER}, vocab {VOCAB}")
    print("| weights | product | MB | Triton us (TB/s) | CUDA us (TB/s) | CUDA without PDL | config | best of sweep |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        best = f"{r['best']} {r['best_us']:.1f}" if "best" in r else "-"
        print(f"| {r['kind']} | {r['product']} | {r['mbytes']:.0f} | {r['triton_us']:.1f} "
              f"({r['mbytes'] / r['triton_us']:.2f}) | {r['cuda_us']:.1f} ({r['mbytes'] / r['cuda_us']:.2f}) "
              f"| {r['cuda_nopdl_us']:.1f} | {r['config']} | {best} |")
    for kind in args.kinds.split(","):
        layer = [r for r in rows if r["kind"] == kind and not r["product"].startswith("lm_head")]
        tri, cu = sum(r["triton_us"] for r in layer), sum(r["cuda_us"] for r in layer)
        print(f"{kind} decoder layer, four products: Triton {tri:.1f} us, CUDA {cu:.1f} us, Triton / CUDA {tri / cu:.3f}")


if __name__ == "__main__":
    main()
