"""The short causal depthwise convolution of linear-attention layers (Gated DeltaNet in Qwen3-Next and
Qwen3.5, Mamba-style blocks), for a flat batch of requests whose conv states live in a pool.

Each channel c of a request sees y_t = act(bias_c + sum_w weight[c, w] * x[t - (W-1) + w, c]), where the
W-1 inputs before the request's first token of this step come from its conv state (its last W-1 inputs
so far; zeros for a request that starts fresh). After the step, the state holds the last W-1 inputs of
[old state, tokens], so a query shorter than W-1 shifts only part of the old state out. This is
transformers' causal_conv1d_fn (padding W-1) for a fresh prompt and causal_conv1d_update for a request
that goes on.

Precision: the sum runs in float32 and the output is rounded once to x's dtype (transformers runs the
conv in the weight's dtype; float32 is at least as close to the float32 reference and is what vLLM's
causal-conv kernels accumulate in). The kernel is written as W shifted multiply-adds rather than
F.conv1d so no backend can trade float32 for TF32. The state keeps the raw inputs in the pool's dtype.

On CUDA (cuda_kernels, the Triton op set) decode and verify steps -- every query at most RECURRENT_MAX_LEN tokens --
run the one-launch kernel (kernels/causal_conv_short.py) instead: the torch path is some forty launches a layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")
# Queries up to this length take the one-launch kernel on CUDA (decode and verify steps: the same bound as the
# delta rule's recurrence, layers/gated_delta_rule.py RECURRENT_MAX_LEN).
_SHORT = 16


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"activation {activation!r}: expected one of {ACTIVATIONS}")


def _gather_states(conv_states: torch.Tensor, state_rows: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """[N, C, W-1] float32: each request's state row, zeros for a fresh request (torch.where rather than a
    multiply, so a recycled row's NaN or inf never leaks in)."""
    old = conv_states.index_select(0, state_rows.long()).float()
    return torch.where(has_state.view(-1, 1, 1), old, torch.zeros((), dtype=old.dtype, device=old.device))


