"""GPU kernel microbenchmarks: each kernel is checked against its reference, then timed against
the torch path the engine would otherwise run. Prints a table last (and writes it as JSON to
$OUT/bench_kernels.json when OUT is set).

    PYTHONPATH=python python benches/bench_kernels.py            # all sections
    PYTHONPATH=python python benches/bench_kernels.py --sweep    # plus attention launch-config sweep
    PYTHONPATH=python python benches/bench_kernels.py --only layers   # B=1 decode attention, 32 layers a graph

Shapes are Llama-3.1-8B's (32 q heads / 8 kv heads, head_dim 128, hidden 4096, intermediate
14336, vocab 128256), bf16, block size 16. Attention bandwidth is KV bytes read / time, reported
against a device-to-device copy measured in the same run; attention FLOP/s count QK^T and PV over
the causally visible positions. The sweep times the prefill kernel's launch configs (pointer
loads at block size 16, TMA at block size 128) on an 8192-token chunk after 24576 cached tokens,
and the split-KV decode configs x split counts at batch 1, 122k context (CUDA-graph replays). The
layers section runs batch-1 decode attention as a step does (32 layers, each its own KV, in one
graph bound at 131072 tokens) from 160 to 122k tokens of context: the kernel the engine picks (the
CUDA kernel on Hopper, kernels/decode_attention_cuda.py), beside the Triton kernel and its split
merge (33 splits) and a Triton kernel that only reads the same KV over that grid.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))  # PagedBatch + references, shared with the tests

from ferrox.attention.backend import get_attention_backend  # noqa: E402
from ferrox.attention.metadata import AttentionMetadata  # noqa: E402
from ferrox.attention.triton_backend import PREFILL_MIN_QUERY_LEN  # noqa: E402
from ferrox.kernels import decode_attention_cuda  # noqa: E402
from ferrox.kernels import paged_attention as pa  # noqa: E402
from ferrox.kernels import prefill_attention as pf  # noqa: E402
from ferrox.kernels.activation import silu_and_mul  # noqa: E402
from ferrox.kernels.cuda_sampling import load_extension, top_k_top_p_sample, top_k_top_p_sample_torch  # noqa: E402
from ferrox.kernels.reshape_and_cache import reshape_and_cache  # noqa: E402
from ferrox.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402
from ferrox.kernels.rotary import neox_cos_sin_cache, rotary_neox_  # noqa: E402
from kernel_refs import PagedBatch, relative_error, sliced_paged_attention_ref  # noqa: E402

H, HKV, D, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"  # a dry run of the script logic can set "cpu" under TRITON_INTERPRET=1
ROWS: list[dict] = []


def timed(fn) -> float:
    """Median milliseconds (CUDA events, L2 flushed between runs by do_bench)."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def record(section: str, case: str, ferrox_ms: float, torch_ms: float | None, metric: str = "", check: str = "") -> None:
    row = dict(section=section, case=case, ferrox_ms=round(ferrox_ms, 4), torch_ms=None if torch_ms is None else round(torch_ms, 4),
               speedup=None if torch_ms is None else round(torch_ms / ferrox_ms, 2), metric=metric, check=check)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def copy_bandwidth() -> float:
    n = 1 << 30  # 2 GiB of bf16 each way
    src = torch.empty(n, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src))
    gbps = 2 * n * 2 / ms / 1e6
    record("copy", "d2d 2 GiB", ms, None, f"{gbps:.0f} GB/s (read+write)")
    return gbps


def _meta(b: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=b.num_actual_tokens, max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
        slot_mapping=b.slot_mapping, query_start_loc=b.query_start_loc, seq_lens=b.seq_lens,
        block_table=b.block_table, query_start_loc_cpu=b.query_start_loc.cpu(), seq_lens_cpu=b.seq_lens.cpu(),
        decode_only=b.max_query_len == 1,
    )


def kv_bytes_per_call(b: PagedBatch) -> int:
    return sum(b.seq_lens_list) * HKV * D * 2 * 2


