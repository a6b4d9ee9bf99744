"""The fused MoE layer's grouped GEMM (kernels/fused_moe.py) at prefill and batch sizes, 16-bit
experts: time of one layer per tile config, the one `choose_gemm_config` picks first.

    python benches/bench_moe_gemm.py                                  # Qwen3-30B-A3B and Mixtral-8x7B
    python benches/bench_moe_gemm.py --models qwen3-30b-a3b --tokens 256,8192

Shapes (hidden, expert intermediate, experts, top-k): Qwen3-30B-A3B (2048, 768, 128, 8), Mixtral-8x7B
(4096, 14336, 8, 2), bf16 weights and activations, softmax top-k routing of random logits. Timing as
in bench_mxfp4.py: LAYERS copies of the layer (own experts, own routing) captured in one CUDA graph and
replayed; time per layer = replay time / LAYERS, so a layer's experts are not in L2 when it runs again.
Also prints each config's rate in TFLOP/s (2 x pairs x 3 x hidden x intermediate flops a layer).
Prints one table per (model, tokens) and the default's ratio to the best config last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from ferrox.kernels.fused_moe import GemmConfig, choose_gemm_config, fused_moe  # noqa: E402

MODELS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
LAYERS = {"qwen3-30b-a3b": 4, "mixtral-8x7b": 2}
CANDIDATES = [GemmConfig(*c) for c in (
    (16, 64, 64, 4, 3), (16, 128, 64, 4, 4), (32, 64, 64, 4, 3), (32, 128, 64, 4, 4), (64, 64, 64, 4, 3),
    (64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3), (128, 256, 64, 8, 3), (64, 128, 128, 8, 3), (128, 128, 128, 8, 2),
)]


def _time(layers, xs, routes, cfg: GemmConfig | None, iters: int = 10) -> float:
    """Microseconds per layer of the layers captured in one CUDA graph."""
    def step():
        return [fused_moe(x, w13, w2, w, i, small_batch=False, config=cfg)
                for (w13, w2), x, (w, i) in zip(layers, xs, routes, strict=True)]

    ms, _ = bench_setup.graph_replay_ms(step, iters)
    return ms * 1e3 / len(layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    parser.add_argument("--tokens", default="256,2048,8192")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_moe_gemm.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}; fused MoE grouped GEMM, bf16 experts; us a layer (TFLOP/s)\n")
    summary = []
    for model in args.models.split(","):
        hidden, inter, experts, top_k = MODELS[model]
        gen = torch.Generator(device="cuda").manual_seed(0)
        layers = [(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02,
                   torch.randn(experts, hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02)
                  for _ in range(LAYERS[model])]
        for tokens in (int(t) for t in args.tokens.split(",")):
            xs = [torch.randn(tokens, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
                  for _ in layers]
            routes = []
            for _ in layers:
                values, ids = torch.topk(torch.randn(tokens, experts, device="cuda", generator=gen), top_k, dim=-1)
                routes.append((torch.softmax(values, dim=-1), ids))
            flops = 2 * tokens * top_k * 3 * hidden * inter
            default = choose_gemm_config(tokens * top_k, experts)
            print(f"{model}, {tokens} tokens ({tokens * top_k / experts:.0f} rows an expert), default {default}")
            timings: dict[GemmConfig, float] = {}
            for cfg in dict.fromkeys([default, *CANDIDATES]):
                try:
                    timings[cfg] = _time(layers, xs, routes, cfg)
                except Exception as exc:  # (a tile that does not fit shared memory)
                    print(f"  {cfg}: {type(exc).__name__}")
                    continue
                us = timings[cfg]
                print(f"  {cfg.block_m} x {cfg.block_n} x {cfg.block_k}, {cfg.num_warps} warps, {cfg.num_stages} "
                      f"stages: {us:.1f} ({flops / us / 1e6:.0f})")
            best = min(timings, key=timings.__getitem__)
            summary.append((model, tokens, default, timings[default], best, timings[best]))
        del layers
        torch.cuda.empty_cache()
    print("\n| model | tokens | default us | best config | best us | default / best |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model, tokens, _default, d_us, best, b_us in summary:
        print(f"| {model} | {tokens} | {d_us:.1f} | {best.block_m}x{best.block_n}x{best.block_k} w{best.num_warps} "
              f"s{best.num_stages} | {b_us:.1f} | {d_us / b_us:.2f} |")


if __name__ == "__main__":
    main()
