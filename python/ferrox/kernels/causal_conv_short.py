"""The short causal convolution of linear-attention layers for short queries in one launch: decode steps and
speculative verify steps, keeping the conv state after each draft token (layers/causal_conv.py has the operation and
the torch reference).

The torch path builds an extended sequence and gathers each tap from it: some forty small launches per layer for a
verify step, which a CUDA graph of a hybrid model replays for each of its linear-attention layers. Here one program
per (request, block of channels) walks the request's query: each output reads its W inputs where they are -- the
request's conv state row for positions before this step, the step's x after -- so nothing is shifted in registers;
after token j < K the last W-1 inputs go to draft row draft_rows[i, j], and after the last token to the request's
row. No host reads (query_start_loc on the device): CUDA graphs replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 128


@triton.jit
def _input_at(x_ptr, state_ptr, first, pos, offs_c, in_c, has_old, stride_xt, HIST: tl.constexpr):
    """Channel block of the input at query position `pos` (negative: the conv state's entry HIST + pos), float32."""
    pos = offs_c.to(tl.int64) * 0 + pos  # (a vector, as has_old; the interpreter may pass an int)
    from_x = pos >= 0
    xv = tl.load(x_ptr + (first + tl.maximum(pos, 0)) * stride_xt + offs_c, mask=in_c & from_x, other=0.0)
    sv = tl.load(state_ptr + offs_c * HIST + tl.maximum(HIST + pos, 0), mask=in_c & (pos < 0) & has_old,
                 other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _causal_conv_short_kernel(x_ptr, w_ptr, b_ptr, y_ptr, states_ptr, rows_ptr, has_state_ptr, qsl_ptr, drafts_ptr,
                              live_ptr, num_drafts, channels, stride_xt, stride_yt, stride_sr,
                              W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BC: tl.constexpr,
                              HAS_LIVE: tl.constexpr):
    HIST: tl.constexpr = W - 1
    i = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    in_c = offs_c < channels
    row = tl.load(rows_ptr + i).to(tl.int64)
    # (a vector: the interpreter mishandles scalar masks) False for a fresh request: its row's old content is ignored
    has_old = (tl.zeros([BC], dtype=tl.int32) + tl.load(has_state_ptr + i).to(tl.int32)) != 0
    start = tl.load(qsl_ptr + i)
    length = tl.load(qsl_ptr + i + 1) - start
    first = start.to(tl.int64)
    if HAS_LIVE:  # a padded query: the rows past its live tokens are zeros and leave the state alone
        pad = length
        length = tl.minimum(length, tl.load(live_ptr + i))
        for j in range(length, pad):
            tl.store(y_ptr + (first + j) * stride_yt + offs_c, tl.zeros([BC], tl.float32).to(y_ptr.dtype.element_ty),
                     mask=in_c)
    home = states_ptr + row * stride_sr
    bias = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(b_ptr + offs_c, mask=in_c, other=0.0).to(tl.float32)
    for j in range(0, length):
        acc = tl.zeros([BC], dtype=tl.float32) + bias
        for tap in tl.static_range(W):
            weight = tl.load(w_ptr + offs_c * W + tap, mask=in_c, other=0.0).to(tl.float32)
            acc += weight * _input_at(x_ptr, home, first, j - HIST + tap, offs_c, in_c, has_old, stride_xt, HIST)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(y_ptr + (first + j) * stride_yt + offs_c, acc.to(y_ptr.dtype.element_ty), mask=in_c)
        if j < num_drafts:
            draft = tl.load(drafts_ptr + i * num_drafts + j)
            if draft >= 0:
                dst = states_ptr + draft.to(tl.int64) * stride_sr
                for e in tl.static_range(HIST):
                    kept = _input_at(x_ptr, home, first, j - HIST + 1 + e, offs_c, in_c, has_old, stride_xt, HIST)
                    tl.store(dst + offs_c * HIST + e, kept.to(states_ptr.dtype.element_ty), mask=in_c)
    # The new state: the last W-1 inputs, all loaded before any store (a query shorter than W-1 keeps part of the
    # old state, read from this same row).
    if HIST == 3:
        s0 = _input_at(x_ptr, home, first, length - 3, offs_c, in_c, has_old, stride_xt, HIST)
        s1 = _input_at(x_ptr, home, first, length - 2, offs_c, in_c, has_old, stride_xt, HIST)
        s2 = _input_at(x_ptr, home, first, length - 1, offs_c, in_c, has_old, stride_xt, HIST)
        tl.store(home + offs_c * HIST, s0.to(states_ptr.dtype.element_ty), mask=in_c)
        tl.store(home + offs_c * HIST + 1, s1.to(states_ptr.dtype.element_ty), mask=in_c)
        tl.store(home + offs_c * HIST + 2, s2.to(states_ptr.dtype.element_ty), mask=in_c)
    elif HIST == 2:
        s0 = _input_at(x_ptr, home, first, length - 2, offs_c, in_c, has_old, stride_xt, HIST)
        s1 = _input_at(x_ptr, home, first, length - 1, offs_c, in_c, has_old, stride_xt, HIST)
        tl.store(home + offs_c * HIST, s0.to(states_ptr.dtype.element_ty), mask=in_c)
        tl.store(home + offs_c * HIST + 1, s1.to(states_ptr.dtype.element_ty), mask=in_c)
    elif HIST == 1:
        s0 = _input_at(x_ptr, home, first, length - 1, offs_c, in_c, has_old, stride_xt, HIST)
        tl.store(home + offs_c * HIST, s0.to(states_ptr.dtype.element_ty), mask=in_c)


def causal_conv_short(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_states: torch.Tensor,
                      state_rows: torch.Tensor, query_start_loc: torch.Tensor, has_state: torch.Tensor,
                      activation: str | None, draft_rows: torch.Tensor | None = None,
                      live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, C] in x's dtype; the arguments are causal_conv1d_varlen's (layers/causal_conv.py): x [T, C], weight
    [C, W] (W <= 4), conv_states [R, C, W-1] updated in place at state_rows [N] (from zeros where has_state is
    False), draft_rows [N, K] int64 (-1: none), live_lens [N] int32 (None: whole queries; else request i's state goes
    through its first live_lens[i] tokens, its later rows get zeros). Queries run token by token: for short ones."""
    channels, width = weight.shape
    if not 2 <= width <= 4:
        raise ValueError(f"conv width {width}: the one-launch kernel keeps 1 to 3 inputs of history")
    if x.stride(-1) != 1 or not weight.is_contiguous() or not conv_states.is_contiguous():
        raise ValueError("x must be contiguous in its last dim, weight and conv_states contiguous")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_reqs = state_rows.shape[0]
    if not num_reqs or not x.shape[0]:
        return y
    num_drafts = draft_rows.shape[1] if draft_rows is not None else 0
    drafts_arg = draft_rows.to(torch.int64).contiguous() if draft_rows is not None and num_drafts else state_rows
    grid = (num_reqs, triton.cdiv(channels, BLOCK_C))
    _causal_conv_short_kernel[grid](
        x, weight, bias if bias is not None else weight, y, conv_states, state_rows, has_state.view(torch.uint8),
        query_start_loc, drafts_arg, live_lens if live_lens is not None else state_rows, num_drafts, channels,
        x.stride(0), y.stride(0), conv_states.stride(0), W=width, HAS_BIAS=bias is not None,
        SILU=activation in ("silu", "swish"), BC=BLOCK_C, HAS_LIVE=live_lens is not None, num_warps=4)
    return y