def _attention_case(section: str, name: str, query_lens, context_lens, copy_gbps: float, torch_ref: bool = True) -> None:
    """The Triton backend (which picks the unified or the prefill kernel) against the torch one."""
    b = PagedBatch(query_lens, context_lens, H, HKV, D, BLOCK, DTYPE, torch.device(DEVICE))
    meta = _meta(b)
    triton_be, torch_be = get_attention_backend(DEVICE, "triton"), get_attention_backend(DEVICE, "torch")
    out = triton_be.forward(b.q, b.k, b.v, b.kv_cache, meta, b.scale)
    n = b.num_actual_tokens
    ref = sliced_paged_attention_ref(b)
    err = relative_error(out[:n], ref[:n])
    del ref
    ms = timed(lambda: triton_be.forward(b.q, b.k, b.v, b.kv_cache, meta, b.scale))
    torch_ms = timed(lambda: torch_be.forward(b.q, b.k, b.v, b.kv_cache, meta, b.scale)) if torch_ref else None
    graph_note = ""
    if b.max_query_len == 1 and DEVICE == "cuda":
        # Eager timings of small launches include Python launch overhead; a CUDA graph replay
        # (as the engine runs decode steps) shows the GPU time alone.
        graph_ms = timed(_graph(lambda: triton_be.forward(b.q, b.k, b.v, b.kv_cache, meta, b.scale)).replay)
        graph_note = f"graph {graph_ms * 1e3:.0f} us ({kv_bytes_per_call(b) / graph_ms / 1e6:.0f} GB/s), "
    kv_bytes = kv_bytes_per_call(b)
    flops = causal_flops(query_lens, context_lens)
    if b.max_query_len == 1:
        group = H // HKV
        block_q = max(pa.DECODE_CONFIG.block_m, group) // group
        splits = pa.choose_num_splits((b.num_tokens // block_q + len(query_lens)) * HKV, b.max_seq_len,
                                      pa._num_sms(b.q.device))
        kernel = f"unified, splits={splits}"
    else:
        kernel = "prefill kernel" if b.max_query_len >= PREFILL_MIN_QUERY_LEN else "unified"
    metric = graph_note + (f"{kv_bytes / ms / 1e6:.0f} GB/s KV ({kv_bytes / ms / 1e6 / copy_gbps:.0%} of copy), "
                           f"{flops / ms / 1e9:.1f} TFLOP/s, {kernel}")
    record(section, name, ms, torch_ms, metric, f"rel err {err:.1e}" + ("" if err < 2e-2 else " FAIL"))


def causal_flops(query_lens, context_lens) -> float:
    """QK^T and PV over the visible positions of every query (causal inside a chunk)."""
    return sum(4 * H * D * (ql * ctx + ql * (ql + 1) / 2) for ql, ctx in zip(query_lens, context_lens, strict=True))


def _graph(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def attention(copy_gbps: float, decode_only: bool = False) -> None:
    for bsz, ctx in [(1, 160), (1, 1024), (1, 8192), (1, 32768), (1, 122880), (8, 4096), (64, 2048), (256, 1024),
                     (256, 2048)]:
        _attention_case("attn decode", f"B={bsz} ctx={ctx}", [1] * bsz, [ctx - 1] * bsz, copy_gbps)
    if decode_only:
        return
    _attention_case("attn prefill", "1 x 2048 fresh", [2048], [0], copy_gbps)
    _attention_case("attn prefill", "4 x 512 fresh", [512] * 4, [0] * 4, copy_gbps)
    _attention_case("attn prefill", "chunk 2048 after 6144", [2048], [6144], copy_gbps)
    _attention_case("attn prefill", "chunk 8192 after 24576 (32k)", [8192], [24576], copy_gbps)
    _attention_case("attn prefill", "chunk 8192 after 114688 (122k)", [8192], [114688], copy_gbps, torch_ref=False)
    _attention_case("attn mixed", "2 chunks x 512 (ctx 2k) + 128 decodes (ctx 1k)", [1] * 128 + [512, 512],
                    [1023] * 128 + [2048, 2048], copy_gbps)


# Launch configs the sweep tries: (block_m, tile_n, num_warps, num_stages). The H200 optimum of each
# family comes first (the engine's defaults); the others were within reach or worse.
PREFILL_SWEEP = [(256, 64, 8, 3), (256, 64, 8, 2), (128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3),
                 (256, 128, 8, 2), (64, 64, 4, 3)]
PREFILL_TMA_SWEEP = [(128, 64, 4, 4), (128, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3)]
DECODE_SWEEP = [(16, 128, 4, 3), (16, 128, 4, 2), (16, 128, 8, 3), (16, 64, 4, 3), (16, 64, 4, 2), (16, 256, 8, 2)]
DECODE_SPLITS = [16, 24, 33, 48, 66, 132]


def _sweep_prefill(name: str, query_lens, context_lens, block_size: int, configs, use_tma: bool) -> None:
    b = PagedBatch(query_lens, context_lens, H, HKV, D, block_size, DTYPE, torch.device(DEVICE))
    reshape_and_cache(b.k, b.v, b.kv_cache, b.slot_mapping)
    ref = sliced_paged_attention_ref(b)
    n, flops = b.num_actual_tokens, causal_flops(query_lens, context_lens)
    runs = [(f"unified m{c.block_m} n{c.tile_n} w{c.num_warps} s{c.num_stages}",
             lambda c=c: pa.unified_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table,
                                              max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
                                              scale=b.scale, config=c))
            for c in ([pa.PREFILL_CONFIG] if not use_tma else [])]
    for m, t, w, st in configs:
        cfg = pf.PrefillLaunchConfig(m, t, w, st)
        runs.append((f"prefill{' tma' if use_tma else ''} m{m} n{t} w{w} s{st}",
                     lambda cfg=cfg: pf.prefill_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens,
                                                          b.block_table, scale=b.scale, config=cfg, use_tma=use_tma)))
    for label, run in runs:
        try:
            err = relative_error(run()[:n], ref[:n])
            ms = timed(run)
        except Exception as exc:  # e.g. out of shared memory for a big tile, or no TMA on this Triton
            record("sweep", f"{name} {label}", float("nan"), None, check=f"error {type(exc).__name__}: {exc}"[:160])
            continue
        record("sweep", f"{name} {label}", ms, None, f"{flops / ms / 1e9:.0f} TFLOP/s",
               check=f"rel err {err:.1e}" + ("" if err < 2e-2 else " FAIL"))


