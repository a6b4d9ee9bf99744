"""gpt-oss's MoE layer with MXFP4 experts kept packed (kernels/fused_moe.py, MXFP4) against the same
experts dequantized to bf16, in the same fused kernels: step time of one layer at 1, 64 and 1024 tokens,
and for one token the bytes the layer must read over its time.

    python benches/bench_mxfp4.py                       # gpt-oss-20b and gpt-oss-120b layer shapes
    python benches/bench_mxfp4.py --models 20b --tokens 1,4
    python benches/bench_mxfp4.py --sweep               # also the one-token MXFP4 kernels' tile choices

Shapes: hidden 2880, experts of 2880, top 4, 32 experts (20b) or 128 (120b), biases on both products and
the clamped SwiGLU (alpha 1.702, limit 7), bf16 activations. The experts are random MXFP4 bytes (every
code) with scales around 2**-6; the bf16 experts are their exact dequantization, so both formats compute
the same function (the relative difference is printed as a check).

Timing: LAYERS copies of the layer, each with its own experts and routing, captured in one CUDA graph
and replayed (no launch overhead; a layer's experts are not in L2 when it runs again); time per layer
is the replay time over LAYERS. Bytes read at one token: the 4 chosen experts' gate/up and down
weights (packed codes and scales, or bf16) and biases. Needs a CUDA GPU; runs in well under 2 minutes
on an H100.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from ferrox.kernels.fused_moe import _MXFP4_TILES, GemmConfig, GemvConfig, _by_load, fused_moe  # noqa: E402
from ferrox.layers.quant.mxfp4 import dequantize_mxfp4  # noqa: E402

HIDDEN, INTER, TOP_K = 2880, 2880, 4
MODELS = {"20b": 32, "120b": 128}  # experts per layer
LAYERS = 4
SWIGLU = (1.702, 7.0)


def _experts(num_experts: int, gen: torch.Generator, fmt: str) -> dict[str, torch.Tensor]:
    """One layer's experts: packed (w13 / w2 uint8, E8M0 scales) or their bf16 dequantization."""
    out: dict[str, torch.Tensor] = {}
    for name, rows, cols in (("w13", 2 * INTER, HIDDEN), ("w2", HIDDEN, INTER)):
        blocks = torch.randint(0, 256, (num_experts, rows, cols // 32, 16), dtype=torch.uint8, device="cuda",
                               generator=gen)
        scales = torch.randint(118, 124, (num_experts, rows, cols // 32), dtype=torch.uint8, device="cuda",
                               generator=gen)
        if fmt == "mxfp4":
            out[name], out[f"{name}_scale"] = blocks.flatten(-2), scales
        else:  # a few experts at a time: the float32 temporaries of the whole stack would not fit beside it
            dense = torch.empty(num_experts, rows, cols, dtype=torch.bfloat16, device="cuda")
            for e in range(0, num_experts, 8):
                dense[e:e + 8] = dequantize_mxfp4(blocks[e:e + 8], scales[e:e + 8], torch.bfloat16)
            out[name] = dense
    out["w13_bias"] = torch.randn(num_experts, 2 * INTER, device="cuda", generator=gen).bfloat16() * 0.1
    out["w2_bias"] = torch.randn(num_experts, HIDDEN, device="cuda", generator=gen).bfloat16() * 0.1
    return out


def _routing(tokens: int, num_experts: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(torch.randn(tokens, num_experts, device="cuda", generator=gen), TOP_K, dim=-1)
    return torch.softmax(values, dim=-1), ids


def _run(layer: dict[str, torch.Tensor], x: torch.Tensor, weights, ids, gemv: GemvConfig | None = None,
         gemm: GemmConfig | None = None):
    return fused_moe(x, layer["w13"], layer["w2"], weights, ids, w13_scale=layer.get("w13_scale"),
                     w2_scale=layer.get("w2_scale"), w13_bias=layer["w13_bias"], w2_bias=layer["w2_bias"],
                     swiglu_oai=SWIGLU, gemv_config=gemv, config=gemm)


def _time_layers(layers, xs, routes, gemv: GemvConfig | None = None, iters: int = 20,
                 gemm: GemmConfig | None = None) -> tuple[float, torch.Tensor]:
    """(microseconds per layer, the first layer's output) of the layers captured in one CUDA graph."""
    def step():
        return [_run(layer, x, w, i, gemv, gemm) for layer, x, (w, i) in zip(layers, xs, routes, strict=True)]

    ms, outs = bench_setup.graph_replay_ms(step, iters)
    return ms * 1e3 / len(layers), outs[0].clone()


def _one_token_bytes(layer: dict[str, torch.Tensor], ids: torch.Tensor) -> int:
    experts = ids.unique().numel()
    per_expert = sum(layer[n][0].nbytes for n in ("w13", "w2", "w13_scale", "w2_scale", "w13_bias", "w2_bias")
                     if n in layer)
    return experts * per_expert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="20b,120b")
    parser.add_argument("--tokens", default="1,64,1024")
    parser.add_argument("--sweep", action="store_true", help="also time one-token MXFP4 tile choices")
    parser.add_argument("--gemm-sweep", action="store_true",
                        help="also time the grouped GEMM's configs for MXFP4 at the largest token count")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mxfp4.py needs a CUDA GPU")
    token_counts = [int(t) for t in args.tokens.split(",")]
    print(f"{torch.cuda.get_device_name()}; gpt-oss MoE layer: hidden {HIDDEN}, experts of {INTER}, top {TOP_K}, "
          f"biases + clamped SwiGLU, bf16 activations; {LAYERS} layers in a CUDA graph\n")
    rows = []
    for model in args.models.split(","):
        num_experts = MODELS[model]
        results: dict[str, dict[int, tuple[float, torch.Tensor, int]]] = {}
        for fmt in ("bf16", "mxfp4"):
            gen = torch.Generator(device="cuda").manual_seed(0)  # the same codes for both formats
            layers = [_experts(num_experts, gen, fmt) for _ in range(LAYERS)]
            results[fmt] = {}
            for tokens in token_counts:
                gen_in = torch.Generator(device="cuda").manual_seed(tokens)
                xs = [torch.randn(tokens, HIDDEN, device="cuda", generator=gen_in).bfloat16() for _ in layers]
                routes = [_routing(tokens, num_experts, gen_in) for _ in layers]
                us, out = _time_layers(layers, xs, routes)
                results[fmt][tokens] = (us, out, _one_token_bytes(layers[0], routes[0][1]) if tokens == 1 else 0)
                if fmt == "mxfp4" and tokens == 1 and args.sweep:
                    _sweep(model, layers, xs, routes)
                if fmt == "mxfp4" and tokens == max(token_counts) and args.gemm_sweep:
                    _gemm_sweep(model, tokens, num_experts, layers, xs, routes)
            del layers
            torch.cuda.empty_cache()
        for tokens in token_counts:
            (bf_us, bf_out, bf_bytes), (mx_us, mx_out, mx_bytes) = results["bf16"][tokens], results["mxfp4"][tokens]
            err = float((mx_out.float() - bf_out.float()).norm() / bf_out.float().norm())
            rows.append((model, tokens, bf_us, mx_us, bf_bytes / bf_us / 1e3 if tokens == 1 else None,
                         mx_bytes / mx_us / 1e3 if tokens == 1 else None, err))
    print("| model | tokens | bf16 us/layer | mxfp4 us/layer | mxfp4 speed-up | bf16 GB/s | mxfp4 GB/s | rel. diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for model, tokens, bf_us, mx_us, bf_gbs, mx_gbs, err in rows:
        gbs = (f"{bf_gbs:.0f} | {mx_gbs:.0f}" if bf_gbs is not None and mx_gbs is not None else "- | -")
        print(f"| gpt-oss-{model} | {tokens} | {bf_us:.1f} | {mx_us:.1f} | {bf_us / mx_us:.2f}x | {gbs} | {err:.1e} |")
    one = [r for r in rows if r[1] == 1]
    if one:
        model, _, bf_us, mx_us, _, mx_gbs, _ = one[-1]
        print(f"\nheadline: gpt-oss-{model} MoE layer at one token: MXFP4 {mx_us:.1f} us vs bf16 {bf_us:.1f} us "
              f"({bf_us / mx_us:.2f}x), MXFP4 experts read at {mx_gbs:.0f} GB/s")


def _sweep(model: str, layers, xs, routes) -> None:
    """One-token MXFP4 tiles (gate/up rows x K tile, down rows x K tile): us per layer each."""
    print(f"one-token MXFP4 tiles, gpt-oss-{model} (gate/up rows x K, down rows x K: us/layer)")
    for gate_up in ((2, 1024), (4, 512), (4, 1024), (8, 512)):
        for down in ((2, 512), (2, 1024), (4, 512), (8, 256)):
            cfg = GemvConfig(gate_up[0], gate_up[1], down[0], down[1], 4)
            us, _ = _time_layers(layers, xs, routes, cfg, iters=10)
            print(f"  {gate_up[0]} x {gate_up[1]}, {down[0]} x {down[1]}: {us:.1f}")


def _gemm_sweep(model: str, tokens: int, num_experts: int, layers, xs, routes) -> None:
    """The grouped GEMM's configs (rows x columns x K tile, warps, stages) for MXFP4 experts: us per layer."""
    base = _by_load(tokens * TOP_K, num_experts, _MXFP4_TILES)
    print(f"grouped GEMM configs, MXFP4, gpt-oss-{model}, {tokens} tokens (default {base}; us/layer)")
    best = None
    for m in (64, 128):
        for n in (64, 128):
            for k in (64, 128, 256):
                for warps in (4, 8):
                    cfg = GemmConfig(m, n, k, warps, 3)
                    try:
                        us, _ = _time_layers(layers, xs, routes, iters=10, gemm=cfg)
                    except Exception as exc:  # (a tile that does not fit shared memory)
                        print(f"  {m} x {n} x {k}, {warps} warps: {type(exc).__name__}")
                        continue
                    print(f"  {m} x {n} x {k}, {warps} warps: {us:.1f}")
                    if best is None or us < best[0]:
                        best = (us, cfg)
    if best is not None:
        for stages in (2, 4):
            cfg = GemmConfig(best[1].block_m, best[1].block_n, best[1].block_k, best[1].num_warps, stages)
            try:
                us, _ = _time_layers(layers, xs, routes, iters=10, gemm=cfg)
            except Exception as exc:
                print(f"  {cfg}: {type(exc).__name__}")
                continue
            print(f"  {cfg}: {us:.1f}")
        print(f"  best of the grid: {best[1]} {best[0]:.1f}")


if __name__ == "__main__":
    main()
