"""Plain torch references for the kernel tests: obviously-correct loops, no shared code with the kernels."""

from __future__ import annotations

import torch


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [seq_len, num_kv_heads, head_dim] of one request, read position by position."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table_row.long()[pos // block_size]
    offsets = pos % block_size
    return kv_cache[0, blocks, offsets], kv_cache[1, blocks, offsets]


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention per request in float32: query i of a chunk sits at seq_len - query_len + i."""
    out = torch.full_like(q, float("nan"), dtype=torch.float32)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    qsl, lens = query_start_loc.cpu().tolist(), seq_lens.cpu().tolist()
    for r, seq_len in enumerate(lens):
        start, end = qsl[r], qsl[r + 1]
        if end == start:
            continue
        k, v = gather_kv(kv_cache, block_table[r], seq_len)
        k = k.float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = v.float().repeat_interleave(group, dim=1)
        qr = q[start:end].float()  # [L, H, D]
        scores = torch.einsum("lhd,shd->hls", qr, k) * scale
        q_pos = seq_len - (end - start) + torch.arange(end - start, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        out[start:end] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """HF Llama semantics: the residual add happens in the activation dtype, the norm in float32."""
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return out if residual is None else (out, residual)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def rotary_neox_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; rotates the first rot_dim dims (rot_dim = cos_sin_cache.shape[1]),
    neox layout (halves, not interleaved pairs)."""
    rot_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot_dim/2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x.float()
    x1, x2 = xf[..., : rot_dim // 2], xf[..., rot_dim // 2 : rot_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rot_dim:]], dim=-1)
    return rotated.to(x.dtype)


def top_k_top_p_mask_ref(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean [B, V] of tokens a top-k then top-p sampler may emit (sort based; ties at the cut kept)."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    vocab = probs.shape[1]
    for b in range(probs.shape[0]):
        p = probs[b].double()
        k = int(top_k[b])
        if 0 < k < vocab:
            kth = torch.topk(p, k).values[-1]
            keep[b] &= p >= kth
        masked = torch.where(keep[b], p, torch.zeros_like(p))
        tp = float(top_p[b])
        if tp < 1.0:
            sorted_p = torch.sort(masked, descending=True).values
            csum = torch.cumsum(sorted_p, 0)
            cut = int(torch.searchsorted(csum, tp * csum[-1]))  # first index reaching the target mass
            threshold = sorted_p[min(cut, vocab - 1)]
            keep[b] &= masked >= threshold
    return keep


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (robust to values near zero, unlike elementwise rtol)."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class PagedBatch:
    """A random mixed batch laid out in a paged KV cache the way the scheduler would.

    Request r has context_lens[r] tokens already cached and query_lens[r] new tokens this step;
    its blocks are a random permutation of the cache (never block 0, the null block), so a kernel
    that ignores the block table reads the wrong data. num_pad_tokens extra rows act like CUDA-graph
    padding (slot -1, outside every request).
    """

    def __init__(
        self,
        query_lens: list[int],
        context_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_pad_tokens: int = 0,
        spare_blocks: int = 3,
    ):
        self.seq_lens_list = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        blocks_per_req = [-(-s // block_size) for s in self.seq_lens_list]
        num_blocks = sum(blocks_per_req) + spare_blocks + 1
        perm = (torch.randperm(num_blocks - 1) + 1).tolist()
        width = max(blocks_per_req) + 2  # wider than needed: columns past a request's blocks are the null block
        table = torch.zeros(len(query_lens), width, dtype=torch.int32)
        used = 0
        for r, nb in enumerate(blocks_per_req):
            table[r, :nb] = torch.tensor(perm[used : used + nb], dtype=torch.int32)
            used += nb
        slots = []
        for r, (ctx, ql) in enumerate(zip(context_lens, query_lens, strict=True)):
            for pos in range(ctx, ctx + ql):
                slots.append(int(table[r, pos // block_size]) * block_size + pos % block_size)
        slots += [-1] * num_pad_tokens
        num_tokens = sum(query_lens) + num_pad_tokens
        self.num_tokens = num_tokens
        self.num_actual_tokens = sum(query_lens)
        self.max_query_len = max(query_lens)
        self.max_seq_len = max(self.seq_lens_list)
        self.block_size = block_size
        self.kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
        self.k = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
        qsl = [0]
        for ql in query_lens:
            qsl.append(qsl[-1] + ql)
        self.query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int32, device=device)
        self.block_table = table.to(device)
        self.scale = head_dim**-0.5


def sliced_paged_attention_ref(batch: PagedBatch, rows_per_call: int = 1024) -> torch.Tensor:
    """paged_attention_ref, request by request in slices of query rows (a query slice [a, b) of a
    chunk is itself a request of b - a queries over context + b positions), so the float32 score
    matrix of a long chunk at a long context stays a few GB."""
    ref = torch.full_like(batch.q, float("nan"), dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    for r, seq_len in enumerate(batch.seq_lens_list):
        context = seq_len - (starts[r + 1] - starts[r])
        for a in range(starts[r], starts[r + 1], rows_per_call):
            b = min(a + rows_per_call, starts[r + 1])
            loc = torch.tensor([0, b - a], dtype=torch.int32, device=batch.q.device)
            lens = torch.tensor([context + b - starts[r]], dtype=torch.int32, device=batch.q.device)
            ref[a:b] = paged_attention_ref(batch.q[a:b], batch.kv_cache, loc, lens, batch.block_table[r:r + 1],
                                           batch.scale)
    return ref


def align_by_expert_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """(pair_ids, block_expert, num_rows) of kernels/moe_align.py from torch ops: a stable sort by
    expert, each expert's run padded to block_m rows with the sentinel pair id T*k."""
    flat = topk_ids.reshape(-1).long().cpu()
    num_pairs = flat.numel()
    max_rows = -(-(num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m) * block_m
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    pair_ids = torch.full((max_rows,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((max_rows // block_m,), -1, dtype=torch.int32)
    for e in range(num_experts):
        pairs = torch.nonzero(flat == e).flatten()  # ascending: the stable order
        start = int(starts[e])
        pair_ids[start:start + pairs.numel()] = pairs.int()
        block_expert[start // block_m:(start + int(padded[e])) // block_m] = e
    return pair_ids, block_expert, int(padded.sum())