def _sweep_decode(name: str, batch_size: int, context: int, copy_gbps: float) -> None:
    b = PagedBatch([1] * batch_size, [context - 1] * batch_size, H, HKV, D, BLOCK, DTYPE, torch.device(DEVICE))
    reshape_and_cache(b.k, b.v, b.kv_cache, b.slot_mapping)
    ref = sliced_paged_attention_ref(b)
    kv_bytes = kv_bytes_per_call(b)
    for m, t, w, st in DECODE_SWEEP:
        cfg = pa.AttentionLaunchConfig(m, t, w, st)
        for splits in DECODE_SPLITS:
            def run(cfg=cfg, splits=splits):
                return pa.unified_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table,
                                            max_query_len=1, max_seq_len=b.max_seq_len, scale=b.scale, config=cfg,
                                            num_splits=splits)
            label = f"{name} n{t} w{w} s{st} splits={splits}"
            try:
                err = relative_error(run()[: b.num_actual_tokens], ref[: b.num_actual_tokens])
                ms = timed(_graph(run).replay)
            except Exception as exc:
                record("sweep", label, float("nan"), None, check=f"error {type(exc).__name__}: {exc}"[:160])
                continue
            gbps = kv_bytes / ms / 1e6
            record("sweep", label, ms, None, f"{gbps:.0f} GB/s ({gbps / copy_gbps:.0%} of copy)",
                   check=f"rel err {err:.1e}" + ("" if err < 2e-2 else " FAIL"))


def sweep(copy_gbps: float) -> None:
    """Time launch configs of the attention kernels directly; every run is checked first."""
    _sweep_prefill("chunk 8192 after 24576", [8192], [24576], BLOCK, PREFILL_SWEEP, use_tma=False)
    _sweep_prefill("chunk 8192 after 24576 block 128", [8192], [24576], 128, PREFILL_TMA_SWEEP, use_tma=True)
    _sweep_decode("decode B=1 ctx=122880", 1, 122880, copy_gbps)
    _sweep_prefill("mixed 128 dec + 2x512", [1] * 128 + [512, 512], [1023] * 128 + [2048, 2048], BLOCK,
                   PREFILL_SWEEP[:1], use_tma=False)


