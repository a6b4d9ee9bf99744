"""The gated delta rule's recurrence for short queries in one launch, keeping the state after each draft token:
a hybrid model's speculative verify steps (layers/gated_delta_rule.py has the rule and the torch reference).

A verify query is a request's last sampled token and its k drafts (k + 1 <= 16 tokens). The state to go on from
is the one after however many drafts are accepted -- known only after sampling -- so the step keeps the state after
each of the query's first tokens in that request's draft rows of the pool (worker/recurrent_states.py). The torch
path steps the batch one token at a time in a dozen launches per token and copies each state out; here one program
per (request, value head, block of value columns) holds its [Dk, BV] slice of the state in registers through the
whole query, writing the output row and the draft states as it goes and the final state once.

No host reads: each program finds its query in query_start_loc on the device, so a CUDA graph replays it with the
step's own rows (worker/cuda_graphs.py's verify graphs). q and k arrive raw and are L2-normalised here (q also
scaled by Dk**-0.5), as fla's kernels do with use_qk_l2norm_in_kernel. All math in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Value columns per program: the state slice is Dk x BV float32 in registers (128 x 32 over 4 warps: 32 a thread),
# and a batch-1 step of a 32-value-head layer still spreads over 128 programs.
BLOCK_V = 32


@triton.jit
def _gated_delta_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, states_ptr, rows_ptr, has_state_ptr,
                                  qsl_ptr, drafts_ptr, live_ptr, num_drafts, group, scale, eps,
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt,
                                  stride_bt, stride_ot, stride_oh, stride_sr, stride_sh,
                                  DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                  HAS_LIVE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // group  # the key head serving value head h
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
    in_k = offs_k < DK
    in_v = offs_v < DV
    tile = offs_k[:, None] * DV + offs_v[None, :]  # (the state rows are [Hv, Dk, Dv], contiguous per head)
    in_tile = in_k[:, None] & in_v[None, :]
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(qsl_ptr + i)
    end = tl.load(qsl_ptr + i + 1)
    home = states_ptr + row * stride_sr + h * stride_sh
    state = tl.load(home + tile, mask=in_tile, other=0.0).to(tl.float32)
    # A fresh request ignores its row's old content (tl.where, not a multiply: a recycled row may hold NaN).
    state = tl.where(tl.load(has_state_ptr + i) != 0, state, 0.0)
    first = start.to(tl.int64)
    live = end - start
    if HAS_LIVE:  # a padded query: the rows past its live tokens are zeros and leave the state alone
        live = tl.minimum(live, tl.load(live_ptr + i))
        for j in range(live, end - start):
            tl.store(o_ptr + (first + j) * stride_ot + h * stride_oh + offs_v, tl.zeros([BV], tl.float32).to(
                o_ptr.dtype.element_ty), mask=in_v)
    for j in range(0, live):
        tok = first + j
        q = tl.load(q_ptr + tok * stride_qt + hk * stride_qh + offs_k, mask=in_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + tok * stride_kt + hk * stride_kh + offs_k, mask=in_k, other=0.0).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        v = tl.load(v_ptr + tok * stride_vt + h * stride_vh + offs_v, mask=in_v, other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(g_ptr + tok * stride_gt + h).to(tl.float32))
        beta = tl.load(beta_ptr + tok * stride_bt + h).to(tl.float32)
        state = state * decay
        delta = (v - tl.sum(state * k[:, None], axis=0)) * beta  # write only what the state does not predict
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], axis=0)
        tl.store(o_ptr + tok * stride_ot + h * stride_oh + offs_v, out.to(o_ptr.dtype.element_ty), mask=in_v)
        if j < num_drafts:
            draft = tl.load(drafts_ptr + i * num_drafts + j)
            if draft >= 0:
                dst = states_ptr + draft.to(tl.int64) * stride_sr + h * stride_sh
                tl.store(dst + tile, state.to(states_ptr.dtype.element_ty), mask=in_tile)
    tl.store(home + tile, state.to(states_ptr.dtype.element_ty), mask=in_tile)


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          ssm_states: torch.Tensor, state_rows: torch.Tensor, query_start_loc: torch.Tensor,
                          has_state: torch.Tensor, draft_rows: torch.Tensor | None = None,
                          live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype; the arguments are gated_delta_rule_varlen's (layers/gated_delta_rule.py): q / k
    [T, Hk, Dk] raw, v [T, Hv, Dv], g / beta [T, Hv], ssm_states [R, Hv, Dk, Dv] updated in place at state_rows [N]
    (from zeros where has_state [N] is False), query_start_loc [N + 1] int32; draft_rows [N, K] int64 (-1: none):
    the state after request i's token t < K also goes to row draft_rows[i, t]; live_lens [N] int32 (None: whole
    queries): request i's state goes through its first live_lens[i] tokens only, its later rows (a CUDA graph's
    padding) get zero outputs. Every query runs token by token, so this is for short ones (verify steps, decodes)."""
    tokens, key_heads, dk = q.shape
    value_heads, dv = v.shape[1], v.shape[2]
    if any(t.stride(-1) != 1 for t in (q, k, v)) or g.stride(-1) != 1 or beta.stride(-1) != 1:
        raise ValueError("q, k, v, g and beta must be contiguous in their last dim")
    if not ssm_states.is_contiguous():
        raise ValueError("ssm_states must be contiguous")
    num_reqs = state_rows.shape[0]
    o = torch.empty((tokens, value_heads, dv), dtype=v.dtype, device=v.device)
    num_drafts = draft_rows.shape[1] if draft_rows is not None else 0
    # (no drafts: any int pointer stands in, never read)
    drafts_arg = draft_rows.to(torch.int64).contiguous() if draft_rows is not None and num_drafts else state_rows
    if not num_reqs or not tokens:
        return o.zero_()
    block_v = min(BLOCK_V, triton.next_power_of_2(dv))
    grid = (num_reqs, value_heads, triton.cdiv(dv, block_v))
    _gated_delta_recurrent_kernel[grid](
        q, k, v, g, beta, o, ssm_states, state_rows, has_state.view(torch.uint8), query_start_loc, drafts_arg,
        live_lens if live_lens is not None else state_rows, num_drafts, value_heads // key_heads, dk ** -0.5, 1e-6,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), ssm_states.stride(0), ssm_states.stride(1),
        DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=block_v, HAS_LIVE=live_lens is not None, num_warps=4)
    return o
