"""Decode batches of a few requests (2-8 rows a step) on one GPU: the tensor-core product for few tokens
(kernels/dense_gemv_cuda.py `few_token_product`) against cuBLAS, which ran them before (F.linear for bf16
weights; for FP8 W8A8 a quantizing launch, then torch._scaled_mm). Llama-3.1-8B, dummy weights.

    PYTHONPATH=python python benches/bench_small_batch.py                  # kernels, then engines
    PYTHONPATH=python python benches/bench_small_batch.py --skip-engines   # the products only

(a) Products: each of the decoder layer's four projections and the LM head at 2, 4 and 8 rows, timed as
    bench_gemv.py times them (a CUDA graph over >= 2 GB of weight copies, so the weights stream from HBM).
    "-": the kernel does not take that input (its staged tokens past shared memory).
(b) Engines: the median decode step while B requests of 32-token prompts write 128 tokens each, for
    B = 1, 2, 4, 8, in one engine per (weights, FERROX_DENSE_MMA_ROWS = 1 | unset) built one after another
    in this process (1: batches on cuBLAS as before; unset: as routed, dense_gemv_cuda._BATCH_ROWS; batch
    1 is the same one-token path in both).
Prints the tables, then the figure last: the FP8 and bf16 batch-4 steps, cuBLAS / as routed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from bench_gemv import SHAPES, graph_ms  # noqa: E402
from bench_latency import StepTimer  # noqa: E402

ROWS = (2, 4, 8)


def products(rows_out: list[dict]) -> None:
    from ferrox.kernels.dense_gemv_cuda import few_token_product
    from ferrox.kernels.row_quant import quantize_activations_triton
    from ferrox.layers.quant.fp8_linear import quantize_per_row, scaled_mm

    for name, (n, k) in SHAPES.items():
        for kind in ("bf16", "fp8"):
            if kind == "fp8" and name == "lm_head":  # (the LM head stays bf16 under --quantization fp8)
                continue
            elem = 1 if kind == "fp8" else 2
            copies = max(2, -(-int(2e9) // (n * k * elem)))
            w16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
            ws = [quantize_per_row(w) for w in w16] if kind == "fp8" else [(w, None) for w in w16]
            if kind == "fp8":
                del w16
            out_dtype = torch.float32 if name == "lm_head" else None
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                if kind == "fp8":
                    def cublas(w, s, x=x):
                        xq, xs = quantize_activations_triton(x, None)
                        return scaled_mm(xq, xs, w, s, None, torch.bfloat16)
                else:
                    def cublas(w, s, x=x, f32=out_dtype is not None):
                        y = torch.nn.functional.linear(x, w)
                        return y.float() if f32 else y
                base = graph_ms([partial(cublas, w, s) for w, s in ws]) * 1e3
                taken = few_token_product(x, ws[0][0], weight_scale=ws[0][1], out_dtype=out_dtype) is not None
                mma = (graph_ms([partial(few_token_product, x, w, weight_scale=s, out_dtype=out_dtype)
                                 for w, s in ws]) * 1e3 if taken else None)
                mbytes = n * k * elem / 1e6
                rows_out.append({"kind": kind, "product": name, "rows": m, "mbytes": mbytes, "cublas_us": base,
                                 "kernel_us": mma})
                print(rows_out[-1], flush=True)
            del ws
            torch.cuda.empty_cache()


def batch_step_ms(llm: Any, batch: int, max_id: int, iters: int = 2) -> float:
    """Median engine step while `batch` requests decode together (each run's prefill step left out)."""
    from ferrox import SamplingParams

    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(batch, 32, max_id, seed=3), params, use_tqdm=False)  # warm-up
    timer = StepTimer(llm.engine)
    steps: list[float] = []
    for i in range(iters):
        timer.times_ms.clear()
        outs = llm.generate(bench_setup.random_prompts(batch, 32, max_id, seed=200 + i), params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 128 for o in outs)
        steps.extend(timer.times_ms[1:])
    llm.engine.step = timer.inner
    return statistics.median(steps)


