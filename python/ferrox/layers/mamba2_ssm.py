"""Mamba2's selective state-space scan (SSD), the token mixer of Mamba2 layers (IBM Granite 4.0-H, Nemotron-H),
over a flat batch of requests whose states live in a pool.

Per head h (with its group's B and C: each of the n_groups groups serves num_heads / n_groups consecutive heads),
at each token, with dt > 0 (softplus(dt + dt_bias), clamped: layers/mamba2_mixer.py) and A_h = -exp(A_log_h) < 0:

    S <- exp(dt A_h) S + B (dt x)^T        S [d_state, head_dim]
    y  = S^T C + D_h x

This is a gated linear attention with a scalar decay per head: q = C, k = B, v = dt x, log decay g = dt A. The
state is kept as [heads, d_state, head_dim] (flash-linear-attention's [K, V] layout, the transpose of transformers'
[head_dim, d_state]), so fla's chunked kernel and the one-launch recurrence read and write the pool in place.

A request starts from its pool row (or from zeros when it starts fresh: has_state False) and its final state goes
back there in the pool's dtype.

Paths:
- CUDA (cuda_kernels, chosen by the op set: layers/mamba2_mixer.py): decode and short queries (speculative verify)
  run the one-launch recurrence (kernels/mamba2_recurrent.py), in place in the pool, keeping draft states; longer
  ones flash-linear-attention's chunk_simple_gla over the whole varlen batch (q = C, k = B, v = dt x, g = dt A,
  scale 1), the torch path where fla does not import.
- torch (CPU, and the reference): the chunked form for prompts (SSD: within a chunk of CHUNK_SIZE tokens the
  outputs are a masked, decayed C B^T "attention" over dt x plus the decayed read of the chunk's starting state;
  the state then steps once a chunk), the plain recurrence for short queries, grouped by length so requests of
  equal length step together. decode_only (one token per request) and a verify step whose queries all have one
  length are CUDA-graph safe: index_select / torch.where / index_copy_ on fixed shapes, no host sync.
All math in float32; the pool may be float32 or the model dtype.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F

from ferrox.layers.causal_conv import longest_query
from ferrox.layers.recurrent_varlen import RECURRENT_MAX_LEN, initial_states, run_varlen

logger = logging.getLogger(__name__)

CHUNK_SIZE = 64


def expand_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[T, G, N] -> [T, H, N]: group g's rows for its H / G consecutive heads (transformers' repeat_interleave)."""
    group = num_heads // t.shape[1]
    return t.repeat_interleave(group, dim=1) if group > 1 else t