@triton.jit
def _read_kv_kernel(out_ptr, cache_ptr, table_ptr, seq_lens_ptr, num_splits, stride_ckv, stride_cblock, stride_cslot,
                    stride_chead, TILE: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    MIN_SPLIT: tl.constexpr):
    """Reads what split-KV decode attention reads (one request, a program per KV head and split,
    positions through the block table) and nothing else: the floor of that grid and layout."""
    head = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr)
    per = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE, MIN_SPLIT)
    lo = split * per
    hi = tl.minimum(seq_len, lo + per)
    dims = tl.arange(0, DIM)
    cols = tl.arange(0, TILE)
    acc = tl.zeros([TILE, DIM], tl.float32)
    base = cache_ptr + head * stride_chead
    for start in range(lo, hi, TILE):
        pos = start + cols
        ok = pos < hi
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=ok, other=0)
        offset = block.to(tl.int64) * stride_cblock + (pos % BLOCK_SIZE) * stride_cslot
        k = tl.load(base + offset[:, None] + dims[None, :], mask=ok[:, None])
        v = tl.load(base + stride_ckv + offset[:, None] + dims[None, :], mask=ok[:, None])
        acc += k.to(tl.float32) + v.to(tl.float32)
    if lo < hi:
        tl.store(out_ptr + head * num_splits + split, tl.sum(acc))


def decode_layers(layers: int = 32, splits: int = 33) -> None:
    """Decode attention at batch 1 as a step runs it: `layers` back to back in one CUDA graph, each
    over its own KV cache, bound at 131072 tokens; us a layer: the engine's kernel, the Triton kernel
    with the split count a 131k-token graph gives it, and _read_kv_kernel over that grid."""
    for ctx in (160, 1024, 4096, 8192, 16384, 32768, 122880):
        _decode_layers_case(ctx, layers, splits)
        torch.cuda.empty_cache()


def _decode_layers_case(ctx: int, layers: int, splits: int) -> None:
    batches = [PagedBatch([1], [ctx - 1], H, HKV, D, BLOCK, DTYPE, torch.device(DEVICE)) for _ in range(layers)]
    for b in batches:
        reshape_and_cache(b.k, b.v, b.kv_cache, b.slot_mapping)
    outs = [torch.empty_like(b.q) for b in batches]
    sink = torch.zeros(HKV * splits, device=DEVICE)
    ref = sliced_paged_attention_ref(batches[0])[:1]

    def attention_layers(num_splits: int | None):
        def run():
            for b, out in zip(batches, outs, strict=True):
                pa.unified_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_table, max_query_len=1,
                                     max_seq_len=131072, scale=b.scale, num_splits=num_splits, out=out)
        return run

    def read_layers():
        for b in batches:
            c = b.kv_cache
            _read_kv_kernel[(HKV, splits)](sink, c, b.block_table[0], b.seq_lens, splits, c.stride(0), c.stride(1),
                                           c.stride(2), c.stride(3), TILE=64, DIM=D, BLOCK_SIZE=BLOCK,
                                           MIN_SPLIT=pa._MIN_SPLIT_LEN, num_warps=4)

    kv_mb = kv_bytes_per_call(batches[0]) / 1e6
    timings, errors = {}, []
    for label, num_splits in (("engine", None), ("triton", splits)):  # num_splits set: the Triton kernel
        run = attention_layers(num_splits)
        run()
        errors.append(relative_error(outs[0][:1], ref))
        timings[label] = timed(_graph(run).replay) * 1e3 / layers
    read_us = timed(_graph(read_layers).replay) * 1e3 / layers
    us = timings["engine"]
    cuda = decode_attention_cuda.supported(batches[0].q, batches[0].kv_cache, batches[0].seq_lens,
                                           batches[0].block_table, None)
    record("decode layers", f"ctx={ctx}: {'CUDA' if cuda else 'Triton'} kernel, a layer", us / 1e3, None,
           f"{us:.2f} us ({kv_mb * 1e3 / us:.0f} GB/s); Triton + merge {timings['triton']:.2f} us; "
           f"read-only {read_us:.2f} us",
           check=f"rel err {max(errors):.1e}" + ("" if max(errors) < 2e-2 else " FAIL"))


