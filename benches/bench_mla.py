"""DeepSeek MLA attention on the GPU: the Triton latent kernels (kernels/mla_attention.py, through
MlaTritonBackend: latent write + attention) against the torch reference backend the model ran before them
(attention/torch_backend.py, same write + attend contract), one layer's attention call.

    PYTHONPATH=python python benches/bench_mla.py            # the table
    PYTHONPATH=python python benches/bench_mla.py --sweep    # plus launch configs x split counts per case

Decode rows are timed twice from CUDA graphs: with the step's own max_seq_len, and as the engine's decode
graphs launch them ("engine ms": max_seq_len fixed to --max-model-len at capture, so the split count and
launch config come from that bound; each split's length from the live context). The sweep times every
config x split count both ways and keeps all timings in the JSON (`sweep`), the best per case in the table.

Shapes: a latent row of 512 + 64 dims (bf16, block size 16); V2-Lite's 16 query heads and V3's 128; decode
batches of 1 / 8 / 32 requests at 1k / 8k / 32k tokens of context each, and one fresh 4096-token prefill.
Columns: the torch backend eagerly (OOM / error where its gather + SDPA does not fit), the Triton backend
eagerly, and the Triton kernel alone replayed from a CUDA graph (as the engine's decode graphs run it; the
prefill row eagerly). Bandwidth (last table) is latent bytes read (each request's seq_len x 576 x 2 bytes,
the K plane once) / the graph time; prefill rows also give TFLOP/s over the causal pairs ((576 + 512) x 2
FLOPs a head and pair). Checks each result against the torch backend where that ran (relative error).
Writes the rows as JSON to $OUT/bench_mla.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from ferrox.attention.metadata import AttentionMetadata  # noqa: E402
from ferrox.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from ferrox.kernels.mla_attention import MlaLaunchConfig, mla_attention  # noqa: E402
from ferrox.models.mla_attention import MlaShape, MlaTritonBackend  # noqa: E402

RANK, ROPE = 512, 64
DIM = RANK + ROPE
BLOCK = 16
SCALE = (128 + 64) ** -0.5
SWEEP_CONFIGS = [MlaLaunchConfig(h, m, n, w, s) for h, m, n, w, s in [
    (16, 16, 32, 4, 2), (16, 16, 64, 4, 2), (32, 32, 32, 8, 2), (32, 32, 64, 8, 2), (32, 32, 32, 4, 2),
    (64, 64, 32, 8, 2), (16, 64, 32, 8, 2), (16, 64, 64, 8, 2),
    (16, 64, 64, 4, 3), (16, 64, 128, 8, 2)]]


def _ms(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _ms(graph.replay)


def _case(heads: int, batch: int, context: int, prefill: int, device: torch.device):
    """(q, latent rows, cache, meta) of a decode batch (prefill 0: one new token after `context` each) or a
    fresh prompt of `prefill` tokens."""
    q_len = prefill if prefill else 1
    seq = context + q_len
    blocks = -(-seq // BLOCK)
    table = torch.arange(1, 1 + batch * blocks, dtype=torch.int32).view(batch, blocks)
    starts = torch.arange(batch + 1, dtype=torch.int32) * q_len
    lens = torch.full((batch,), seq, dtype=torch.int32)
    pos = torch.arange(context, seq)
    slots = (table[:, pos // BLOCK].long() * BLOCK + pos % BLOCK).flatten()
    meta = AttentionMetadata(num_actual_tokens=batch * q_len, max_query_len=q_len, max_seq_len=seq,
                             slot_mapping=slots.to(device), query_start_loc=starts.to(device), seq_lens=lens.to(device),
                             block_table=table.to(device), query_start_loc_cpu=starts, seq_lens_cpu=lens,
                             decode_only=q_len == 1)
    gen = torch.Generator(device).manual_seed(0)
    cache = torch.randn(2, 1 + batch * blocks, BLOCK, 1, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    cache[1].copy_(cache[0])  # the torch backend's cache: the latent as K and as V
    q = torch.randn(batch * q_len, heads, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    rows = torch.randn(batch * q_len, 1, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    return q, rows, cache, meta


def _run_case(heads: int, batch: int, context: int, prefill: int, device: torch.device, sweep: bool,
              max_model_len: int) -> dict:
    q, rows, cache, meta = _case(heads, batch, context, prefill, device)
    name = f"H={heads} prefill {prefill}" if prefill else f"H={heads} decode B={batch} ctx={context}"
    row: dict = {"case": name, "heads": heads, "batch": batch, "context": context, "prefill": prefill}
    torch_backend, mine = TorchAttentionBackend(), MlaTritonBackend(MlaShape(RANK, None, 128, ROPE, 128, False, (128 + ROPE) ** -0.5))
    want = None
    try:
        torch_backend.begin_forward(meta)
        want = torch_backend.forward(q, rows, rows, cache, meta, SCALE)[..., :RANK].float()
        row["torch_ms"] = _ms(lambda: torch_backend.forward(q, rows, rows, cache, meta, SCALE))
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        row["torch_ms"] = None
        row["torch_error"] = type(exc).__name__
        torch.cuda.empty_cache()
    got = mine.forward(q, rows, rows, cache, meta, SCALE).float()
    if want is not None:
        row["rel_err"] = float((got - want).norm() / want.norm())
        del want
    row["triton_ms"] = _ms(lambda: mine.forward(q, rows, rows, cache, meta, SCALE))
    out = torch.empty(q.shape[0], heads, RANK, device=device, dtype=q.dtype)

    def attend(config=None, num_splits=None, max_seq_len=meta.max_seq_len):
        return lambda: mla_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                     kv_lora_rank=RANK, max_query_len=meta.max_query_len, max_seq_len=max_seq_len,
                                     scale=SCALE, out=out, config=config, num_splits=num_splits)

    timer = _ms if prefill else _graph_ms
    row["kernel_ms"] = timer(attend())
    if not prefill:
        row["engine_ms"] = timer(attend(max_seq_len=max_model_len))
    seq = context + (prefill or 1)
    row["latent_gb"] = batch * seq * DIM * 2 / 1e9
    row["gb_per_s"] = row["latent_gb"] / (row["kernel_ms"] / 1e3)
    if prefill:
        pairs = prefill * (prefill + 1) // 2
        row["tflops"] = heads * pairs * (DIM + RANK) * 2 / (row["kernel_ms"] / 1e3) / 1e12
    if sweep:
        best = (row["kernel_ms"], "default")
        best_engine = (row.get("engine_ms", row["kernel_ms"]), "default")
        splits = [None] if prefill else [None, 1, 8, 32, 64, 132]
        row["sweep"] = {}
        for config in SWEEP_CONFIGS:
            for n in splits:
                key = f"{config.head_tile},{config.block_m},{config.tile_n},{config.num_warps},{config.num_stages} s={n}"
                try:
                    ms = timer(attend(config, n))
                    engine = None if prefill or n is not None else timer(attend(config, n, max_model_len))
                except Exception as exc:  # a config that does not compile or fit: skip it
                    print(f"  {name} {config} splits={n}: {type(exc).__name__}", file=sys.stderr)
                    continue
                row["sweep"][key] = [ms, engine]
                if ms < best[0]:
                    best = (ms, key)
                if engine is not None and engine < best_engine[0]:
                    best_engine = (engine, key)
        row["sweep_best_ms"], row["sweep_best"] = best
        row["sweep_engine_best_ms"], row["sweep_engine_best"] = best_engine
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="time launch configs x split counts per case")
    parser.add_argument("--heads", type=int, nargs="*", default=[16, 128])
    parser.add_argument("--max-model-len", type=int, default=65536,
                        help="the bound the engine's decode graphs are captured with (engine ms)")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), "| torch", torch.__version__, "| triton", triton.__version__)
    rows = []
    for heads in args.heads:
        for batch in (1, 8, 32):
            for context in (1024, 8192, 32768):
                rows.append(_run_case(heads, batch, context, 0, device, args.sweep, args.max_model_len))
                print(rows[-1], flush=True)
                torch.cuda.empty_cache()
        rows.append(_run_case(heads, 1, 0, 4096, device, args.sweep, args.max_model_len))
        print(rows[-1], flush=True)

    def fmt(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    print(f"\n{'case':<34} {'torch ms':>10} {'triton ms':>10} {'graph ms':>10} {'engine ms':>10} {'speedup':>8} "
          f"{'rel err':>9}")
    for r in rows:
        speed = r["torch_ms"] / r["triton_ms"] if r.get("torch_ms") else None
        torch_ms = fmt(r.get("torch_ms")) if r.get("torch_ms") else r.get("torch_error", "-")
        print(f"{r['case']:<34} {torch_ms:>10} {fmt(r['triton_ms']):>10} {fmt(r['kernel_ms']):>10} "
              f"{fmt(r.get('engine_ms')):>10} {fmt(speed, '.1f'):>8} {fmt(r.get('rel_err'), '.1e'):>9}")
    if any("sweep_best" in r for r in rows):
        print("\nsweep (best launch config per case: exact max_seq_len | as the engine's graphs launch it):")
        for r in rows:
            print(f"  {r['case']:<34} {r['sweep_best_ms']:.4f} ms {r['sweep_best']:<22} | "
                  f"{r['sweep_engine_best_ms']:.4f} ms {r['sweep_engine_best']}")
    print(f"\n{'case':<34} {'latent GB':>10} {'GB/s':>8} {'TFLOP/s':>8}")
    for r in rows:
        print(f"{r['case']:<34} {r['latent_gb']:>10.4f} {r['gb_per_s']:>8.0f} {fmt(r.get('tflops'), '.1f'):>8}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_mla.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