def engines(args: argparse.Namespace, batches: tuple[int, ...], envs: list[str]) -> list[dict]:
    import gc

    from ferrox import LLM

    model_dir, max_id = bench_setup.dummy_model_dir(args.config)
    out = []
    for weights in args.weights.split(","):
        for rows_env in envs:  # "1": batches on cuBLAS; "": as routed (dense_gemv_cuda._BATCH_ROWS)
            os.environ["FERROX_DENSE_MMA_ROWS"] = rows_env
            kw = {"quantization": "fp8"} if weights == "fp8" else {}
            folder = model_dir
            if weights == "fp8-block":  # a block-FP8 checkpoint's config (Qwen3-FP8 / DeepSeek layout)
                import bench_fp8

                folder = bench_setup.make_model_dir(args.config, quantization_config=bench_fp8.FP8_BLOCK)
            llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                      kv_cache_memory=int(8 << 30), **kw)
            for b in batches:
                out.append({"weights": weights, "rows_env": rows_env, "batch": b,
                            "step_ms": batch_step_ms(llm, b, max_id)})
                print(out[-1], flush=True)
            llm.engine.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    os.environ.pop("FERROX_DENSE_MMA_ROWS", None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--weights", default="bf16,fp8", help="bf16, fp8 (online), fp8-block (a block-FP8 checkpoint)")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rows-envs", default="1,",
                        help="FERROX_DENSE_MMA_ROWS values, one engine each (empty: unset, as routed)")
    parser.add_argument("--skip-kernels", action="store_true")
    parser.add_argument("--skip-engines", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    prods: list[dict] = []
    if not args.skip_kernels:
        os.environ["FERROX_DENSE_MMA_ROWS"] = "8"  # every row count to the kernel, whatever the routing
        products(prods)
    envs = args.rows_envs.split(",")
    steps = [] if args.skip_engines else engines(args, tuple(int(b) for b in args.batches.split(",")), envs)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_small_batch.json").write_text(json.dumps({"products": prods, "steps": steps}))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if prods:
        print("| weights | product | MB | rows | cuBLAS us (TB/s) | kernel us (TB/s) | cuBLAS / kernel |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in prods:
            k = r["kernel_us"]
            kcol = f"{k:.1f} ({r['mbytes'] / k:.2f})" if k else "-"
            ratio = f"{r['cublas_us'] / k:.2f}x" if k else "-"
            print(f"| {r['kind']} | {r['product']} | {r['mbytes']:.0f} | {r['rows']} | {r['cublas_us']:.1f} "
                  f"({r['mbytes'] / r['cublas_us']:.2f}) | {kcol} | {ratio} |")
    if steps:
        label = {"1": "batches on cuBLAS", "": "as routed"}
        cols = [label.get(e, f"FERROX_DENSE_MMA_ROWS={e}") for e in envs]
        print("\n| weights | batch | " + " | ".join(f"step, {c} (ms)" for c in cols) + " | cuBLAS / as routed |")
        print("| --- | --- | " + " | ".join("---" for _ in cols) + " | --- |")
        figure = []
        for weights in args.weights.split(","):
            for b in sorted({s["batch"] for s in steps}):
                ms = {e: next(s["step_ms"] for s in steps if s["weights"] == weights and s["batch"] == b
                              and s["rows_env"] == e) for e in envs}
                ratio = ms["1"] / ms[""] if "1" in ms and "" in ms else float("nan")
                print(f"| {weights} | {b} | " + " | ".join(f"{ms[e]:.3f}" for e in envs) + f" | {ratio:.3f}x |")
                if b == 4:
                    figure.append(f"{weights} batch-4 step cuBLAS / as routed {ratio:.3f}x")
        print("; ".join(figure))


if __name__ == "__main__":
    main()
