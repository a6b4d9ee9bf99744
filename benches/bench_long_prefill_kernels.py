"""Long prefill chunks, kernel against kernel: FlashAttention-3 (kernels/fa3_prefill.py) against cuDNN
(kernels/cudnn_prefill.py) as the engine calls them, on Llama-3.1-8B's heads (32 q / 8 KV, head dim
128, bf16) over a paged cache of random blocks (issue 17).

    python benches/bench_long_prefill_kernels.py
    python benches/bench_long_prefill_kernels.py --shapes 8192x114688,16384x106496

Each shape is a chunk of C tokens after P cached ones; both paths read the same cache and write the
same rows (the gather of the context is in both timings), cuDNN with its exact-shape plan where the
context is a whole number of chunks (as the engine does for a long prompt) and its buckets elsewhere.
Per shape: ms a call (mean of 20 after 3) and TFLOP/s of causal attention, the two outputs' largest
difference; the geometric mean of cuDNN / FlashAttention-3 is printed last.
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
from ferrox.kernels import cudnn_prefill, fa3_prefill

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
SHAPES = "8192x0,2048x6144,8192x8192,8192x24576,8192x57344,8192x114688,16384x106496,3000x1000,1024x31744"


def _time_ms(fn) -> float:
    """Mean CUDA-event time of 20 calls after 3 untimed ones."""
    return statistics.mean(bench_setup.timed_ms(fn, 20))


def run_shape(chunk: int, context: int, device: torch.device) -> tuple[float, float, float]:
    """(cuDNN ms, FlashAttention-3 ms, max |difference|) for one chunk after `context` cached tokens."""
    total = context + chunk
    num_blocks = -(-total // BLOCK)
    cache = torch.randn(2, num_blocks + 37, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    block_ids = torch.randperm(num_blocks + 37, device=device)[:num_blocks].to(torch.int32)
    q = torch.randn(chunk, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    own = cudnn_prefill.gather_blocks(cache, block_ids)[:, context:total].contiguous()  # the chunk's rows
    scale = HEAD_DIM ** -0.5
    exact = context > 0 and context % chunk == 0
    if exact:
        cudnn_prefill.warm_up_exact_plans(device, torch.bfloat16, HEADS, KV_HEADS, HEAD_DIM, chunk, total + chunk)
    out_cudnn, out_fa3 = torch.empty_like(q), torch.empty_like(q)
    context_blocks = block_ids[: -(-context // BLOCK)]
    cudnn_ms = _time_ms(lambda: cudnn_prefill.cudnn_prefill_request(
        out_cudnn, q, own[0], own[1], cache, context_blocks, context, scale, exact))
    fa3_ms = _time_ms(lambda: fa3_prefill.fa3_prefill_request(out_fa3, q, cache, block_ids, context, scale))
    return cudnn_ms, fa3_ms, (out_cudnn.float() - out_fa3.float()).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma list of CHUNKxCONTEXT")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not fa3_prefill.fa3_prefill_supported(device, torch.bfloat16, HEAD_DIM):
        raise SystemExit("FlashAttention-3 is not available here (needs an sm90 GPU and the fa3-fwd wheel)")
    cudnn_prefill.enable_bucketed_plans()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  cuDNN {torch.backends.cudnn.version()}")
    print("| chunk | context | cuDNN ms (TFLOP/s) | FlashAttention-3 ms (TFLOP/s) | cuDNN / FA3 | max diff |")
    print("| --- | --- | --- | --- | --- | --- |")
    ratios = []
    for shape in args.shapes.split(","):
        chunk, context = (int(x) for x in shape.split("x"))
        torch.manual_seed(0)
        cudnn_ms, fa3_ms, diff = run_shape(chunk, context, device)
        flops = 4 * HEAD_DIM * HEADS * (chunk * context + chunk * chunk / 2)
        ratios.append(cudnn_ms / fa3_ms)
        print(f"| {chunk} | {context} | {cudnn_ms:.3f} ({flops / cudnn_ms / 1e9:.0f}) | "
              f"{fa3_ms:.3f} ({flops / fa3_ms / 1e9:.0f}) | {ratios[-1]:.3f} | {diff:.1e} |")
        torch.cuda.empty_cache()
    print(f"\nFlashAttention-3 against cuDNN, geometric mean over {len(ratios)} shapes: "
          f"{math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}x")


if __name__ == "__main__":
    main()
