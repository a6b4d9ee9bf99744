"""GPU kernels. Each has a plain-torch reference and a test against it (tests/kernels/), run on CPU
under the Triton interpreter at tiny shapes and on the GPU at Llama-3.1-8B shapes.

- reshape_and_cache.py  K/V write into the paged cache through the slot mapping (slot -1 skipped)
- paged_attention.py    unified paged attention for mixed prefill-chunk + decode batches (GQA,
                        causal chunks, any block size) with a split-KV path for long contexts
- mla_attention.py      DeepSeek's latent attention (MLA) over the one-row latent cache: mixed steps, many
                        heads a program, the 512 + 64 score split, split-KV decode; the latent write
- rmsnorm.py            RMSNorm, fused with the residual add
- activation.py         SiLU-and-mul of the gated MLP
- rotary.py             neox rotary embedding from a cos/sin cache (+ Llama 3.1 frequency scaling)
- gemv.py               one-token matrix-vector products with RMSNorm / residual / SiLU / rotary +
                        KV write fused in (batch-1 decode: five launches per decoder layer)
- qk_norm_rope.py       Qwen3's per-head q/k RMSNorm + rotary in one launch: + KV write for one token
                        (after a gemv), or q and k of a step's many tokens (after the qkv GEMM)
- cuda_sampling.py      top-k/top-p sampling: CUDA C++ kernel (cuda/) JIT-built once (on a
                        background thread at a first engine start, used from the next start on),
                        torch fallback otherwise and off CUDA
- exponential_race.py   the sampler's draw for plain temperature sampling in one pass
- int4_matmul.py        AWQ/GPTQ int4 weights: dequantize-in-the-loop GEMV (decode) and GEMM (prefill)
- int4_gemv_cuda.py     int4 decode products (1-16 tokens, the one-token fusions) on tensor cores:
                        cuda/int4_gemv.cu and its weight stream
- nvrtc.py              CUDA C++ sources compiled at run time by NVRTC (disk-cached cubins), launched on
                        torch's stream through cuda-bindings' driver API
- int8_gemm.py          int8 W8A8: int8 tensor-core GEMM, exact int32 sums, scales in the epilogue
- fused_moe.py / lora.py  grouped expert matmuls, the one-token expert GEMVs and top-k routing; LoRA
                        shrink/expand
- moe_align.py          the grouped MoE path's stable sort of (token, slot) pairs by expert, padded to
                        the GEMM's block rows, in three launches
- argmax.py             greedy sampling's argmax split over the row (a few rows of a large vocabulary)
- w8a8_dot_gemv.py      FP8 and int8 one-token products on tensor cores (W8A8), split over K (split_k.py:
                        the last-arriving program per row block finishes the sum)
- int8_codes.py         int8 activation codes as vLLM rounds them (shared by the quantizing kernels)
- token_bitmask.py      a grammar's allow-bits applied to the constrained rows' logits in one launch
- seeded_uniforms.py    the seeded rows' uniforms of a step in one launch (Philox at seed, steps sampled)
- pdl.py                programmatic dependent launch (Hopper) for the one-token kernels: a kernel starts
                        while the previous one drains and waits before reading what the step wrote
(FP8: gemv.py reads fp8 weights with per-row scales; the KV writes and attention kernels read an fp8 cache.)

Modules import triton at import time (cuda_sampling.py does not); import them only where a GPU path may run.
`select_kernels` below is the one place that maps a device to a kernel set; the layer ops
(layers/ops.py) and the attention backend (attention/backend.py) both ask it when a model is built.
Measured numbers: benches/RESULTS.md (benches/bench_kernels.py).
"""

from __future__ import annotations

from typing import Any, Literal

KernelSet = Literal["torch", "triton"]
KERNEL_SETS: tuple[KernelSet, ...] = ("torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_kernels(device: Any, name: str | None = None) -> KernelSet:
    """The kernel set a model built for `device` runs: "triton" on CUDA when Triton imports, else
    "torch" (plain torch ops: CPU, and the reference the kernels are tested against).

    `name` forces a set; tests force "triton" on CPU to run the GPU path in the Triton interpreter
    (TRITON_INTERPRET=1). Forcing "triton" without Triton installed raises ImportError."""
    if name is None:
        import torch

        return "triton" if torch.device(device).type == "cuda" and triton_available() else "torch"
    if name not in KERNEL_SETS:
        raise ValueError(f"kernel set {name!r} is unknown (choose 'torch' or 'triton')")
    if name == "triton" and not triton_available():
        raise ImportError("the Triton kernels were asked for, but triton is not installed")
    return "triton" if name == "triton" else "torch"


def fp8_unsupported_gpu(device: Any) -> str | None:
    """None when `device` can convert to and from FP8 E4M3 (the CPU, CUDA sm89+: Ada, Hopper);
    otherwise the GPU's compute capability, "smXY", for an error message."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return None if (major, minor) >= (8, 9) else f"sm{major}{minor}"
