"""Mamba2's selective scan for short queries in one launch: decode steps and speculative verify steps, keeping the
state after each draft token (layers/mamba2_ssm.py has the scan and the torch reference).

One program per (request, head, block of head_dim columns) holds its [d_state, BP] slice of the state in registers
through the whole query: per token S <- exp(dt A) S + B (dt x)^T, y = S^T C + D x, writing the output row and the
draft states as it goes and the final state once, in place in the pool ([rows, H, d_state, head_dim]). The torch
path is a dozen launches a token. No host reads (query_start_loc on the device): CUDA graphs replay it. All math
in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# head_dim columns per program: the state slice is N x BP float32 in registers (128 x 16 over 4 warps: 16 a thread).
BLOCK_P = 16


@triton.jit
def _mamba2_recurrent_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr, states_ptr, rows_ptr, has_state_ptr,
                             qsl_ptr, drafts_ptr, live_ptr, num_drafts, group,
                             stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
                             stride_yt, stride_yh, stride_sr, stride_sh,
                             N: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, BP: tl.constexpr,
                             HAS_LIVE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    g = h // group  # the group whose B and C serve head h
    offs_n = tl.arange(0, BN)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    in_n = offs_n < N
    in_p = offs_p < P
    tile = offs_n[:, None] * P + offs_p[None, :]  # (the state rows are [H, N, P], contiguous per head)
    in_tile = in_n[:, None] & in_p[None, :]
    row = tl.load(rows_ptr + i).to(tl.int64)
    start = tl.load(qsl_ptr + i)
    end = tl.load(qsl_ptr + i + 1)
    home = states_ptr + row * stride_sr + h * stride_sh
    state = tl.load(home + tile, mask=in_tile, other=0.0).to(tl.float32)
    # A fresh request ignores its row's old content (tl.where, not a multiply: a recycled row may hold NaN).
    state = tl.where(tl.load(has_state_ptr + i) != 0, state, 0.0)
    a = tl.load(a_ptr + h).to(tl.float32)
    d = tl.load(d_ptr + h).to(tl.float32)
    first = start.to(tl.int64)
    live = end - start
    if HAS_LIVE:  # a padded query: the rows past its live tokens are zeros and leave the state alone
        live = tl.minimum(live, tl.load(live_ptr + i))
        for j in range(live, end - start):
            tl.store(y_ptr + (first + j) * stride_yt + h * stride_yh + offs_p, tl.zeros([BP], tl.float32).to(
                y_ptr.dtype.element_ty), mask=in_p)
    for j in range(0, live):
        tok = first + j
        x = tl.load(x_ptr + tok * stride_xt + h * stride_xh + offs_p, mask=in_p, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + tok * stride_dtt + h).to(tl.float32)
        b = tl.load(b_ptr + tok * stride_bt + g * stride_bg + offs_n, mask=in_n, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + tok * stride_ct + g * stride_cg + offs_n, mask=in_n, other=0.0).to(tl.float32)
        state = state * tl.exp(dt * a) + b[:, None] * (dt * x)[None, :]
        out = tl.sum(state * c[:, None], axis=0) + d * x
        tl.store(y_ptr + tok * stride_yt + h * stride_yh + offs_p, out.to(y_ptr.dtype.element_ty), mask=in_p)
        if j < num_drafts:
            draft = tl.load(drafts_ptr + i * num_drafts + j)
            if draft >= 0:
                dst = states_ptr + draft.to(tl.int64) * stride_sr + h * stride_sh
                tl.store(dst + tile, state.to(states_ptr.dtype.element_ty), mask=in_tile)
    tl.store(home + tile, state.to(states_ptr.dtype.element_ty), mask=in_tile)


def fla_takes(x: torch.Tensor) -> bool:
    """Whether flash-linear-attention's chunked kernel may run on x (layers/mamba2_ssm.py): CUDA tensors only; the
    Triton op set on the CPU (the interpreter, in tests) keeps the torch scan for prompts, as the delta rule does."""
    return x.is_cuda


def mamba2_recurrent(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, ssm_states: torch.Tensor, state_rows: torch.Tensor,
                     query_start_loc: torch.Tensor, has_state: torch.Tensor, draft_rows: torch.Tensor | None = None,
                     live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H, P] in x's dtype; the arguments are mamba2_ssm_varlen's (layers/mamba2_ssm.py): x [T, H, P], dt
    [T, H] (after softplus and clamp), A / D [H], B / C [T, G, N], ssm_states [R, H, N, P] updated in place at
    state_rows [N] (from zeros where has_state [N] is False), query_start_loc [N + 1] int32; draft_rows [N, K]
    int64 (-1: none): the state after request i's token t < K also goes to row draft_rows[i, t]; live_lens [N]
    int32 (None: whole queries). Every query runs token by token, so this is for short ones."""
    tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    if x.stride(-1) != 1 or B.stride(-1) != 1 or C.stride(-1) != 1 or dt.stride(-1) != 1:
        raise ValueError("x, dt, B and C must be contiguous in their last dim")
    if not ssm_states.is_contiguous():
        raise ValueError("ssm_states must be contiguous")
    num_reqs = state_rows.shape[0]
    y = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    if not num_reqs or not tokens:
        return y.zero_()
    num_drafts = draft_rows.shape[1] if draft_rows is not None else 0
    # (no drafts: any int pointer stands in, never read)
    drafts_arg = draft_rows.to(torch.int64).contiguous() if draft_rows is not None and num_drafts else state_rows
    block_p = min(BLOCK_P, triton.next_power_of_2(head_dim))
    grid = (num_reqs, heads, triton.cdiv(head_dim, block_p))
    _mamba2_recurrent_kernel[grid](
        x, dt, A.contiguous(), B, C, D.contiguous(), y, ssm_states, state_rows, has_state.view(torch.uint8),
        query_start_loc, drafts_arg, live_lens if live_lens is not None else state_rows, num_drafts,
        heads // groups, x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), ssm_states.stride(0), ssm_states.stride(1),
        N=d_state, P=head_dim, BN=triton.next_power_of_2(d_state), BP=block_p, HAS_LIVE=live_lens is not None,
        num_warps=4)
    return y
