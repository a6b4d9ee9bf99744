"""The sampler's draw for plain temperature sampling, in one pass over the logits.

The exponential race picks argmax_i p_i / q_i with q_i ~ Exp(1), which is distributed as p. In
logs that is argmax_i (logits_i / T - log q_i): the softmax's normaliser is the same for every
token of a row, so the probabilities never need to exist. Torch spends ~14 passes over the
[batch, vocab] float32 logits on it (scale, softmax, log, neg, divide, argmax); this kernel reads
the logits and the uniforms once (q = -log u; the sampler draws u: the default generator for
unseeded rows, seeded_uniforms.py for seeded ones). At 512 rows x 128k vocabulary that is ~0.7 ms less per decode step on
an H200 (benches/RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _exponential_race_kernel(out_ptr, logits_ptr, u_ptr, temperature_ptr, vocab, stride_l, stride_u,
                             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    inv_t = 1.0 / tl.load(temperature_ptr + row).to(tl.float32)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_l + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.5)
        # u = 0 gives q = inf: a score of -inf, like p / inf = 0 in the probability form.
        score = x * inv_t - tl.log(-tl.log(u))
        better = score > best  # strict: the first index wins within a lane, as argmax does
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best, axis=0)
    winner = tl.min(tl.where(best == top, best_idx, vocab), axis=0)
    tl.store(out_ptr + row, tl.minimum(winner, vocab - 1).to(tl.int64))


def exponential_race(logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """int64 [B]: argmax(softmax(logits / temperature) / -log(uniforms)) per row, in one kernel.

    logits [B, V] (any float dtype), temperature [B] (> 0), uniforms [B, V] float32 in [0, 1)."""
    if logits.dim() != 2 or uniforms.shape != logits.shape:
        raise ValueError(f"logits and uniforms must both be [batch, vocab], got {tuple(logits.shape)} / "
                         f"{tuple(uniforms.shape)}")
    if temperature.shape != (logits.shape[0],):
        raise ValueError(f"temperature must be [batch={logits.shape[0]}], got {tuple(temperature.shape)}")
    if logits.stride(-1) != 1 or uniforms.stride(-1) != 1:
        raise ValueError("exponential_race needs a contiguous vocab axis")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0] == 0:
        return out
    _exponential_race_kernel[(logits.shape[0],)](
        out, logits, uniforms, temperature, logits.shape[1], logits.stride(0), uniforms.stride(0),
        BLOCK=min(2048, triton.next_power_of_2(logits.shape[1])), num_warps=8,
    )
    return out
