"""FP8 weights against bf16 on one GPU (issue 12): Llama-3.1-8B with dummy weights, the bf16 engine
and then the fp8 one (`quantization="fp8"`: online E4M3, per-channel scales) in this process.

    python benches/bench_fp8.py                    # (a) batch-1 decode, (b) 1000 x (256 in, 256 out)
    python benches/bench_fp8.py --sweep-gemv       # first, a launch-config sweep of the fp8 GEMVs
    python benches/bench_fp8.py --weights bf16,fp8,int8,fp8-block   # also int8 W8A8 and block-FP8 checkpoints

(a) Batch-1 decode: the median engine step (host wall time, CUDA graphs) while one request of a
    32-token prompt writes 128 tokens, next to the floor of each model: the bytes a step must read
    over the best streaming-read bandwidth measured in this run (floor.py). The fp8 step reads the
    projections at one byte a weight plus their float32 row scales, and in bf16 the norms, the LM
    head, the embedding row its token gathers and the KV of the mean context. Targets: fp8 step
    <= 1.2x the fp8 floor, and >= 1.8x faster than the bf16 step.
(b) Throughput: 1000 prompts of 256 random token ids, 256 output tokens each (ignore_eos), all
    submitted at once; output tokens/s, bf16 vs fp8. Target: fp8 >= 1.3x bf16.

`--weights ...,int8` adds a third engine: the same model as a compressed-tensors "int-quantized"
checkpoint (int8 weights with per-channel scales, int8 activations per token, dynamic; dummy
weights), whose floor is fp8's (one byte a weight plus its row scales); `fp8-block` the same model as
a block-wise FP8 checkpoint (DeepSeek / Qwen3-FP8 layout: 128 x 128 weight blocks, activations per
token group of 128), with the same floor (row or block scales: well under 0.1% of the bytes).

The engines get the same KV cache (--kv-cache-gib), so the comparison is the weights' and not the
cache's, and a first engine not fully released cannot starve the second. Prints a table, then the
figures (the two ratios) last. About 4-6 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
import floor  # noqa: E402
from bench_latency import StepTimer  # noqa: E402


def fp8_weight_bytes_read(config: dict[str, Any], batch: int = 1) -> int:
    """What floor.weight_bytes_read counts for bf16, with every decoder projection at one byte a
    weight plus a float32 scale per output row, and the embedding rows the step's tokens gather."""
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    proj_params = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    proj_rows = (heads + 2 * kv_heads) * head_dim + hidden + 2 * inter + hidden
    bf16 = floor.weight_bytes_read(config, batch, dtype_bytes=2)
    return bf16 - layers * proj_params * (2 - 1) + layers * proj_rows * 4 + batch * hidden * 2


# llm-compressor's W8A8 int8 layout (layers/quant/compressed_tensors_int8.py): per-channel weight
# scales, per-token dynamic activations, the LM head left in bf16.
INT8_W8A8 = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
}


# DeepSeek-V3's block-wise FP8 layout, as Qwen3's FP8 releases publish it (layers/quant/fp8_block.py).
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def make_llm(model_dir: str, args: argparse.Namespace, **kw: Any) -> Any:
    from ferrox import LLM

    return LLM(model=model_dir, load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)), **kw)


def decode_step_ms(llm: Any, max_id: int, input_len: int, output_len: int, iters: int) -> float:
    """Median engine step of batch-1 decoding (the prefill step of each run left out)."""
    from ferrox import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(bench_setup.random_prompts(1, input_len, max_id, seed=2), params, use_tqdm=False)  # warm-up
    timer = StepTimer(llm.engine)
    steps: list[float] = []
    for i in range(iters):
        timer.times_ms.clear()
        out = llm.generate(bench_setup.random_prompts(1, input_len, max_id, seed=100 + i), params, use_tqdm=False)
        if len(out[0].outputs[0].token_ids) != output_len:
            raise RuntimeError(f"expected {output_len} tokens, got {len(out[0].outputs[0].token_ids)}")
        steps.extend(timer.times_ms[1:])
    llm.engine.step = timer.inner
    return statistics.median(steps)


