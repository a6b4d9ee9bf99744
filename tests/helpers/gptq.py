"""A reference GPTQ solver (Frantar et al., 2022, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers"), written from the paper, for the benchmarks and tests that need
int4 weights as a calibrated export would hold them rather than plain round-to-nearest.

GPTQ quantizes one input column at a time and spreads each column's rounding error over the columns
not yet quantized, weighted by the inverse of the layer's input Hessian H = X^T X (X: the layer's
calibration inputs), so the layer's *outputs* on inputs like X move as little as possible. With
act-order the columns go in decreasing order of diag(H) (the inputs with the most energy first), and
groups are formed in that order, which is what a checkpoint's g_idx records.

The output is the same (codes, scales, zeros, g_idx) as int4_checkpoints.quantize_groups, so the
packing into AWQ/GPTQ layouts is shared.
"""

from __future__ import annotations

import torch

# Shrink factors tried for each group's range (GPTQ's "mse" option): clipping a few outliers costs
# less than coarse steps for all the other weights of the group.
CLIP_GRID = tuple(1.0 - 0.025 * i for i in range(9))


def _group_params(w: torch.Tensor, *, sym: bool, clip: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, C] float64 -> (scale fp16-representable float64 [N], integer zero [N]) for 4 bits."""
    best_err = torch.full((w.shape[0],), float("inf"), dtype=torch.float64)
    best_s = torch.ones(w.shape[0], dtype=torch.float64)
    best_z = torch.zeros(w.shape[0], dtype=torch.float64)
    for p in CLIP_GRID if clip else (1.0,):
        if sym:
            s = (2 * p * w.abs().amax(dim=1) / 15).clamp(min=1e-8)
            z = torch.full_like(s, 8.0)
        else:
            lo, hi = p * w.amin(dim=1).clamp(max=0), p * w.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8)
            z = torch.round(-lo / s).clamp(0, 15)
        s = s.to(torch.float16).double()  # the checkpoint stores fp16 scales: quantize with those
        q = (torch.round(w / s[:, None]) + z[:, None]).clamp(0, 15)
        err = ((q - z[:, None]) * s[:, None] - w).abs().pow(2.4).sum(dim=1)
        better = err < best_err
        best_err, best_s, best_z = torch.where(better, err, best_err), torch.where(better, s, best_s), \
            torch.where(better, z, best_z)
    return best_s, best_z


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group: int, *, sym: bool = False,
                  act_order: bool = True, damp: float = 0.01, clip: bool = True):
    """w [N, K], hessian [K, K] (sum of x x^T over calibration inputs) -> codes uint8 [N, K],
    scales fp16 [G, N], zeros int64 [G, N], g_idx int64 [K] (column k's group)."""
    n, k = w.shape
    group = k if group == -1 else group
    W = w.double().clone()
    H = hessian.double().clone()
    dead = H.diagonal() == 0  # inputs that were always zero: their weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else torch.arange(k)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * H.diagonal().mean() * torch.eye(k, dtype=torch.float64)
    # The upper Cholesky factor of H^-1: row i holds how column i's error is spread over the later ones.
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    num_groups = -(-k // group)
    codes = torch.zeros(n, k, dtype=torch.float64)
    scales = torch.zeros(num_groups, n, dtype=torch.float64)
    zeros = torch.zeros(num_groups, n, dtype=torch.float64)
    # Blocks of one group each: a group's range is taken from its columns after every earlier
    # column's error has been spread into them.
    for i1 in range(0, k, group):
        i2 = min(i1 + group, k)
        g = i1 // group
        W1 = W[:, i1:i2].clone()
        errs = torch.zeros_like(W1)
        s, z = _group_params(W1, sym=sym, clip=clip)
        scales[g], zeros[g] = s, z
        for i in range(i2 - i1):
            col = W1[:, i]
            q = (torch.round(col / s) + z).clamp(0, 15)
            codes[:, i1 + i] = q
            err = (col - (q - z) * s) / U[i1 + i, i1 + i]
            W1[:, i:] -= err[:, None] * U[i1 + i, i1 + i:i2][None, :]
            errs[:, i] = err
        W[:, i2:] -= errs @ U[i1:i2, i2:]
    out = torch.empty(n, k, dtype=torch.uint8)
    out[:, perm] = codes.to(torch.uint8)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group
    return out, scales.to(torch.float16), zeros.to(torch.int64), g_idx