def _norm_case(tokens: int, copy_gbps: float) -> None:
    from ferrox.layers.layernorm import RMSNorm
    from ferrox.layers.ops import DeviceOps

    x = torch.randn(tokens, 4096, dtype=DTYPE, device=DEVICE)
    res = torch.randn_like(x)
    norm = RMSNorm(4096, 1e-5, DTYPE, DEVICE, ops=DeviceOps())  # the torch op set: the reference column
    err = relative_error(fused_add_rms_norm(x, res, norm.weight, 1e-5)[0], norm(x, res)[0])
    ms = timed(lambda: fused_add_rms_norm(x, res, norm.weight, 1e-5))
    gbps = 4 * x.numel() * 2 / ms / 1e6  # read x, residual; write out, residual
    record("rmsnorm+residual", f"T={tokens} hidden=4096", ms, timed(lambda: norm(x, res)),
           f"{gbps:.0f} GB/s ({gbps / copy_gbps:.0%})", f"rel err {err:.1e}")


def _silu_case(tokens: int, copy_gbps: float) -> None:
    from ferrox.layers.activation import SiluAndMul
    from ferrox.layers.ops import DeviceOps

    gate_up = torch.randn(tokens, 2 * 14336, dtype=DTYPE, device=DEVICE)
    act = SiluAndMul(DeviceOps())  # the torch op set: the reference column
    err = relative_error(silu_and_mul(gate_up), act(gate_up))
    ms = timed(lambda: silu_and_mul(gate_up))
    gbps = 1.5 * gate_up.numel() * 2 / ms / 1e6
    record("silu_and_mul", f"T={tokens} inter=14336", ms, timed(lambda: act(gate_up)),
           f"{gbps:.0f} GB/s ({gbps / copy_gbps:.0%})", f"rel err {err:.1e}")


def _rotary_case(tokens: int) -> None:
    from ferrox.layers.rotary import RotaryEmbedding, apply_rotary

    config = json.loads((ROOT / "benches/configs/llama-3.1-8b/config.json").read_text())
    positions = torch.randint(0, 8192, (tokens,), device=DEVICE)
    q = torch.randn(tokens, H, D, dtype=DTYPE, device=DEVICE)
    k = torch.randn(tokens, HKV, D, dtype=DTYPE, device=DEVICE)
    rope = RotaryEmbedding(D, config["rope_theta"], config["rope_scaling"], DEVICE)
    cache = neox_cos_sin_cache(D, 16384, config["rope_theta"], config["rope_scaling"], device=DEVICE)

    def torch_rope():
        cos, sin = rope.cos_sin(positions, DTYPE)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    ref_q, ref_k = torch_rope()
    q2, k2 = q.clone(), k.clone()
    rotary_neox_(positions, q2, k2, cache)
    err = max(relative_error(q2, ref_q), relative_error(k2, ref_k))
    ms = timed(lambda: rotary_neox_(positions, q, k, cache))
    record("rotary (llama3)", f"T={tokens}", ms, timed(torch_rope), "", f"rel err vs layers.rotary {err:.1e}")


def elementwise(copy_gbps: float) -> None:
    for tokens in (256, 8192):
        _norm_case(tokens, copy_gbps)
        _silu_case(tokens, copy_gbps)
        _rotary_case(tokens)