def throughput(llm: Any, max_id: int, num_prompts: int, input_len: int, output_len: int) -> dict[str, float]:
    from ferrox import SamplingParams

    llm.generate(bench_setup.random_prompts(16, 64, max_id, seed=7),
                 SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False), use_tqdm=False)
    prompts = bench_setup.random_prompts(num_prompts, input_len, max_id, seed=1000)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, top_p=1.0, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if out_tokens != num_prompts * output_len:
        raise RuntimeError(f"expected {num_prompts * output_len} output tokens, got {out_tokens}")
    return {"elapsed_s": elapsed, "output_tokens_per_s": out_tokens / elapsed,
            "total_tokens_per_s": (out_tokens + num_prompts * input_len) / elapsed}


def sweep_gemv(config: dict[str, Any], only: set[str] | None = None) -> list[dict[str, Any]]:
    """Every launch config of the fp8 GEMVs at the model's decode shapes (weight copies enough to
    stream from HBM, replayed in a CUDA graph as bench_gemv.py does), best first, against the one
    choose_config picks. only: the shapes to sweep (all when None)."""
    import torch
    from bench_gemv import graph_ms
    from ferrox.kernels.gemv import GemvConfig, choose_config, gemv
    from ferrox.layers.quant.fp8_linear import quantize_per_row

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    x = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (hidden, inter)}
    g = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    shapes = {"qkv": ((heads + 2 * kv_heads) * head_dim, hidden, "plain"), "o_proj": (hidden, heads * head_dim, "plain"),
              "gate_up+silu": (2 * inter, hidden, "silu"), "down": (hidden, inter, "plain")}
    rows = []
    for name, (n, k, kind) in shapes.items():
        if only is not None and name not in only:
            continue
        copies = max(2, -(-int(2e9) // (n * k)))
        ws = [quantize_per_row(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]

        def call(w, s, cfg, k=k, kind=kind):
            if kind == "silu":
                return gemv(x[k], w, norm_weight=g, silu_mul=True, weight_scale=s, config=cfg)
            return gemv(x[k], w, weight_scale=s, config=cfg)

        results = []
        for block_n in (1, 2, 4, 8, 16):
            for block_k in (512, 1024, 2048, 4096):
                for warps in (4, 8):
                    if block_n * block_k > 16384:  # the fp32 accumulators would spill
                        continue
                    cfg = GemvConfig(block_n, block_k, warps)
                    results.append((graph_ms([partial(call, w, s, cfg) for w, s in ws]), cfg))
        results.sort(key=lambda r: r[0])
        heuristic = choose_config(kind, k, weight_bytes=1)
        heuristic_ms = graph_ms([partial(call, w, s, heuristic) for w, s in ws])
        rows.append({"shape": name, "best": str(results[0][1]), "best_us": results[0][0] * 1e3,
                     "best_tbps": n * k / results[0][0] / 1e9, "heuristic": str(heuristic),
                     "heuristic_us": heuristic_ms * 1e3, "heuristic_tbps": n * k / heuristic_ms / 1e9})
        print(rows[-1], flush=True)
        del ws
    return rows


def sweep_dot_gemv(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The tensor-core split-K fp8 product (kernels/w8a8_dot_gemv.py) at the model's decode shapes, as
    the one-token path calls them (norm + SiLU for gate_up, the residual for o_proj and down), over
    its launch configs, next to gemv.py's CUDA-core fp8 kernel and the bf16 one in the same run."""
    import torch
    from bench_gemv import graph_ms
    from ferrox.kernels.gemv import gemv
    from ferrox.kernels.w8a8_dot_gemv import DotGemvConfig, choose_dot_config, w8a8_dot_gemv
    from ferrox.layers.quant.fp8_linear import quantize_per_row

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (hidden, inter)}
    g = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    res = {n: torch.randn(1, n, device="cuda", dtype=torch.bfloat16) for n in (hidden,)}
    shapes = {"qkv (plain)": ((heads + 2 * kv_heads) * head_dim, hidden, {}),
              "o_proj+res": (hidden, heads * head_dim, {"residual": res[hidden]}),
              "gate_up+norm+silu": (2 * inter, hidden, {"norm_weight": g, "silu_mul": True}),
              "down+res": (hidden, inter, {"residual": res[hidden]})}
    rows = []
    for name, (n, k, kw) in shapes.items():
        copies = max(2, -(-int(2e9) // (n * k)))
        ws = [quantize_per_row(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02) for _ in range(copies)]
        n_out = n // 2 if kw.get("silu_mul") else n
        cuda_core_ms = graph_ms([partial(gemv, x[k], w, weight_scale=s, **kw) for w, s in ws])
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, copies // 2))]
        bf16_ms = graph_ms([partial(gemv, x[k], w, **kw) for w in bf16])
        del bf16
        results = []
        for block_n in (64, 128):
            for block_k in (128, 256, 512):
                for split in (1, 2, 4, 8):
                    for warps, stages in ((4, 2), (4, 3), (4, 4), (8, 3)):
                        if k // split < block_k or (block_n == 128 and block_k == 512):
                            continue
                        cfg = DotGemvConfig(block_n, block_k, split, warps, stages)
                        try:
                            ms = graph_ms([partial(w8a8_dot_gemv, x[k], w, s, config=cfg, **kw) for w, s in ws])
                        except Exception as e:  # out of shared memory for this tile and stage count
                            print(f"{name} {cfg}: {type(e).__name__}", flush=True)
                            continue
                        results.append((ms, cfg))
        results.sort(key=lambda r: r[0])
        chosen = choose_dot_config(n_out, k, sms)
        chosen_ms = graph_ms([partial(w8a8_dot_gemv, x[k], w, s, config=chosen, **kw) for w, s in ws])
        gb = n * k / 1e9
        rows.append({"shape": name, "bf16_us": bf16_ms * 1e3, "fp8_cuda_core_us": cuda_core_ms * 1e3,
                     "fp8_cuda_core_tbps": gb / cuda_core_ms, "best": str(results[0][1]),
                     "best_us": results[0][0] * 1e3, "best_tbps": gb / results[0][0], "chosen": str(chosen),
                     "chosen_us": chosen_ms * 1e3, "chosen_tbps": gb / chosen_ms,
                     "top5": [(round(ms * 1e3, 1), str(c)) for ms, c in results[:5]]})
        print(rows[-1], flush=True)
        del ws
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--decode-input-len", type=int, default=32)
    parser.add_argument("--decode-output-len", type=int, default=128)
    parser.add_argument("--decode-iters", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-gib", type=float, default=40.0, help="the same KV cache for every engine")
    parser.add_argument("--weights", default="bf16,fp8",
                        help="engines to run, in order: a comma list of bf16, fp8, int8, fp8-block (bf16 and fp8 required)")
    parser.add_argument("--sweep-gemv", action="store_true", help="also sweep the fp8 GEMV launch configs")
    parser.add_argument("--sweep-shapes", default=None,
                        help="with --sweep-gemv: a comma list of the shapes to sweep (qkv, o_proj, gate_up+silu, down)")
    parser.add_argument("--sweep-dot", action="store_true",
                        help="sweep the tensor-core split-K fp8 product against the CUDA-core fp8 and bf16 GEMVs")
    parser.add_argument("--kernels-only", action="store_true", help="the sweeps only, no engines")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8.py needs a CUDA GPU (FP8 matmuls: compute capability 8.9+)")
    config = json.loads(Path(args.config).read_text())
    max_id = bench_setup.first_special_id(config)
    model_dir = bench_setup.make_model_dir(args.config)
    result: dict[str, Any] = {"benchmark": "fp8", **bench_setup.environment(), "model": Path(args.config).parent.name}
    if args.sweep_gemv:
        result["gemv_sweep"] = sweep_gemv(config, set(args.sweep_shapes.split(",")) if args.sweep_shapes else None)
    if args.sweep_dot:
        result["dot_sweep"] = sweep_dot_gemv(config)
        print("| fp8 one-token product | bf16 GEMV us | fp8 CUDA-core us (TB/s) | tensor-core best | us (TB/s) "
              "| choose_dot_config | us (TB/s) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for r in result["dot_sweep"]:
            print(f"| {r['shape']} | {r['bf16_us']:.1f} | {r['fp8_cuda_core_us']:.1f} ({r['fp8_cuda_core_tbps']:.2f}) "
                  f"| {r['best']} | {r['best_us']:.1f} ({r['best_tbps']:.2f}) | {r['chosen']} "
                  f"| {r['chosen_us']:.1f} ({r['chosen_tbps']:.2f}) |")
    if args.kernels_only:
        return result
    read_gbps = floor.measure_read_bandwidth_gbps()
    context = args.decode_input_len + args.decode_output_len // 2
    kv_bytes = floor.kv_bytes_read(config, context, 1, dtype_bytes=2)
    one_byte_ms = (fp8_weight_bytes_read(config) + kv_bytes) / (read_gbps * 1e6)
    floors_ms = {"bf16": floor.decode_bytes(config, context, 1, dtype_bytes=2) / (read_gbps * 1e6),
                 "fp8": one_byte_ms, "int8": one_byte_ms, "fp8-block": one_byte_ms}
    engines = {"bf16": (model_dir, {}), "fp8": (model_dir, {"quantization": "fp8"}),
               "int8": (bench_setup.make_model_dir(args.config, quantization_config=INT8_W8A8), {}),
               "fp8-block": (bench_setup.make_model_dir(args.config, quantization_config=FP8_BLOCK), {})}
    names = args.weights.split(",")
    if not {"bf16", "fp8"} <= set(names) or not set(names) <= set(engines):
        raise SystemExit(f"--weights {args.weights!r}: a comma list of {', '.join(engines)} with bf16 and fp8")
    result["read_bandwidth_gbps"] = round(read_gbps, 1)
    for name in names:
        folder, kw = engines[name]
        start = time.perf_counter()
        llm = make_llm(folder, args, **kw)
        ready_s = time.perf_counter() - start
        step = decode_step_ms(llm, max_id, args.decode_input_len, args.decode_output_len, args.decode_iters)
        tput = throughput(llm, max_id, args.num_prompts, args.input_len, args.output_len)
        bench_setup.release_engine(llm)
        result[name] = {"startup_s": round(ready_s, 1), "decode_step_ms": round(step, 3),
                        "floor_ms": round(floors_ms[name], 3), "step_over_floor": round(step / floors_ms[name], 3),
                        **{k: round(v, 1) for k, v in tput.items()}}
        print(name, result[name], flush=True)
    bf16, fp8 = result["bf16"], result["fp8"]
    result["decode_speedup"] = round(bf16["decode_step_ms"] / fp8["decode_step_ms"], 3)
    result["throughput_ratio"] = round(fp8["output_tokens_per_s"] / bf16["output_tokens_per_s"], 3)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))

    print(f"\n{result['model']}, dummy weights, {result['gpu']}, torch {result['torch']}, triton {result['triton']}; "
          f"streaming read {read_gbps / 1e3:.2f} TB/s")
    if args.sweep_gemv:
        print("| fp8 GEMV | best config | best us (TB/s) | choose_config | its us (TB/s) |")
        print("| --- | --- | --- | --- | --- |")
        for r in result["gemv_sweep"]:
            print(f"| {r['shape']} | {r['best']} | {r['best_us']:.1f} ({r['best_tbps']:.2f}) | {r['heuristic']} "
                  f"| {r['heuristic_us']:.1f} ({r['heuristic_tbps']:.2f}) |")
    print(f"| weights | batch-1 decode step ms | floor ms | step / floor | {args.num_prompts} x ({args.input_len} in, "
          f"{args.output_len} out) output tok/s | total tok/s | start-up s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        r = result[name]
        print(f"| {name} | {r['decode_step_ms']:.2f} | {r['floor_ms']:.2f} | {r['step_over_floor']:.2f} "
              f"| {r['output_tokens_per_s']:.0f} | {r['total_tokens_per_s']:.0f} | {r['startup_s']:.0f} |")
    for name in ("int8", "fp8-block"):
        if name in result:
            r = result[name]
            print(f"{name} decode step {r['decode_step_ms']:.2f} ms = {r['step_over_floor']:.2f}x its floor, "
                  f"{bf16['decode_step_ms'] / r['decode_step_ms']:.2f}x faster than bf16; throughput "
                  f"{r['output_tokens_per_s'] / bf16['output_tokens_per_s']:.2f}x bf16")
    print(f"fp8 decode step {fp8['decode_step_ms']:.2f} ms = {fp8['step_over_floor']:.2f}x its floor (target <= 1.2), "
          f"{result['decode_speedup']:.2f}x faster than bf16 (target >= 1.8); throughput {result['throughput_ratio']:.2f}x "
          f"bf16 (target >= 1.3)")
    return result


if __name__ == "__main__":
    main()
