"""DeepSeek's latent attention on long prefill chunks: absorbed (the Triton MLA kernel, then W_UV) against
expanded (kernels/mla_prefill.py: latent rows expanded into 192 / 128-dim heads, FlashAttention-3), one layer
of one request, bf16, V2-Lite's 16 heads and V3's 128 (latent 512 + 64), over a paged cache of random blocks.

    python benches/bench_mla_prefill.py
    python benches/bench_mla_prefill.py --cases 16x8192x24576

A case is HEADSxCHUNKxCONTEXT. Both paths start from the layer's q_nope / q_pe (the absorbed one multiplies
q_nope into the latent first, as the layer does) and end with the heads' outputs [T, H, 128]; ms a call
(mean of 5 after 3), the outputs' relative difference, and the geometric mean of absorbed / expanded last.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402
from ferrox.kernels import mla_prefill
from ferrox.kernels.mla_attention import mla_attention

RANK, ROPE, NOPE, V, BLOCK = 512, 64, 128, 128, 16
CASES = "16x2048x0,16x8192x0,16x8192x24576,16x8192x57344,128x2048x0,128x8192x8192"


def _time_ms(fn) -> float:
    """Mean CUDA-event time of 5 calls after 3 untimed ones."""
    return statistics.mean(bench_setup.timed_ms(fn, 5))


def run_case(heads: int, chunk: int, context: int, device: torch.device) -> tuple[float, float, float]:
    total = context + chunk
    blocks = -(-total // BLOCK)
    dtype = torch.bfloat16
    cache = torch.randn(1, blocks + 11, BLOCK, 1, RANK + ROPE, device=device, dtype=dtype)
    block_ids = torch.randperm(blocks + 11, device=device)[:blocks].to(torch.int32)
    q_nope = torch.randn(chunk, heads, NOPE, device=device, dtype=dtype)
    q_pe = torch.randn(chunk, heads, ROPE, device=device, dtype=dtype)
    w_uk = torch.randn(heads, NOPE, RANK, device=device, dtype=dtype) * RANK ** -0.5
    w_uv = torch.randn(heads, RANK, V, device=device, dtype=dtype) * RANK ** -0.5
    scale = (NOPE + ROPE) ** -0.5
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([total], dtype=torch.int32, device=device)
    table = block_ids[None]
    both_planes = cache.expand(2, -1, -1, -1, -1)

    def absorbed() -> torch.Tensor:
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q_full = torch.cat((q_latent, q_pe), dim=-1)
        o = mla_attention(q_full, both_planes, starts, seq_lens, table, kv_lora_rank=RANK, max_query_len=chunk,
                          max_seq_len=total, scale=scale)
        return torch.bmm(o[..., :RANK].transpose(0, 1), w_uv).transpose(0, 1)

    out = torch.empty(chunk, heads, V, device=device, dtype=dtype)

    def expanded() -> torch.Tensor:
        mla_prefill.mla_prefill_request(out, q_nope, q_pe, both_planes, block_ids, context, w_uk, w_uv, scale)
        return out

    absorbed_ms, expanded_ms = _time_ms(absorbed), _time_ms(expanded)
    want, got = absorbed().float(), expanded().float()
    return absorbed_ms, expanded_ms, ((got - want).norm() / want.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="comma list of HEADSxCHUNKxCONTEXT")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not mla_prefill.expanded_supported(device, torch.bfloat16, torch.bfloat16, NOPE + ROPE, V):
        raise SystemExit("the expanded path needs an sm90 GPU and the fa3-fwd wheel")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print("| heads | chunk | context | absorbed ms | expanded ms | absorbed / expanded | rel. diff |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = []
    for case in args.cases.split(","):
        heads, chunk, context = (int(x) for x in case.split("x"))
        torch.manual_seed(0)
        absorbed_ms, expanded_ms, diff = run_case(heads, chunk, context, device)
        ratios.append(absorbed_ms / expanded_ms)
        print(f"| {heads} | {chunk} | {context} | {absorbed_ms:.3f} | {expanded_ms:.3f} | {ratios[-1]:.2f} | {diff:.1e} |")
        torch.cuda.empty_cache()
    print(f"\nexpanded MLA prefill against absorbed, geometric mean over {len(ratios)} cases: "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.2f}x")


if __name__ == "__main__":
    main()
