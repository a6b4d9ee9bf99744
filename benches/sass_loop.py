"""SASS instructions per weight in the one-token kernels' K loops, compiled for sm_90 on any machine.

A one-token product is either bound by memory (bytes in flight, latency) or by instruction issue.
An H200 issues 132 SMs x 128 thread-instructions a clock, ~33.5e12 a second at 1.98 GHz: streaming
4.8 TB/s leaves ~14 instructions per bf16 weight, ~7 per fp8 weight and ~3.5 per int4 weight (less
at the lower clocks of a power-capped GPU). Counting the inner loop's instructions tells, before any
device time is spent, whether a kernel can reach the read floor at all. (The twentieth session cut
the int4 loop from 5.95 to 3.82 per weight with packed fp16x2 dequantisation and gained only 4%:
within that budget, latency and bytes in flight decide; benches/RESULTS.md.) No GPU needed: Triton
compiles for GPUTarget("cuda", 90) with the ptxas it bundles, and its nvdisasm lists the SASS; the K
loop is the longest backward branch. The Triton installed here may differ from the device machine's.

    PYTHONPATH=python python benches/sass_loop.py
    # as the device machine compiles (its Triton is 3.6):
    pip install --target /tmp/t36 --no-deps triton==3.6.0 && PYTHONPATH=/tmp/t36:python python benches/sass_loop.py

Prints a table (kernel, launch config, loop instructions, weights a thread handles per iteration,
instructions per weight; registers and spills per thread, the programs an SM holds at once, and the
weight bytes those programs have in flight -- one K-loop iteration's, or num_stages - 1 of them where
Triton pipelines the loads of a tl.dot loop; the lowest of the three ceilings below and which one it
is; the most frequent opcodes), the figure last: how many kernels have a ceiling below the read
bandwidth. These are upper bounds from the code alone (no launch overhead, no tail, full occupancy);
a kernel can run well below its ceiling, never above it.

The last column is the other side of the question: by Little's law an SM streaming its share of
4.8 TB/s (36 GB/s) through a loaded memory latency of ~1 us needs ~36 KB of loads in flight. A kernel
whose resident programs ask for less per iteration (and wait for it before the next, as Triton's
loops over elementwise code do) is latency-bound whatever its instruction count.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import triton
from ferrox.kernels import fused_moe, gemv, int4_matmul, paged_attention, w8a8_dot_gemv
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)

# sm_90 limits per SM (occupancy): threads, resident programs, registers (allocated per warp in
# units of 256), shared memory (and the 1 KB the runtime reserves per program).
SM_THREADS, SM_PROGRAMS, SM_REGS, SM_SHARED, SHARED_RESERVED = 2048, 32, 65536, 233472, 1024


@dataclass
class Case:
    name: str
    kernel: triton.runtime.JITFunction
    types: dict[str, str]  # pointer element types and float scalars; every other runtime arg is i32
    constexprs: dict[str, object]
    num_warps: int
    weights_per_iteration: int  # weights a program multiplies per K-loop iteration
    weight_bytes: float  # bytes per weight (bf16 2, fp8 1, int4 0.5)
    # Iterations whose loads are in flight at once: 1 for loops over elementwise code (Triton waits
    # for each tile), num_stages - 1 for loops whose loads feed tl.dot (software-pipelined).
    iterations_in_flight: int = 1
    num_stages: int = 1


@dataclass
class Loop:
    opcodes: Counter[str]
    registers: int  # per thread
    spill_bytes: int  # local memory per thread
    shared: int  # bytes per program

    def resident_programs(self, num_warps: int) -> int:
        threads = 32 * num_warps
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = SM_REGS // (regs_per_warp * num_warps) if self.registers else SM_PROGRAMS
        return min(SM_PROGRAMS, SM_THREADS // threads, by_regs, SM_SHARED // (self.shared + SHARED_RESERVED))


def _bin(tool: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_loop(case: Case) -> Loop:
    """The kernel's K loop (the longest backward branch of its sm_90 SASS): opcode counts, and the
    kernel's registers, spills and shared memory (cuobjdump's resource usage)."""
    fn = case.kernel
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in case.constexprs else case.types.get(name, "i32")
    # The launcher marks every pointer (torch's allocations) and every integer argument divisible by
    # 16 (at the models' shapes: sizes, strides, split ranges), and Triton vectorises loads and drops
    # masks on that knowledge; compiled without it, the count would describe another kernel.
    # (Not the arguments the kernel declares do_not_specialize: those get no attribute at launch.)
    unspecialized = {fn.arg_names[a] if isinstance(a, int) else a for a in (fn.do_not_specialize or ())}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in case.constexprs and name not in unspecialized and not signature[name].startswith("fp")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=case.constexprs, attrs=attrs),
                              target=TARGET, options={"num_warps": case.num_warps, "num_stages": case.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        lines = subprocess.run([_bin("nvdisasm"), "-c", cubin.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
        usage = subprocess.run([_bin("cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    resources = {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", usage)}
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.L_x_(\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA.*`\(\.L_x_(\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            loops.append((i - labels[m.group(1)], labels[m.group(1)], i))
    if not loops:
        raise RuntimeError(f"{case.name}: no loop in the SASS")
    _, first, last = max(loops)
    ops: Counter[str] = Counter()
    for line in lines[first:last + 1]:
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(1)] += 1
    # Spills land in the stack frame (STACK) or local memory; Triton's shared memory is dynamic, so it
    # comes from the compiler's metadata, not the cubin.
    return Loop(ops, resources.get("REG", 0), resources.get("STACK", 0) + resources.get("LOCAL", 0),
                int(compiled.metadata.shared))


def cases() -> list[Case]:
    bf16 = {"out_ptr": "*bf16", "w_ptr": "*bf16", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "x_ptr": "*bf16",
            "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"}
    fp8 = bf16 | {"w_ptr": "*fp8e4nv"}
    int4 = {"out_ptr": "*bf16", "x_ptr": "*bf16", "packed_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*u8",
            "bias_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"}

    def g(name, types, rows, block_k, warps, *, silu=False, norm=False, scale=False):
        flags = dict(NORM=norm, HAS_BIAS=False, SILU_MUL=silu, HAS_RESIDUAL=not silu, HAS_W_SCALE=scale,
                     BLOCK_N=rows, BLOCK_K=block_k, USE_PDL=False)
        return Case(name, gemv._gemv_kernel, types, flags, warps, rows * (2 if silu else 1) * block_k,
                    1.0 if types["w_ptr"] == "*fp8e4nv" else 2.0)

    def q4(name, rows, warps, *, silu=False, norm=False):
        block_w = int4_matmul.GemvConfig(rows, warps).block_w
        flags = dict(GROUP=128, T=16, HAS_BIAS=False, NORM=norm, SILU_MUL=silu, HAS_RESIDUAL=not silu, BLOCK_N=rows,
                     BLOCK_W=block_w)
        return Case(name, int4_matmul._int4_gemv_kernel, int4, flags, warps, rows * (2 if silu else 1) * block_w * 8,
                    0.5)

    # Qwen3-30B-A3B's sparse MLP at one token (hidden 2048, experts of 768, top 8): the configs it runs.
    moe_cfg = fused_moe.choose_gemv_config(2048, 768, 8)
    gate_up = Case("moe gate/up norm + SiLU (Qwen3-30B-A3B)", fused_moe._gemv_gate_up_kernel,
                   {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "topk_ids_ptr": "*i64",
                    "norm_w_ptr": "*bf16", "eps": "fp32"},
                   dict(TOP_K=8, NORM=True, BLOCK_N=moe_cfg.gate_up_rows, BLOCK_K=moe_cfg.gate_up_block_k,
                        USE_PDL=False, FP8=False, BLOCK_SCALES=False, BN=1, BK=1, HAS_BIAS=False, ACTIVATION=0,
                        ALPHA=0.0, LIMIT=0.0, MXFP4=False),
                   moe_cfg.num_warps, 2 * moe_cfg.gate_up_rows * moe_cfg.gate_up_block_k, 2.0)
    down = Case("moe down, 8 slots + residual (Qwen3-30B-A3B)", fused_moe._gemv_down_kernel,
                {"out_ptr": "*bf16", "inter_ptr": "*bf16", "w_ptr": "*bf16", "topk_ids_ptr": "*i64",
                 "route_w_ptr": "*fp32", "res_ptr": "*bf16"},
                dict(TOP_K=8, HAS_RESIDUAL=True, BLOCK_S=8, BLOCK_N=moe_cfg.down_rows, BLOCK_K=moe_cfg.down_block_k,
                     USE_PDL=False, FP8=False, BLOCK_SCALES=False, BN=1, BK=1, HAS_BIAS=False, MXFP4=False),
                moe_cfg.num_warps, 8 * moe_cfg.down_rows * moe_cfg.down_block_k, 2.0)
    # gpt-oss-20b's sparse MLP at one token with MXFP4 experts (hidden 2880, experts of 2880, top 4, biases,
    # the clamped SwiGLU): half a byte a weight, dequantized in the loop.
    mx_cfg = fused_moe.choose_gemv_config(2880, 2880, 4, mxfp4=True)
    mx_types = {"out_ptr": "*bf16", "x_ptr": "*bf16", "inter_ptr": "*bf16", "w_ptr": "*u8", "w_scale_ptr": "*u8",
                "topk_ids_ptr": "*i64", "route_w_ptr": "*fp32", "bias_ptr": "*bf16", "res_ptr": "*bf16",
                "norm_w_ptr": "*bf16", "eps": "fp32"}
    mx_gate_up = Case("mxfp4 moe gate/up + SwiGLU-OAI (gpt-oss-20b)", fused_moe._gemv_gate_up_kernel, mx_types,
                      dict(TOP_K=4, NORM=False, BLOCK_N=mx_cfg.gate_up_rows, BLOCK_K=mx_cfg.gate_up_block_k,
                           USE_PDL=False, FP8=False, BLOCK_SCALES=False, BN=1, BK=1, HAS_BIAS=True, ACTIVATION=1,
                           ALPHA=1.702, LIMIT=7.0, MXFP4=True),
                      mx_cfg.num_warps, 2 * mx_cfg.gate_up_rows * mx_cfg.gate_up_block_k, 0.5)
    mx_down = Case("mxfp4 moe down, 4 slots (gpt-oss-20b)", fused_moe._gemv_down_kernel, mx_types,
                   dict(TOP_K=4, HAS_RESIDUAL=False, BLOCK_S=4, BLOCK_N=mx_cfg.down_rows, BLOCK_K=mx_cfg.down_block_k,
                        USE_PDL=False, FP8=False, BLOCK_SCALES=False, BN=1, BK=1, HAS_BIAS=True, MXFP4=True),
                   mx_cfg.num_warps, 4 * mx_cfg.down_rows * mx_cfg.down_block_k, 0.5)

    def dot8(name, n_out, k, *, silu=False, norm=False):
        cfg = w8a8_dot_gemv.choose_dot_config(n_out, k, 132)
        flags = dict(NORM=norm, HAS_BIAS=False, SILU_MUL=silu, HAS_RESIDUAL=not silu, STATIC=False,
                     INT8=False, BLOCK_SCALES=False, BN=1, SPLIT=cfg.split, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, BLOCK_X=gemv.token_stats_block(k))
        types = {"out_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16",
                 "x_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "in_scale_ptr": "*fp32",
                 "part_ptr": "*fp32", "count_ptr": "*i32", "eps": "fp32"}
        return Case(f"{name} ({cfg.block_n} rows x {cfg.block_k}, split {cfg.split})", w8a8_dot_gemv._w8a8_dot_gemv_kernel,
                    types, flags, cfg.num_warps, cfg.block_n * cfg.block_k * (2 if silu else 1), 1.0,
                    cfg.num_stages - 1, cfg.num_stages)

    # Split-KV decode attention at Llama-3.1-8B's heads (GQA 4, head_dim 128): "weights" are the K and V
    # elements a program reads per KV tile (bf16).
    att = paged_attention.DECODE_SPLIT_CONFIG
    attention = Case(f"paged attention, split-KV decode ({att.tile_n}-position KV tiles)",
                     paged_attention._paged_attention_kernel,
                     {"out_ptr": "*bf16", "partial_out_ptr": "*fp32", "partial_max_ptr": "*fp32",
                      "partial_sum_ptr": "*fp32", "q_ptr": "*bf16", "cache_ptr": "*bf16", "kv_scale_ptr": "*fp32",
                      "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
                      "scale_log2": "fp32"},
                     dict(NUM_Q_PER_KV=4, BLOCK_Q=att.block_m // 4, BLOCK_M=att.block_m, TILE_N=att.tile_n,
                          DIM_PAD=128, SPLIT_KV=True, DOT_PRECISION="tf32", USE_PDL=False, DECODE_ONLY=True,
                          MIN_SPLIT=256, HAS_SINKS=False,
                          CHUNK=0),  # (Llama 4's chunked attention off: the loop every other model runs)
                     att.num_warps, 2 * att.tile_n * 128, 2.0, att.num_stages - 1, att.num_stages)
    def chosen(name, types, kind, k, weight_bytes, **kw):
        cfg = gemv.choose_config(kind, k, weight_bytes)
        return g(f"{name} ({cfg.block_n} rows x {cfg.block_k})", types, cfg.block_n, cfg.block_k, cfg.num_warps, **kw)

    return [
        chosen("bf16 gemv + residual", bf16, "plain", 4096, 2),
        chosen("bf16 gemv norm + SiLU", bf16, "silu", 4096, 2, silu=True, norm=True),
        chosen("fp8 gemv (weight-only) + residual", fp8, "plain", 4096, 1, scale=True),
        chosen("fp8 gemv norm + SiLU", fp8, "silu", 4096, 1, silu=True, norm=True, scale=True),
        q4("int4 gemv + residual", 8, 2),
        q4("int4 gemv norm + SiLU", 4, 2, silu=True, norm=True),
        dot8("fp8 W8A8 tensor cores, gate_up norm + SiLU", 14336, 4096, silu=True, norm=True),
        dot8("fp8 W8A8 tensor cores, down + residual", 4096, 14336),
        gate_up,
        down,
        mx_gate_up,
        mx_down,
        attention,
    ]


# The H200 figures the ceilings are drawn from (benches/RESULTS.md): streaming-read bandwidth, and
# thread-instructions a second (132 SMs x 128 a clock at 1.98 GHz); a loaded memory latency of ~1 us.
READ_TBPS, ISSUE_PER_S, NUM_SMS, LATENCY_S = 4.8, 132 * 128 * 1.98e9, 132, 1e-6


def ceilings(per_weight: float, weight_bytes: float, in_flight_kb: float) -> dict[str, float]:
    """TB/s of weights each limit allows: the read bandwidth, instruction issue at per_weight
    instructions a weight, and Little's law over the bytes the resident programs keep in flight."""
    return {"read": READ_TBPS, "issue": ISSUE_PER_S / per_weight * weight_bytes / 1e12,
            "in flight": in_flight_kb * 1024 * NUM_SMS / LATENCY_S / 1e12}


