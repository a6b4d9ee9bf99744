"""SASS instructions per weight in the one-token kernels' K loops, compiled for sm_90 on any machine.

A one-token product is either bound by memory (bytes in flight, latency) or by instruction issue.
An H200 issues 132 SMs x 128 thread-instructions a clock, ~33.5e12 a second at 1.98 GHz: streaming
4.8 TB/s leaves ~14 instructions per bf16 weight, ~7 per fp8 weight and ~3.5 per int4 weight (less
at the lower clocks of a power-capped GPU). Counting the inner loop's instructions tells, before any
device time is spent, whether a kernel can reach the read floor at all. (The twentieth session cut
the int4 loop from 5.95 to 3.82 per weight with packed fp16x2 dequantisation and gained only 4%:
past that budget, latency and bytes in flight decide; benches/RESULTS.md.) No GPU needed: Triton compiles for
GPUTarget("cuda", 90) with the ptxas it bundles, and its nvdisasm lists the SASS; the K loop is the
longest backward branch. The Triton installed here may differ from the device machine's.

    PYTHONPATH=python python benches/sass_loop.py

Prints a table (kernel, launch config, loop instructions, weights a thread handles per iteration,
instructions per weight, the most frequent opcodes), the figure last.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import triton
from ferrox.kernels import fused_moe, gemv, int4_matmul
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
# Arguments whose divisibility by 16 the launcher would see (pointers from torch, K and row strides
# of the model's shapes): without it Triton does not vectorise the loads and the count misleads.
DIVISIBLE = re.compile(r".*_ptr$|^K$|^KW$|^stride_.*")


@dataclass
class Case:
    name: str
    kernel: triton.runtime.JITFunction
    types: dict[str, str]  # pointer element types and float scalars; every other runtime arg is i32
    constexprs: dict[str, object]
    num_warps: int
    weights_per_iteration: int  # weights a program multiplies per K-loop iteration
    opcodes: Counter[str] = field(default_factory=Counter)


def _bin(tool: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool)


def compile_loop(case: Case) -> Counter[str]:
    """Opcode counts of the kernel's K loop (the longest backward branch of its sm_90 SASS)."""
    fn = case.kernel
    signature: dict[str, str] = {}
    for name in fn.arg_names:
        signature[name] = "constexpr" if name in case.constexprs else case.types.get(name, "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in case.constexprs and DIVISIBLE.match(name)}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=case.constexprs, attrs=attrs),
                              target=TARGET, options={"num_warps": case.num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        lines = subprocess.run([_bin("nvdisasm"), "-c", cubin.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
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
    return ops


def cases() -> list[Case]:
    bf16 = {"out_ptr": "*bf16", "w_ptr": "*bf16", "w_scale_ptr": "*fp32", "bias_ptr": "*bf16", "x_ptr": "*bf16",
            "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"}
    fp8 = bf16 | {"w_ptr": "*fp8e4nv"}
    int4 = {"out_ptr": "*bf16", "x_ptr": "*bf16", "packed_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*u8",
            "bias_ptr": "*bf16", "res_ptr": "*bf16", "norm_w_ptr": "*bf16", "eps": "fp32"}

    def g(name, types, rows, block_k, warps, *, silu=False, norm=False, scale=False):
        flags = dict(NORM=norm, HAS_BIAS=False, SILU_MUL=silu, HAS_RESIDUAL=not silu, HAS_W_SCALE=scale,
                     BLOCK_N=rows, BLOCK_K=block_k, USE_PDL=False)
        return Case(name, gemv._gemv_kernel, types, flags, warps, rows * (2 if silu else 1) * block_k)

    def q4(name, rows, warps, *, silu=False, norm=False):
        block_w = int4_matmul.GemvConfig(rows, warps).block_w
        flags = dict(GROUP=128, T=16, HAS_BIAS=False, NORM=norm, SILU_MUL=silu, HAS_RESIDUAL=not silu, BLOCK_N=rows,
                     BLOCK_W=block_w)
        return Case(name, int4_matmul._int4_gemv_kernel, int4, flags, warps, rows * (2 if silu else 1) * block_w * 8)

    # Qwen3-30B-A3B's sparse MLP at one token (hidden 2048, experts of 768, top 8): the configs it runs.
    moe_cfg = fused_moe.choose_gemv_config(2048, 768, 8)
    gate_up = Case("moe gate/up norm + SiLU (Qwen3-30B-A3B)", fused_moe._gemv_gate_up_kernel,
                   {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "topk_ids_ptr": "*i64",
                    "norm_w_ptr": "*bf16", "eps": "fp32"},
                   dict(TOP_K=8, NORM=True, BLOCK_N=moe_cfg.gate_up_rows, BLOCK_K=moe_cfg.gate_up_block_k,
                        USE_PDL=False),
                   moe_cfg.num_warps, 2 * moe_cfg.gate_up_rows * moe_cfg.gate_up_block_k)
    down = Case("moe down, 8 slots + residual (Qwen3-30B-A3B)", fused_moe._gemv_down_kernel,
                {"out_ptr": "*bf16", "inter_ptr": "*bf16", "w_ptr": "*bf16", "topk_ids_ptr": "*i64",
                 "route_w_ptr": "*fp32", "res_ptr": "*bf16"},
                dict(TOP_K=8, HAS_RESIDUAL=True, BLOCK_S=8, BLOCK_N=moe_cfg.down_rows, BLOCK_K=moe_cfg.down_block_k,
                     USE_PDL=False),
                moe_cfg.num_warps, 8 * moe_cfg.down_rows * moe_cfg.down_block_k)
    return [
        g("bf16 gemv + residual", bf16, 2, 1024, 4),
        g("bf16 gemv norm + SiLU", bf16, 4, 1024, 4, silu=True, norm=True),
        g("fp8 gemv (weight-only) + residual", fp8, 2, 2048, 4, scale=True),
        g("fp8 gemv norm + SiLU", fp8, 4, 2048, 8, silu=True, norm=True, scale=True),
        q4("int4 gemv + residual", 8, 2),
        q4("int4 gemv norm + SiLU", 4, 2, silu=True, norm=True),
        gate_up,
        down,
    ]


def main() -> None:
    rows = []
    for case in cases():
        ops = compile_loop(case)
        per_thread = case.weights_per_iteration / (32 * case.num_warps)
        total = sum(ops.values())
        rows.append((case, total, per_thread, total / per_thread, ops))
    print(f"Triton {triton.__version__}, SASS for sm_90 (ptxas bundled with Triton)\n")
    print("| kernel | warps | loop instructions | weights / thread / iteration | instructions / weight | top opcodes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case, total, per_thread, per_weight, ops in rows:
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(5))
        print(f"| {case.name} | {case.num_warps} | {total} | {per_thread:.0f} | {per_weight:.2f} | {top} |")
    worst = max(rows, key=lambda r: r[3])
    print(f"\nmost instructions per weight: {worst[0].name}, {worst[3]:.2f}")


if __name__ == "__main__":
    main()