def _sampling_case(bsz: int, label: str, k: int, p: float, have_cuda_kernel: bool) -> None:
    from ferrox.layers import logits_processors as lp

    vocab = 128256
    logits = torch.randn(bsz, vocab, device=DEVICE) * 3
    probs = torch.softmax(logits, -1)
    u = torch.rand(bsz, device=DEVICE)
    top_k = torch.full((bsz,), k, dtype=torch.int32, device=DEVICE)
    top_p = torch.full((bsz,), p, device=DEVICE)
    torch_ms = timed(lambda: top_k_top_p_sample_torch(probs, top_k, top_p, u))
    tk = torch.where(top_k > 0, top_k, vocab).long()

    def engine_path():  # the sampler's own path: sort-based mask on logits, softmax, exponential race
        masked = lp.apply_top_k_top_p(logits, tk if k else None, top_p if p < 1 else None)
        return (torch.softmax(masked, -1) / torch.empty_like(masked).exponential_()).argmax(-1)

    engine_ms = timed(engine_path)
    if not have_cuda_kernel:
        record("sampling", f"B={bsz} V={vocab} {label} (no CUDA kernel)", torch_ms, engine_ms, "torch path only")
        return
    ms = timed(lambda: top_k_top_p_sample(probs, top_k, top_p, u))
    greedy = torch.equal(top_k_top_p_sample(probs, torch.ones_like(top_k), top_p, u), probs.argmax(-1))
    record("sampling", f"B={bsz} V={vocab} {label}", ms, torch_ms, f"engine sampler path {engine_ms:.3f} ms",
           "top_k=1 == argmax" if greedy else "top_k=1 != argmax FAIL")


def _race_case(bsz: int) -> None:
    """Plain temperature sampling: the one-pass Triton race against the torch passes it replaced
    (scale, softmax, -log u, divide, argmax), same uniforms, same winner."""
    from ferrox.kernels.exponential_race import exponential_race

    vocab = 128256
    logits = torch.randn(bsz, vocab, device=DEVICE) * 3
    temperature = torch.full((bsz,), 0.8, device=DEVICE)

    def torch_path():
        probs = torch.softmax(logits / temperature[:, None], dim=-1)
        u = torch.empty_like(probs).uniform_()
        return (probs / u.log_().neg_()).argmax(-1)

    def race():
        return exponential_race(logits, temperature, torch.empty_like(logits).uniform_())

    u = torch.rand(bsz, vocab, device=DEVICE)
    same = torch.equal(exponential_race(logits, temperature, u),
                       (torch.softmax(logits / temperature[:, None], -1) / -u.log()).argmax(-1))
    record("sampling", f"B={bsz} V={vocab} temperature 0.8 (race)", timed(race), timed(torch_path),
           "incl. drawing the uniforms", "same tokens" if same else "tokens differ (rounding ties?)")


def sampling() -> None:
    for bsz in (1, 256, 512):
        _race_case(bsz)
    have_cuda_kernel = load_extension() is not None
    for bsz in (1, 32, 256):
        for label, k, p in (("top_k=50 top_p=0.9", 50, 0.9), ("top_p=0.95", 0, 0.95), ("top_k=1000", 1000, 1.0)):
            _sampling_case(bsz, label, k, p, have_cuda_kernel)


def print_table() -> None:
    print()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    header = f"{'section':<18} {'case':<48} {'ferrox ms':>10} {'torch ms':>10} {'x':>6}  metric / check"
    print(header)
    print("-" * len(header))
    for r in ROWS:
        torch_ms = "" if r["torch_ms"] is None else f"{r['torch_ms']:.4f}"
        speed = "" if r["speedup"] is None else f"{r['speedup']:.2f}"
        print(f"{r['section']:<18} {r['case'][:48]:<48} {r['ferrox_ms']:>10.4f} {torch_ms:>10} {speed:>6}  {r['metric']} {r['check']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also sweep attention launch configs")
    parser.add_argument("--only", default="",
                        help="comma list of sections: attention,elementwise,sampling,layers,sweep")
    parser.add_argument("--decode-only", action="store_true", help="attention: decode cases only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kernels.py needs a CUDA GPU")
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    only = set(filter(None, args.only.split(",")))
    copy_gbps = copy_bandwidth()
    sections = [("attention", lambda: attention(copy_gbps, args.decode_only)), ("elementwise", lambda: elementwise(copy_gbps)),
                ("sampling", sampling), ("layers", decode_layers)]
    if args.sweep:
        sections.append(("sweep", lambda: sweep(copy_gbps)))
    for name, fn in sections:
        if only and name not in only:
            continue
        try:
            fn()
        except Exception as exc:  # one broken section must not hide the others' numbers
            import traceback

            traceback.print_exc()
            record(name, "SECTION FAILED", float("nan"), None, check=f"{type(exc).__name__}: {exc}"[:200])
        torch.cuda.empty_cache()
    print_table()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_kernels.json").write_text(json.dumps(ROWS, indent=1))


if __name__ == "__main__":
    main()