def main() -> None:
    rows = []
    for case in cases():
        loop = compile_loop(case)
        per_thread = case.weights_per_iteration / (32 * case.num_warps)
        total = sum(loop.opcodes.values())
        resident = loop.resident_programs(case.num_warps)
        in_flight_kb = resident * case.weights_per_iteration * case.weight_bytes * case.iterations_in_flight / 1024
        limits = ceilings(total / per_thread, case.weight_bytes, in_flight_kb)
        rows.append((case, loop, total, per_thread, total / per_thread, resident, in_flight_kb, limits))
    print(f"Triton {triton.__version__}, SASS for sm_90 (ptxas bundled with Triton)\n")
    print("| kernel | warps | loop instructions | weights / thread / iteration | instructions / weight "
          "| registers (spilled bytes) | programs / SM | KB in flight / SM | ceiling TB/s (what binds) | top opcodes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case, loop, total, per_thread, per_weight, resident, kb, limits in rows:
        top = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(4))
        binding = min(limits, key=lambda name: limits[name])
        print(f"| {case.name} | {case.num_warps} | {total} | {per_thread:.0f} | {per_weight:.2f} | "
              f"{loop.registers} ({loop.spill_bytes}) | {resident} | {kb:.0f} | {limits[binding]:.1f} ({binding}) | "
              f"{top} |")
    below = [r for r in rows if min(r[7].values()) < READ_TBPS]
    print(f"\nkernels whose ceiling is below the read bandwidth: {len(below)} of {len(rows)}"
          + (f" ({', '.join(r[0].name for r in below)})" if below else ""))


if __name__ == "__main__":
    main()