def ssm_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch, float32: state [b, H, N, P], x [b, H, P], dt [b, H], A [H], B / C [b, H, N] (one
    row a head). Returns (S^T C [b, H, P] -- without the D skip --, new state)."""
    state = state * torch.exp(dt * A)[..., None, None] + (B * dt.unsqueeze(-1)).unsqueeze(-1) * x.unsqueeze(-2)
    return torch.einsum("bhnp,bhn->bhp", state, C), state


def chunked_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 C: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks, float32: state [H, N, P], x [L, H, P], dt [L, H], A [H], B / C [L, H, N].
    Returns (S^T C [L, H, P] without the D skip, final state).

    With G_i the cumulative log decay (dt A) inside a chunk up to position i: y_i = sum_{j<=i} e^{G_i - G_j}
    (C_i . B_j) dt_j x_j + e^{G_i} S0^T C_i, and the chunk's end state e^{G_end} S0 + sum_j e^{G_end - G_j}
    B_j (dt_j x_j)^T."""
    length = x.shape[0]
    pad = -length % chunk_size
    # Zero padding is inert: dt = 0 decays nothing (log decay 0) and writes nothing, so the final state is exact.
    v = F.pad((x * dt.unsqueeze(-1)).transpose(0, 1), (0, 0, 0, pad))  # [H, L', P]
    b, c = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (B, C))  # [H, L', N]
    g = F.pad((dt * A).transpose(0, 1), (0, pad))  # [H, L']
    heads = v.shape[0]
    v, b, c = (t.reshape(heads, -1, chunk_size, t.shape[-1]) for t in (v, b, c))  # [H, n, C, D]
    cum = g.reshape(heads, -1, chunk_size).cumsum(dim=-1)  # [H, n, C]
    # Decay between positions j <= i of a chunk; above the diagonal the exponent would be positive (and may
    # overflow), so it is masked before the exp.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    y_diag = ((c @ b.transpose(-1, -2)) * decay) @ v  # [H, n, C, P]
    c_decayed = c * cum.exp().unsqueeze(-1)  # reads of the chunk's starting state
    writes = (b * (cum[..., -1:] - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ v  # [H, n, N, P]
    chunk_decay = cum[..., -1].exp()  # [H, n]
    out = torch.empty_like(v)
    for i in range(v.shape[1]):
        out[:, i] = y_diag[:, i] + c_decayed[:, i] @ state
        state = state * chunk_decay[:, i, None, None] + writes[:, i]
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1), state


def mamba2_ssm_torch(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     D: torch.Tensor, ssm_states: torch.Tensor, state_rows: torch.Tensor,
                     query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, has_state: torch.Tensor, *,
                     decode_only: bool = False, draft_rows: torch.Tensor | None = None,
                     live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of mamba2_ssm_varlen (same arguments), on any device."""
    if live_lens is not None and decode_only:
        raise ValueError("live_lens: a decode step has no padded queries")
    heads = x.shape[1]
    xf, dtf, af = x.float(), dt.float(), A.float()
    bf, cf = expand_groups(B.float(), heads), expand_groups(C.float(), heads)
    skip = D.float().unsqueeze(-1) * xf
    states = initial_states(ssm_states, state_rows, has_state)
    rows = state_rows.long()
    if decode_only:
        out, states = ssm_step(states, xf, dtf, af, bf, cf)
        ssm_states.index_copy_(0, rows, states.to(ssm_states.dtype))
        return (out + skip).to(x.dtype)

    # (A is the heads' constant, not a per-token input)
    out = run_varlen(states, (xf, dtf, bf, cf), torch.zeros_like(xf),
                     chunked=lambda s, x_, dt_, b_, c_: chunked_scan(s, x_, dt_, af, b_, c_),
                     step=lambda s, x_, dt_, b_, c_: ssm_step(s, x_, dt_, af, b_, c_), ssm_states=ssm_states,
                     state_rows=state_rows, query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc_cpu,
                     draft_rows=draft_rows, live_lens=live_lens)
    y = out + skip
    if live_lens is not None:  # (pad rows: zeros, the D skip included)
        y = torch.where(_live_token_mask(query_start_loc, live_lens, x.shape[0]).view(-1, 1, 1), y, 0.0)
    return y.to(x.dtype)


def _live_token_mask(query_start_loc: torch.Tensor, live_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] bool: whether each token is among its request's first live_lens tokens (device ops only)."""
    starts = query_start_loc[:-1].long()
    ends = query_start_loc[1:].long()
    tokens = torch.arange(num_tokens, device=query_start_loc.device)
    owner = torch.searchsorted(ends, tokens, right=True).clamp(max=starts.shape[0] - 1)
    return tokens < starts.index_select(0, owner) + live_lens.long().index_select(0, owner)


@functools.cache
def _fla_chunk_op() -> tuple[Any, bool] | None:
    """(fla's chunk_simple_gla, whether it takes cu_seqlens_cpu), or None where fla is missing or fails to import:
    the torch path then runs instead."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # any import failure (not only ImportError) means "no fla", never a crash
        logger.warning("flash-linear-attention unavailable (%s): the Mamba2 scan's prefill runs in torch", e)
        return None
    try:
        takes_cpu = "cu_seqlens_cpu" in inspect.signature(chunk_simple_gla).parameters
    except (TypeError, ValueError):
        takes_cpu = False
    return chunk_simple_gla, takes_cpu


def _mamba2_ssm_fla(op: tuple[Any, bool], x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                    C: torch.Tensor, D: torch.Tensor, ssm_states: torch.Tensor, state_rows: torch.Tensor,
                    query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                    has_state: torch.Tensor) -> torch.Tensor:
    chunk_op, takes_cpu = op
    heads = x.shape[1]
    dtf = dt.float()
    # q, k, v in one dtype (the model's: dt x rounded once into it), the log decay in float32.
    v = (x.float() * dtf.unsqueeze(-1)).to(x.dtype)
    q, k = expand_groups(C.to(x.dtype), heads).contiguous(), expand_groups(B.to(x.dtype), heads).contiguous()
    initial = initial_states(ssm_states, state_rows, has_state)
    # Fresh int64 copies each call: fla memoises the chunk layout it derives from cu_seqlens by tensor identity.
    kwargs: dict[str, Any] = {"cu_seqlens": query_start_loc.to(torch.int64, copy=True)}
    if takes_cpu:
        kwargs["cu_seqlens_cpu"] = query_start_loc_cpu.to(torch.int64, copy=True)
    o, final = chunk_op(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=(dtf * A.float()).unsqueeze(0), scale=1.0,
                        initial_state=initial, output_final_state=True, **kwargs)
    ssm_states.index_copy_(0, state_rows.long(), final.to(ssm_states.dtype))
    return (o.squeeze(0).float() + D.float().unsqueeze(-1) * x.float()).to(x.dtype)


def mamba2_ssm_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, ssm_states: torch.Tensor, state_rows: torch.Tensor,
                      query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor, has_state: torch.Tensor, *,
                      decode_only: bool = False, cuda_kernels: bool = False, draft_rows: torch.Tensor | None = None,
                      max_query_len: int | None = None, live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H, P] in x's dtype for x [T, H, P], dt [T, H] (the step, after softplus and its clamp), A [H] (< 0),
    B / C [T, G, N] (G groups), D [H]; requests one after another (request i owns tokens
    query_start_loc[i]:query_start_loc[i+1]). Request i starts from ssm_states[state_rows[i]] ([R, H, N, P] pool)
    if has_state[i], else from zeros, and its final state is written back there.

    decode_only: one token per request (T == N); CUDA-graph safe; padding requests may repeat a row (its result is
    then undefined). cuda_kernels: the one-launch recurrence for short queries and fla's chunked kernel for longer
    ones (on CUDA tensors: the interpreter's CPU tensors take the torch path for those); the torch path where fla
    does not import.

    draft_rows: [N, K] int64 pool rows, -1 for none (speculative decoding, worker/recurrent_states.py): the state
    after request i's token t (t < K) also goes to row draft_rows[i, t]. max_query_len: the step's longest query
    (read from query_start_loc_cpu when None). live_lens: [N] int32 (a CUDA graph's verify step padded per request),
    or None: request i's state goes through its first live_lens[i] tokens only; its later rows are padding, with
    zero outputs and no draft states. Short queries only."""
    if x.dim() != 3 or dt.shape != x.shape[:2] or B.shape != C.shape or B.dim() != 3 or B.shape[0] != x.shape[0]:
        raise ValueError(f"x {tuple(x.shape)} must be [T, H, P], dt {tuple(dt.shape)} [T, H] and B {tuple(B.shape)}, "
                         f"C {tuple(C.shape)} [T, G, N]")
    if x.shape[1] % B.shape[1]:
        raise ValueError(f"{x.shape[1]} heads do not split over {B.shape[1]} groups")
    if ssm_states.shape[1:] != (x.shape[1], B.shape[2], x.shape[2]):
        raise ValueError(f"ssm_states {tuple(ssm_states.shape)} must be [rows, {x.shape[1]}, {B.shape[2]}, "
                         f"{x.shape[2]}]")
    if draft_rows is not None and draft_rows.shape[1] >= RECURRENT_MAX_LEN:
        raise ValueError(f"draft_rows: {draft_rows.shape[1]} drafts per request; a verify query of 1 + that many "
                         f"tokens must be at most {RECURRENT_MAX_LEN} (the recurrence)")
    # (host data: the step's query lengths; under a CUDA graph those of the captured step)
    if cuda_kernels and (decode_only or longest_query(query_start_loc_cpu, max_query_len) <= RECURRENT_MAX_LEN):
        from ferrox.kernels.mamba2_recurrent import mamba2_recurrent

        return mamba2_recurrent(x, dt.float(), A.float(), B, C, D.float(), ssm_states, state_rows, query_start_loc,
                                has_state, draft_rows, live_lens)
    from ferrox.kernels.mamba2_recurrent import fla_takes

    if cuda_kernels and draft_rows is None and live_lens is None and min(x.shape[2], B.shape[2]) >= 16 and fla_takes(x):
        op = _fla_chunk_op()
        if op is not None:
            return _mamba2_ssm_fla(op, x, dt, A, B, C, D, ssm_states, state_rows, query_start_loc,
                                   query_start_loc_cpu, has_state)
    return mamba2_ssm_torch(x, dt, A, B, C, D, ssm_states, state_rows, query_start_loc, query_start_loc_cpu,
                            has_state, decode_only=decode_only, draft_rows=draft_rows, live_lens=live_lens)
