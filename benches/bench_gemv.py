"""One-token matrix-vector kernels (kernels/gemv.py) against cuBLAS and the unfused op sequence,
at Llama-3.1-8B's decode shapes, bf16, on one GPU. Prints a table last.

    PYTHONPATH=python python benches/bench_gemv.py            # fused vs unfused per op group
    PYTHONPATH=python python benches/bench_gemv.py --sweep    # plus a launch-config sweep per shape

Every timing replays a CUDA graph that calls the op once per weight copy, with enough distinct
copies (>= 2 GB) that weights stream from HBM as they do in a decode step, and launch gaps count
as they do there. Bandwidth = weight bytes / time, next to a device-to-device copy (read + write
bytes / time) measured in the same run.
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
import torch.nn.functional as F
from ferrox.kernels.activation import silu_and_mul
from ferrox.kernels.gemv import GemvConfig, choose_config, gemv, qkv_rope_gemv
from ferrox.kernels.reshape_and_cache import reshape_and_cache
from ferrox.kernels.rmsnorm import fused_add_rms_norm
from ferrox.kernels.rotary import neox_cos_sin_cache, rotary_neox_

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

HIDDEN, INTER, VOCAB, HQ, HKV, D = 4096, 14336, 128256, 32, 8, 128
DTYPE = torch.bfloat16
SHAPES = {"qkv": ((HQ + 2 * HKV) * D, HIDDEN), "o_proj": (HIDDEN, HQ * D), "gate_up": (2 * INTER, HIDDEN),
          "down": (HIDDEN, INTER), "lm_head": (VOCAB, HIDDEN)}


def graph_ms(calls, replays: int = 10) -> float:
    """Milliseconds per call: the calls captured once into a graph, replayed `replays` times."""
    ms, _ = bench_setup.graph_replay_ms(lambda: [call() for call in calls], replays)
    return ms / len(calls)


def weights(rows: int, k: int) -> list[torch.Tensor]:
    copies = max(2, math.ceil(2e9 / (rows * k * 2)))
    return [torch.randn(rows, k, device="cuda", dtype=DTYPE) / k ** 0.5 for _ in range(copies)]


def sweep(rows_out: dict) -> None:
    """Every launch config per shape (plain products, and the two fused variants whose programs
    hold two accumulators), best first, next to cuBLAS and the config choose_config picks."""
    dev = torch.device("cuda")
    x = {k: torch.randn(1, k, device=dev, dtype=DTYPE) for k in (HIDDEN, INTER)}
    g = torch.ones(HIDDEN, device=dev, dtype=DTYPE)
    rope = neox_cos_sin_cache(D, 16, 500000.0, device=dev)[3]
    cache = torch.zeros(2, 64, 16, HKV, D, device=dev, dtype=DTYPE)
    slots = torch.tensor([5], device=dev)
    variants = {name: (name, lambda w, cfg, k=k: gemv(x[k], w, config=cfg)) for name, (_, k) in SHAPES.items()}
    variants["gate_up+silu"] = ("gate_up", lambda w, cfg: gemv(x[HIDDEN], w, norm_weight=g, silu_mul=True,
                                                                config=cfg))
    variants["down+residual"] = ("down", lambda w, cfg: gemv(x[INTER], w, residual=x[HIDDEN], config=cfg))
    variants["qkv+rope"] = ("qkv", lambda w, cfg: qkv_rope_gemv(
        x[HIDDEN], w, None, norm_weight=g, eps=1e-5, rope_row=rope, slot_mapping=slots,
        kv_cache=cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, config=cfg))
    for name, (shape, call) in variants.items():
        n, k = SHAPES[shape]
        ws = weights(n, k)
        results = []
        for block_n in (1, 2, 4, 8, 16, 32):
            for block_k in (256, 512, 1024):
                for warps in (4, 8):
                    if block_n * block_k > 16384:
                        continue  # accumulators spill
                    cfg = GemvConfig(block_n, block_k, warps)
                    results.append((graph_ms([partial(call, w, cfg) for w in ws]), cfg))
        results.sort(key=lambda r: r[0])
        cublas = graph_ms([lambda w=w, k=k: F.linear(x[k], w) for w in ws])
        heur = choose_config({"gate_up+silu": "silu", "qkv+rope": "rope"}.get(name, "plain"), k)
        heur_ms = graph_ms([partial(call, w, heur) for w in ws])
        rows_out.setdefault("sweep", []).append(dict(
            shape=name, cublas_us=cublas * 1e3, best=str(results[0][1]), best_us=results[0][0] * 1e3,
            best_tbps=n * k * 2 / results[0][0] / 1e9, heuristic=str(heur), heuristic_us=heur_ms * 1e3,
            top5=[(round(ms * 1e3, 1), str(c)) for ms, c in results[:5]]))
        print(rows_out["sweep"][-1], flush=True)
        del ws


def fused_vs_unfused(rows_out: dict) -> None:
    dev = torch.device("cuda")
    eps = 1e-5
    g = torch.ones(HIDDEN, device=dev, dtype=DTYPE)
    cos_sin = neox_cos_sin_cache(D, 4096, 500000.0, device=dev)
    pos = torch.tensor([100], device=dev)
    cache = torch.zeros(2, 512, 16, HKV, D, device=dev, dtype=DTYPE)
    slots = torch.tensor([1234], device=dev)
    x, res = (torch.randn(1, HIDDEN, device=dev, dtype=DTYPE) for _ in range(2))
    act = torch.randn(1, INTER, device=dev, dtype=DTYPE)
    q_size = HQ * D

    def qkv_unfused(w):
        h, _ = fused_add_rms_norm(x, res, g, eps)
        qkv = F.linear(h, w)
        q = qkv[:, :q_size].view(1, HQ, D)
        k = qkv[:, q_size:q_size + HKV * D].view(1, HKV, D)
        rotary_neox_(pos, q, k, cos_sin)
        reshape_and_cache(k, qkv[:, q_size + HKV * D:].view(1, HKV, D), cache, slots)

    # Fused, the residual add happened in the previous projection's epilogue (o_proj / down below).
    def qkv_fused(w):
        qkv_rope_gemv(x, w, None, norm_weight=g, eps=eps, rope_row=cos_sin[100], slot_mapping=slots,
                      kv_cache=cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)

    def gate_up_unfused(w):
        h, _ = fused_add_rms_norm(x, res, g, eps)
        silu_and_mul(F.linear(h, w))

    cases = {
        "qkv (+norm, rotary, KV write)": ("qkv", qkv_unfused, qkv_fused),
        "o_proj (+residual)": ("o_proj", lambda w: F.linear(x, w), lambda w: gemv(x, w, residual=res)),
        "gate_up (+norm, SiLU)": ("gate_up", gate_up_unfused,
                                  lambda w: gemv(x, w, norm_weight=g, eps=eps, silu_mul=True)),
        "down (+residual)": ("down", lambda w: F.linear(act, w), lambda w: gemv(act, w, residual=res)),
        "lm_head (fp32 logits)": ("lm_head", lambda w: F.linear(x, w).float(),
                                  lambda w: gemv(x, w, out_dtype=torch.float32)),
    }
    for label, (shape, unfused, fused) in cases.items():
        n, k = SHAPES[shape]
        ws = weights(n, k)
        t_unfused = graph_ms([partial(unfused, w) for w in ws])
        t_fused = graph_ms([partial(fused, w) for w in ws])
        rows_out.setdefault("fused", []).append(dict(
            group=label, unfused_us=t_unfused * 1e3, fused_us=t_fused * 1e3, speedup=t_unfused / t_fused,
            fused_tbps=n * k * 2 / t_fused / 1e9))
        print(rows_out["fused"][-1], flush=True)
        del ws
    layer_unfused = sum(r["unfused_us"] for r in rows_out["fused"][:4])
    layer_fused = sum(r["fused_us"] for r in rows_out["fused"][:4])
    rows_out["layer"] = dict(unfused_us=layer_unfused, fused_us=layer_fused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    out: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["copy_tbps"] = bench_setup.measure_copy_bandwidth_gbps() / 1e3  # the same measure as bench_latency's floor
    if args.sweep:
        sweep(out)
    fused_vs_unfused(out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_gemv.json").write_text(json.dumps(out, indent=1))
    print(f"\ncopy bandwidth {out['copy_tbps']:.2f} TB/s ({out['gpu']}, torch {out['torch']})")
    if args.sweep:
        print("| shape | cuBLAS us | best config | best us (TB/s) | heuristic | heuristic us |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in out["sweep"]:
            print(f"| {r['shape']} | {r['cublas_us']:.1f} | {r['best']} | {r['best_us']:.1f} ({r['best_tbps']:.2f}) "
                  f"| {r['heuristic']} | {r['heuristic_us']:.1f} |")
    print("| op group (Llama-3.1-8B, batch 1) | unfused us | fused us | speedup | fused TB/s |")
    print("| --- | --- | --- | --- | --- |")
    for r in out["fused"]:
        print(f"| {r['group']} | {r['unfused_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.2f}x "
              f"| {r['fused_tbps']:.2f} |")
    print(f"decoder layer (4 groups, attention excluded): unfused {out['layer']['unfused_us']:.1f} us, "
          f"fused {out['layer']['fused_us']:.1f} us, ratio {out['layer']['unfused_us'] / out['layer']['fused_us']:.3f}")


if __name__ == "__main__":
    main()