def longest_query(query_start_loc_cpu: torch.Tensor, max_query_len: int | None) -> int:
    """The step's longest query: the metadata's max_query_len when the caller has it (the layers pass it: no host
    work per layer), else read from query_start_loc_cpu."""
    if max_query_len is not None:
        return max_query_len
    return int((query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).max()) if query_start_loc_cpu.numel() > 1 else 0


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_rows: torch.Tensor, query_start_loc: torch.Tensor,
                         query_start_loc_cpu: torch.Tensor, has_state: torch.Tensor,
                         activation: str | None = "silu", decode_only: bool = False,
                         draft_rows: torch.Tensor | None = None, *, cuda_kernels: bool = False,
                         max_query_len: int | None = None, live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, C] in x's dtype for x [T, C] (requests one after another, request i owning
    x[query_start_loc[i]:query_start_loc[i+1]]), weight [C, W], bias [C] or None; conv_states [R, C, W-1]
    is updated in place at state_rows [N]; has_state [N] bool (False: ignore the row's old content).

    decode_only: one token per request (T == N), CUDA-graph safe (device ops only, fixed shapes; padding
    requests may repeat a row, whose result is then undefined). query_start_loc_cpu only chooses the path
    (cuda_kernels: short queries take the kernel; max_query_len, when given, instead); the torch paths build their
    indices on the device.

    draft_rows: [N, K] int64 pool rows, -1 for none (speculative decoding, worker/recurrent_states.py): the state
    after request i's token t (t < K, inside its query) also goes to row draft_rows[i, t], so the state after
    however many drafts are accepted can be kept. Not with decode_only.

    live_lens: [N] int32 (AttentionMetadata.live_query_lens: a CUDA graph's verify step padded per request), or None:
    request i's state goes through its first live_lens[i] tokens only; its later rows are padding, with zero outputs
    and no draft states. Not with decode_only."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} must be [T, C] and weight {tuple(weight.shape)} [C, W]")
    channels, width = weight.shape
    if conv_states.dim() != 3 or conv_states.shape[1:] != (channels, width - 1):
        raise ValueError(f"conv_states {tuple(conv_states.shape)} must be [rows, {channels}, {width - 1}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {ACTIVATIONS}")
    if cuda_kernels and 2 <= width <= 4 and (decode_only or longest_query(query_start_loc_cpu, max_query_len) <= _SHORT):
        from ferrox.kernels.causal_conv_short import causal_conv_short

        return causal_conv_short(x, weight, bias, conv_states, state_rows, query_start_loc, has_state, activation,
                                 draft_rows, live_lens)
    if live_lens is not None and decode_only:
        raise ValueError("live_lens: a decode step has no padded queries")
    w = weight.float()
    b = bias.float() if bias is not None else None
    states = _gather_states(conv_states, state_rows, has_state)  # [N, C, W-1]
    if decode_only:
        window = torch.cat([states, x.float().unsqueeze(-1)], dim=-1)  # [N, C, W]
        y = (window * w).sum(dim=-1)
        if b is not None:
            y = y + b
        conv_states.index_copy_(0, state_rows.long(), window[:, :, 1:].to(conv_states.dtype))
        return _activate(y, activation).to(x.dtype)

    # The general step, still without a host loop: lay the requests out as one extended sequence where
    # each request's W-1 state inputs come just before its tokens, [state_0, tokens_0, state_1, ...].
    # Every token's window is then the W positions ending at it, and every new state the last W-1
    # positions of its request's segment.
    num_tokens = x.shape[0]
    num_reqs = states.shape[0]
    hist = width - 1
    device = x.device
    starts = query_start_loc[:-1].long()
    ends = query_start_loc[1:].long()
    req_ids = torch.arange(num_reqs, device=device)
    token_ids = torch.arange(num_tokens, device=device)
    # searchsorted on the ends: the request owning each token (right=True skips empty requests).
    token_req = torch.searchsorted(ends, token_ids, right=True)
    token_pos = token_ids + (token_req + 1) * hist
    offsets = torch.arange(hist, device=device)
    state_pos = (starts + req_ids * hist).unsqueeze(1) + offsets  # [N, W-1]
    ext = torch.empty(num_tokens + num_reqs * hist, channels, dtype=torch.float32, device=device)
    ext.index_copy_(0, token_pos, x.float())
    ext.index_copy_(0, state_pos.reshape(-1), states.transpose(1, 2).reshape(-1, channels))

    y = b.expand(num_tokens, channels).clone() if b is not None else x.new_zeros(num_tokens, channels,
                                                                                    dtype=torch.float32)
    for tap in range(width):
        y += ext.index_select(0, token_pos - hist + tap) * w[:, tap]

    # The segment of request i ends at ends[i] + (i+1)*(W-1); its last W-1 positions are the new state (a padded
    # query's segment, for the state, ends after its live tokens).
    live_ends = ends if live_lens is None else torch.minimum(ends, starts + live_lens.long())
    new_pos = (live_ends + req_ids * hist).unsqueeze(1) + offsets  # [N, W-1]
    new_states = ext.index_select(0, new_pos.reshape(-1)).view(num_reqs, hist, channels).transpose(1, 2)
    conv_states.index_copy_(0, state_rows.long(), new_states.to(conv_states.dtype))
    if draft_rows is not None:
        # Every (request, t) pair, on the device (no host sync): a pair without a draft row (-1) writes scratch
        # row 0, which no request reads, from a token index kept in range.
        k = draft_rows.shape[1]
        req = req_ids.repeat_interleave(k)
        tok = (starts.index_select(0, req) + torch.arange(k, device=device).repeat(num_reqs)).clamp(max=num_tokens - 1)
        # The state after token j: the W-1 positions of the extended sequence ending at it.
        pos = (token_pos.index_select(0, tok) - hist + 1).unsqueeze(1) + offsets  # [N * K, W-1]
        after = ext.index_select(0, pos.reshape(-1)).view(-1, hist, channels).transpose(1, 2)
        rows = draft_rows.reshape(-1)
        if live_lens is not None:  # (a pad token's "draft" goes to scratch row 0 too)
            rows = torch.where(tok < live_ends.index_select(0, req), rows, -1)
        conv_states.index_copy_(0, rows.clamp(min=0), after.to(conv_states.dtype))
    y = _activate(y, activation)
    if live_lens is not None:
        y = torch.where((token_ids < live_ends.index_select(0, token_req.clamp(max=num_reqs - 1))).unsqueeze(1), y, 0.0)
    return y.to(x.dtype)
