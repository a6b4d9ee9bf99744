"""Programmatic dependent launch (PDL, Hopper and later) for the one-token decode kernels.

A batch-1 decode step is ~200-500 short kernels in one CUDA graph, each streaming a few MB of
weights. Between two of them the GPU drains: the last programs of one kernel finish their
reductions while most SMs idle, then the next kernel's programs start and wait a full memory
latency for their first weight tile. Launched with PDL, a kernel's programs may start while the
previous kernel is still finishing; they issue the loads that depend on nothing the previous
kernels write (their weight tiles) and then wait (`griddepcontrol.wait`, `gdc_wait`) until the
previous kernel has completed and its writes are visible. Their first weight tile is then in
flight already, and the previous kernel's tail overlaps the next one's start.

The rules each kernel launched this way follows, so that nothing can race:
- before `gdc_wait`, it reads only data no kernel of the step writes (weights, norm weights,
  weight scales) and writes nothing;
- every program runs `gdc_wait` (and nothing returns before it), so "kernel B completed" implies
  "every kernel before B completed": ordering stays transitive along the stream whatever each
  kernel reads;
- it signals `gdc_launch_dependents` at its start, so the next kernel is scheduled as soon as all
  of this one's programs are resident (the dependents can never take an SM this kernel needs) --
  except the kernels whose next kernel is decode attention (the qkv + rotary kernels of gemv.py and
  dense_gemv.cu, Qwen3's q/k norm + rotary kernel), which never signal, so attention's programs
  launch as theirs exit. Measured on an H200 (benches/RESULTS.md, thirty-fourth session; batch-1
  steps, ABAB): bf16 Llama-3.1-8B 4.005 -> 3.897 ms, FP8 2.573 -> 2.547, Qwen3-30B-A3B 2.491 ->
  2.449, int4 unchanged. Launching attention without PDL at all, or attention and its merge not
  signalling, measured slower, as did the qkv kernel signalling after its K loop; where attention's
  many short programs are placed while the qkv kernel still holds the SMs is the likely cause, not
  yet profiled.

A kernel launched without PDL (torch ops, cuBLAS) waits for everything before it as usual, and a
PDL kernel after one of those simply starts when it ends. Stream capture turns the launches into
programmatic edges of the CUDA graph. `FERROX_PDL=0` turns it off (for A/B measurements); the
Triton interpreter and pre-Hopper GPUs never use it.

Which kernels take it, as measured on an H200 (benches/RESULTS.md, sixteenth session): the float
GEMVs and the qkv + rotary kernel (gemv.py, which request their first weight tile before the wait),
paged attention and its split merge, Qwen3's q/k norm kernel, RMSNorm, and the one-token MoE
kernels (routing, expert gate/up, expert down). Qwen3-30B-A3B's batch-1 step, ~480 short launches,
went 2.76 -> 2.51 ms; a dense bf16 8B step, whose launches are long, did not move (4.19 / 4.18
ms). Not the int4 GEMV (int4_matmul.py) nor the FP8 tensor-core product (w8a8_dot_gemv.py): with
PDL their steps were 9% and 7% slower (3.03 -> 3.31, 3.28 -> 3.51 ms), with or without an L2
prefetch of the first tile. (A likely reason: launched early, a kernel of many small programs is
placed on whichever SMs have room as the previous one drains, not spread evenly.) The CUDA kernels
launched through nvrtc.py take it: int4_gemv_cuda.py's and dense_gemv_cuda.py's, whose persistent
blocks request their first weight stages before the wait (the latter's FP8 qkv + rotary 11.4 us with
PDL against 13.4 without, o_proj 7.5 against 8.8; thirty-first session), and decode_attention_cuda.py's
attention, which waits before its first read (q and the step's K/V come from the kernel before it) and
signals after its KV loop (at its start measured the same: bf16 batch-1 3.808 against 3.804-3.811 ms).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.cache
def triton_supports_pdl() -> bool:
    """Whether the installed Triton has the grid-dependency ops and the launch option (3.3 and
    later; torch 2.4-2.6 bring older ones, which then launch the kernels plainly)."""
    try:
        import triton.language.extra.cuda as cuda_extra
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
            and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {}))


def pdl_enabled(device: torch.device) -> bool:
    """Whether the one-token kernels on `device` launch with PDL: CUDA sm90+, a Triton that has it,
    not interpreted, FERROX_PDL not "0"."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("FERROX_PDL", "1") == "0" or not triton_supports_pdl():
        return False
    return _device_supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict[str, Any]:
    """The launch keywords of a PDL-aware kernel on `device`: its USE_PDL constexpr, and Triton's
    launch_pdl option when on."""
    if pdl_enabled(device):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel's programs be scheduled (a kernel's first statement)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel has completed and its writes are visible (before the first
    read of anything a kernel of the step writes, and before the first write)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
