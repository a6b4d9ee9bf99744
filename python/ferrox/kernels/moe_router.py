"""A one-token MoE router in one launch: RMSNorm, the router GEMV and the top-k routing.

In the one-token decode step of a sparse layer (attention/fused_decode.py) the router's logits are
a few hundred bytes, yet computing them and routing them took two launches: the router GEMV
(kernels/gemv.py) and `route_top_k` (kernels/fused_moe.py), each a few microseconds of launch,
wait and tail for almost no work, 48 times a step on Qwen3-30B-A3B. Here the GEMV's programs each
write their rows of logits, count their arrival (as split_k.py's products do), and the last
program to arrive routes: softmax over the experts, the k largest, their probabilities
(renormalised to sum 1 where the model says so), written as route_top_k writes them.

Routing without k rounds of reductions: each expert's rank is the number of experts ahead of it
(a larger logit, or an equal one with a lower id: route_top_k's tie rule), counted in one
[E, E] comparison and one reduction; rank r < k is written to slot r. NaN logits count as -inf,
so the ranks are always a permutation and every slot gets a valid expert id (a NaN-producing
model yields NaN weights, never an expert id past the table). The [E, E] tile bounds this to
routers of at most MAX_EXPERTS experts; larger ones keep the two launches.

Launch config from the router sweep on the H200 (benches/RESULTS.md, twentieth session): 8 rows
a program and the whole row in one K tile (128 x 2048 router: 1.33 us against 2.76 for the
generic GEMV config).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrox.kernels.gemv import _accumulate, _weight_tile
from ferrox.kernels.pdl import pdl_launch, pdl_launch_dependents, pdl_wait
from ferrox.kernels.split_k import ArrivalCounters

MAX_EXPERTS = 128
_BLOCK_N = 8
_COUNTERS = ArrivalCounters()


@triton.jit
def _route_ranks(logits_ptr, weights_ptr, ids_ptr, num_experts, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                 BLOCK_E: tl.constexpr):
    """The last program's routing over the published logits (read through L2)."""
    e = tl.arange(0, BLOCK_E)
    emask = e < num_experts
    logits = tl.load(logits_ptr + e, mask=emask, other=-float("inf"), cache_modifier=".cg")
    logits = tl.where(logits == logits, logits, -float("inf"))
    top = tl.max(logits, axis=0)
    p = tl.where(emask, tl.exp(logits - top), 0.0)
    p = p / tl.sum(p, axis=0)
    # ahead[i, j]: expert j ranks before expert i.
    li = logits[:, None]
    lj = logits[None, :]
    ahead = (lj > li) | ((lj == li) & (e[None, :] < e[:, None]))
    rank = tl.sum(ahead.to(tl.int32), axis=1)
    chosen = (rank < TOP_K) & emask
    if RENORMALIZE:
        p = p / tl.sum(tl.where(chosen, p, 0.0), axis=0)
    tl.store(weights_ptr + rank, p, mask=chosen)
    tl.store(ids_ptr + rank, e.to(tl.int64), mask=chosen)


@triton.jit
def _router_top_k_kernel(
    weights_ptr,  # float32 [TOP_K]
    ids_ptr,  # int64 [TOP_K]
    logits_ptr,  # float32 [E]: the router's logits, as gemv(..., out_dtype=float32) writes them
    count_ptr,  # int32 arrival counter, left at 0
    x_ptr,
    w_ptr,
    norm_w_ptr,
    eps,
    num_experts,
    K,
    stride_w,
    NORM: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_launch_dependents(USE_PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < num_experts
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    cols = tl.arange(0, BLOCK_K)
    kmask = cols < K
    w, _ = _weight_tile(w_rows, cols, rmask, kmask, 0, False)  # requested before the wait (pdl.py)
    pdl_wait(USE_PDL)
    acc, _, sq = _accumulate(acc, acc, sq, w, w, x_ptr, norm_w_ptr, cols, kmask, NORM, False)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        kmask = cols < K
        w, _ = _weight_tile(w_rows, cols, rmask, kmask, 0, False)
        acc, _, sq = _accumulate(acc, acc, sq, w, w, x_ptr, norm_w_ptr, cols, kmask, NORM, False)
    y = tl.sum(acc, axis=1)
    if NORM:
        y = y * tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
    tl.store(logits_ptr + rows, y, mask=rmask)
    # Every thread's logits are written before the count is raised (release); the last program
    # reads the others' through L2 after it (acquire).
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        _route_ranks(logits_ptr, weights_ptr, ids_ptr, num_experts, TOP_K, RENORMALIZE, BLOCK_E)
        tl.store(count_ptr, 0)  # ready for the next launch


def fused_router_supported(num_experts: int, weight: torch.Tensor) -> bool:
    """Whether router_top_k takes this router: a float weight (not a quantized one) of at most
    MAX_EXPERTS rows."""
    return num_experts <= MAX_EXPERTS and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)


def router_top_k(h: torch.Tensor, weight: torch.Tensor, top_k: int, renormalize: bool, *,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For one token h [1, K]: logits = weight @ rms_norm(h) (norm_weight given) or weight @ h,
    then route_top_k(logits, top_k, renormalize). Returns (weights float32 [1, k], expert ids int64
    [1, k], logits float32 [1, E])."""
    num_experts, k = weight.shape
    if h.dim() != 2 or h.shape != (1, k) or h.stride(-1) != 1:
        raise ValueError(f"router_top_k: h must be a contiguous [1, {k}] row, got {tuple(h.shape)}")
    if weight.stride(1) != 1 or not fused_router_supported(num_experts, weight):
        raise ValueError(f"router_top_k: needs a row-major float weight of at most {MAX_EXPERTS} experts, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if not 0 < top_k <= num_experts:
        raise ValueError(f"router_top_k: top_k {top_k} must be in 1..{num_experts} (the number of experts)")
    if norm_weight is not None and norm_weight.shape != (k,):
        raise ValueError(f"router_top_k: norm weight must be [{k}], got {tuple(norm_weight.shape)}")
    device = h.device
    weights = torch.empty(1, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(1, top_k, dtype=torch.int64, device=device)
    logits = torch.empty(1, num_experts, dtype=torch.float32, device=device)
    block_k = min(2048, triton.next_power_of_2(k))
    _router_top_k_kernel[(triton.cdiv(num_experts, _BLOCK_N),)](
        weights, ids, logits, _COUNTERS.get(device, 1), h, weight, norm_weight if norm_weight is not None else h,
        eps, num_experts, k, weight.stride(0), NORM=norm_weight is not None, TOP_K=top_k, RENORMALIZE=renormalize,
        BLOCK_N=_BLOCK_N, BLOCK_K=block_k, BLOCK_E=max(16, triton.next_power_of_2(num_experts)), num_warps=4,
        **pdl_launch(device))
    return weights, ids, logits
