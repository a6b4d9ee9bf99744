"""The honest floor of a decode step: the bytes it must read over the best streaming-read bandwidth.

    floor_ms = decode_bytes(config, context_len, batch) / measure_read_bandwidth_gbps() / 1e6

Bytes a decode step must read: every weight except the input embedding (a step gathers one row of
it per token; with tied embeddings the LM head still reads the whole matrix once), the experts its
tokens route to (MoE), and the K/V its requests attend over. Bandwidth: the best of several
read-only streaming kernels over a 4 GiB buffer, measured in the same run (a decode step streams
its weights; a device-to-device copy also writes, and runs slower than a pure read).

The older floor (all weight bytes over copy bandwidth, `bench_setup.measure_copy_bandwidth_gbps`)
is lenient twice over -- it counts the embedding table and divides by the slower copy rate -- and
the benchmarks report it second, labelled "copy floor".

    python benches/floor.py                      # the numbers for Llama-3.1-8B at batch 1, context 160
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_setup  # noqa: E402

READ_BUFFER_BYTES = 4 << 30  # far beyond L2 (50 MB on an H200), as a model's weights are


# ---- bytes --------------------------------------------------------------------------------------
def _moe_layout(config: dict[str, Any]) -> tuple[int, int, int, int] | None:
    """(experts, experts per token, expert intermediate size, shared-expert intermediate size), or None
    for a dense model. Field names of Mixtral (num_local_experts), Qwen2/3-MoE (num_experts,
    moe_intermediate_size, shared_expert_intermediate_size)."""
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        return None
    inter = config.get("moe_intermediate_size") or config["intermediate_size"]
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return int(experts), int(config["num_experts_per_tok"]), int(inter), shared


def _sparse_layer(config: dict[str, Any], layer: int) -> bool:
    """Qwen-MoE's dense-layer knobs (mlp_only_layers, decoder_sparse_step); Mixtral: every layer."""
    step = int(config.get("decoder_sparse_step") or 1)
    return layer not in (config.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def expected_experts_read(num_experts: int, top_k: int, batch: int) -> float:
    """Experts of one layer a batch touches when routing is uniform: each expert is missed by every
    token with probability (1 - k/E)^batch. Exactly k at batch 1."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def weight_bytes_read(config: dict[str, Any], batch: int = 1, dtype_bytes: int = 2) -> int:
    """Weight bytes one decode step of `batch` tokens reads: all weights but the input embedding,
    and only the experts its tokens route to. MoE routers are stored in float32 (as ferrox keeps them)."""
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attn = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    if config.get("attention_bias") or config.get("model_type") == "qwen2":
        attn += (heads + 2 * kv_heads) * head_dim
    norms = 2 * hidden + (2 * head_dim if config.get("model_type") in ("qwen3", "qwen3_moe") else 0)
    dense_mlp = 3 * hidden * config["intermediate_size"]
    moe = _moe_layout(config)
    total = 0.0
    for layer in range(layers):
        total += (attn + norms) * dtype_bytes
        if moe is None or not _sparse_layer(config, layer):
            total += dense_mlp * dtype_bytes
            continue
        experts, top_k, inter, shared = moe
        total += expected_experts_read(experts, top_k, batch) * 3 * hidden * inter * dtype_bytes
        total += experts * hidden * 4  # the router
        if shared:
            total += (3 * hidden * shared + hidden) * dtype_bytes  # shared expert and its gate
    # Final norm and the LM head; a tied LM head is the embedding matrix, read whole here (once).
    total += (hidden + vocab * hidden) * dtype_bytes
    return int(total)


def kv_bytes_read(config: dict[str, Any], context_len: int, batch: int = 1, dtype_bytes: int = 2) -> int:
    """K and V of context_len positions (the new token's included), per request, every layer."""
    return batch * context_len * bench_setup.kv_bytes_per_token(config, dtype_bytes)


def decode_bytes(config: dict[str, Any], context_len: int, batch: int, dtype_bytes: int = 2,
                 kv_dtype_bytes: int | None = None) -> int:
    """Bytes one decode step must read: weights without the input embedding + the KV it attends
    (kv_dtype_bytes: the cache's element, 1 for an FP8 cache; None: the weights')."""
    kv = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
    return weight_bytes_read(config, batch, dtype_bytes) + kv_bytes_read(config, context_len, batch, kv)


def honest_floor_ms(config: dict[str, Any], context_len: int, batch: int, read_gbps: float, *,
                    dtype_bytes: int = 2, tp: int = 1) -> float:
    """The decode step's floor in ms: decode_bytes over the measured read bandwidth (GB/s). Under
    tensor parallelism each of `tp` GPUs reads its share (the floor per GPU)."""
    return decode_bytes(config, context_len, batch, dtype_bytes) / tp / (read_gbps * 1e6)


def copy_floor_ms(config: dict[str, Any], copy_gbps: float, *, dtype_bytes: int = 2, tp: int = 1) -> float:
    """The older, lenient floor: every weight byte (input embedding included) over copy bandwidth."""
    return bench_setup.num_params(config) * dtype_bytes / tp / (copy_gbps * 1e6)


# ---- bandwidth ------------------------------------------------------------------------------------
try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only box: the bandwidth cannot be measured there anyway
    triton = None

if triton is not None:

    @triton.jit
    def _stream_sum(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
        # Grid-strided: neighbouring programs read neighbouring blocks, each element once, straight past
        # the cache (evict_first), as the decode GEMVs stream their weights. The sum keeps the loads live.
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
        tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def measure_read_bandwidth_gbps(num_bytes: int = READ_BUFFER_BYTES, reps: int = 10) -> float:
    """Best streaming-read bandwidth in GB/s (bytes read per second / 1e9): a Triton read-only kernel in
    a few launch shapes and torch's sum, each over the same buffer; the fastest run of each, the best
    of them. Needs CUDA; the buffer's memory goes back to the driver afterwards."""
    import torch

    if not torch.cuda.is_available() or triton is None:
        raise RuntimeError("measure_read_bandwidth_gbps needs a CUDA device and Triton")
    if num_bytes // 4 >= 2**31:
        raise ValueError(f"num_bytes: at most 8 GiB (int32 offsets), got {num_bytes}")
    try:
        return max(_read_times_gbps(num_bytes // 4, reps).values())
    finally:
        torch.cuda.empty_cache()


def _read_times_gbps(n: int, reps: int) -> dict[str, float]:
    import torch

    buf = torch.ones(n, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    candidates: dict[str, Any] = {"torch.sum": lambda: buf.sum()}
    for waves, block, warps in ((4, 4096, 8), (8, 2048, 4), (2, 8192, 16), (16, 1024, 4)):
        programs = sms * waves
        partial = torch.empty(programs, dtype=torch.int32, device="cuda")

        def launch(programs: int = programs, partial: Any = partial, block: int = block, warps: int = warps) -> None:
            _stream_sum[(programs,)](buf, partial, n, BLOCK=block, num_warps=warps)

        candidates[f"triton {programs}x{block}/{warps}w"] = launch
    return {name: n * 4 / _best_ms(fn, reps) / 1e6 for name, fn in candidates.items()}


def _best_ms(fn: Any, reps: int) -> float:
    """The fastest of `reps` timed runs (after 3 untimed): the bandwidth the hardware reached."""
    return min(bench_setup.timed_ms(fn, reps))


# ---- report ---------------------------------------------------------------------------------------
def floors(config: dict[str, Any], context_len: int, batch: int = 1, *, tp: int = 1, dtype_bytes: int = 2,
           read_gbps: float | None = None, copy_gbps: float | None = None) -> dict[str, float]:
    """Both floors and their inputs (bandwidths measured here unless given), for a benchmark's JSON."""
    read_gbps = read_gbps if read_gbps is not None else measure_read_bandwidth_gbps()
    copy_gbps = copy_gbps if copy_gbps is not None else bench_setup.measure_copy_bandwidth_gbps()
    return {
        "read_bandwidth_gbps": round(read_gbps, 1),
        "bytes_read_gb": round(decode_bytes(config, context_len, batch, dtype_bytes) / tp / 1e9, 3),
        "honest_floor_ms": round(honest_floor_ms(config, context_len, batch, read_gbps, dtype_bytes=dtype_bytes,
                                                 tp=tp), 3),
        "copy_bandwidth_gbps": round(copy_gbps, 1),
        "weight_gb": round(bench_setup.num_params(config) * dtype_bytes / tp / 1e9, 2),
        "copy_floor_ms": round(copy_floor_ms(config, copy_gbps, dtype_bytes=dtype_bytes, tp=tp), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="the honest and the copy floor of a decode step")
    parser.add_argument("--config", default=str(bench_setup.LLAMA_8B_CONFIG))
    parser.add_argument("--context-len", type=int, default=160, help="KV positions each request attends")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    result = floors(config, args.context_len, args.batch, tp=args.tp)
    print(json.dumps(result, indent=1))
    print(f"honest floor {result['honest_floor_ms']:.3f} ms ({result['bytes_read_gb']} GB at "
          f"{result['read_bandwidth_gbps'] / 1e3:.2f} TB/s streaming read); "
          f"copy floor {result['copy_floor_ms']:.3f} ms "
          f"({result['weight_gb']} GB at {result['copy_bandwidth_gbps'] / 1e3:.2f} TB/s copy)")


if __name__ == "__main__":
    main()
