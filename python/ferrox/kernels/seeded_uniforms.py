"""Uniform draws of the seeded rows of a step, all in one launch: row r's u[v] is Philox at
(its request's seed, counter * V + v), the counter being the number of steps the request has
sampled so far.

Why: a seeded request used to own a torch CUDA generator, and a step drew each seeded row's
uniforms with its own `uniform_` call: one launch and the generator's host-side bookkeeping per
row, ~10 us of host time each, 0.6 ms for 64 seeded rows. When a grammar mask holds the step's
sampling until the next step's start, that host time is on the GPU's critical path
(benches/RESULTS.md, twelfth session). The draws stay a function of the request alone (seed,
how many steps it has sampled), so a seeded request gives the same tokens alone or batched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _seeded_uniforms_kernel(u_ptr, rows_ptr, seeds_ptr, counters_ptr, vocab, stride_u, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    seed = tl.load(seeds_ptr + i)
    first = tl.load(counters_ptr + i) * vocab  # int64: 64-bit Philox counters
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    u = tl.rand(seed, first + cols)
    tl.store(u_ptr + row * stride_u + cols, u, mask=cols < vocab)


def fill_seeded_uniforms(u: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, counters: torch.Tensor) -> None:
    """Overwrite rows `rows` of u [B, V] float32 with each one's draws; rows, seeds, counters int64
    [S] on u's device (seeds as int64 bit patterns: layers/sampler.seed_bits; counters >= 0)."""
    if u.dim() != 2 or u.dtype != torch.float32 or u.stride(1) != 1:
        raise ValueError(f"u must be float32 [batch, vocab] with contiguous rows, got {u.dtype} {tuple(u.shape)}")
    s = rows.numel()
    for name, t in (("rows", rows), ("seeds", seeds), ("counters", counters)):
        if t.shape != (s,) or t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [{s}], got {t.dtype} {tuple(t.shape)}")
    if s == 0:
        return
    block = 4096
    _seeded_uniforms_kernel[(s, triton.cdiv(u.shape[1], block))](u, rows, seeds, counters, u.shape[1], u.stride(0),
                                                                  BLOCK=block, num_warps=4)

