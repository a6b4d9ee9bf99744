"""The gated delta rule, the token mixer of Gated DeltaNet layers (Qwen3-Next, Qwen3.5), over a flat
batch of requests whose recurrent states live in a pool.

Per value head, the state S is a [Dk, Dv] matrix. At each token, with q and k L2-normalised (q also
scaled by Dk**-0.5), decay a = exp(g) and write strength beta:

    S <- a * S
    S <- S + k (beta * (v - S^T k))^T      (the delta rule: write only what S does not already predict)
    o  = S^T q

Each q/k head serves Hv/Hk consecutive value heads (grouped value attention). A request starts from its
pool row (or from zeros when it starts fresh) and its final state goes back to that row.

Paths:
- CUDA with flash-linear-attention (`fla`, imported lazily so CPU installs never need it; chosen by the op set,
  layers/ops.py): its chunked kernel over the whole varlen batch for mixed steps,
  and ferrox's own one-launch recurrence (kernels/gated_delta_recurrent.py) for decode and speculative verify steps
  (short queries, keeping the state after each draft), in place in the pool: fla's fused recurrent kernel needs the
  rows gathered into a float32 batch and scattered back, 5.7x the time of a batch-1 decode layer on an H100.
- torch (CPU, and the reference): the chunked WY form for prompts (Yang et al., "Gated Delta Networks",
  the UT transform solves each chunk's delta updates with one triangular solve), the plain recurrence
  for short queries, grouped by length so requests of equal length step together.
decode_only (one token per request), and a verify step whose queries all have one length, are CUDA-graph safe on
both paths: index_select / torch.where / index_copy_ on fixed shapes, no host sync. All math in float32; the pool
may be float32 or the model dtype.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

from ferrox.layers.causal_conv import longest_query
from ferrox.layers.recurrent_varlen import RECURRENT_MAX_LEN, initial_states, run_varlen

logger = logging.getLogger(__name__)

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim in float32 (the eps of fla's and transformers' kernels)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised float32 q (times Dk**-0.5) and k, their heads repeated to one per value head."""
    group = num_v_heads // q.shape[1]
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    if group > 1:
        q = q.repeat_interleave(group, dim=1)
        k = k.repeat_interleave(group, dim=1)
    return q, k


def recurrent_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch: state [B, H, Dk, Dv], q/k [B, H, Dk] (prepared), v [B, H, Dv], g/beta [B, H],
    all float32. Returns (o [B, H, Dv], new state)."""
    state = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhkv,bhk->bhv", state, k)
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", state, q), state


def chunked_delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in chunks: state [H, Dk, Dv], q/k [L, H, Dk] (prepared), v [L, H, Dv], g/beta [L, H],
    float32. Returns (o [L, H, Dv], final state).

    Inside a chunk, with G_i the cumulative log decay up to position i and delta_i the correction token i
    writes, S_i = e^{G_i} S0 + sum_{j<=i} e^{G_i - G_j} k_j delta_j^T. So delta = (I + A)^{-1} (beta v) -
    (I + A)^{-1} (beta e^G k) S0 with A[i, j] = beta_i e^{G_i - G_j} k_i.k_j strictly below the diagonal
    (the UT transform): two triangular solves per chunk, then one matmul against the carried state."""
    length = q.shape[0]
    pad = -length % chunk_size
    # Zero padding is inert: beta = 0 writes nothing and g = 0 decays nothing, so the final state is exact.
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, L', D]
    g, beta = (F.pad(t.transpose(0, 1), (0, pad)) for t in (g, beta))  # [H, L']
    heads = q.shape[0]
    q, k, v = (t.reshape(heads, -1, chunk_size, t.shape[-1]) for t in (q, k, v))  # [H, n, C, D]
    g, beta = (t.reshape(heads, -1, chunk_size) for t in (g, beta))
    cum = g.cumsum(dim=-1)  # [H, n, C]
    # Decay between positions j <= i of a chunk; above the diagonal the exponent would be positive (and
    # may overflow), so it is masked before the exp.
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # [H, n, C, C]
    k_beta = k * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is ignored: unitriangular solve
    u = torch.linalg.solve_triangular(system, v * beta.unsqueeze(-1), upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # intra-chunk scores, diagonal included
    q_decayed = q * cum.exp().unsqueeze(-1)  # reads of the chunk's starting state
    k_to_end = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # writes, decayed to the chunk's end
    chunk_decay = cum[..., -1].exp()  # [H, n]
    out = torch.empty_like(v)
    for c in range(q.shape[1]):
        delta = u[:, c] - w[:, c] @ state
        out[:, c] = q_decayed[:, c] @ state + attn[:, c] @ delta
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ delta
    return out.reshape(heads, -1, v.shape[-1])[:, :length].transpose(0, 1), state


def gated_delta_rule_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           ssm_states: torch.Tensor, state_rows: torch.Tensor, query_start_loc: torch.Tensor,
                           query_start_loc_cpu: torch.Tensor, has_state: torch.Tensor, *,
                           decode_only: bool = False, draft_rows: torch.Tensor | None = None,
                           live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The torch path of gated_delta_rule_varlen (same arguments), on any device."""
    if live_lens is not None and decode_only:
        raise ValueError("live_lens: a decode step has no padded queries")
    qn, kn = _prepare_qk(q, k, v.shape[1])
    vf, gf, bf = v.float(), g.float(), beta.float()
    states = initial_states(ssm_states, state_rows, has_state)
    rows = state_rows.long()
    if decode_only:
        out, states = recurrent_step(states, qn, kn, vf, gf, bf)
        ssm_states.index_copy_(0, rows, states.to(ssm_states.dtype))
        return out.to(v.dtype)

    out = run_varlen(states, (qn, kn, vf, gf, bf), torch.zeros_like(vf), chunked=chunked_delta_rule,
                     step=recurrent_step, ssm_states=ssm_states, state_rows=state_rows, query_start_loc=query_start_loc,
                     query_start_loc_cpu=query_start_loc_cpu, draft_rows=draft_rows, live_lens=live_lens)
    return out.to(v.dtype)


@functools.cache
def _fla_chunk_op() -> Any | None:
    """fla's chunked gated-delta-rule op, or None where fla is missing or fails to import (a Triton it does not
    support): the torch path then runs instead."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # any import failure (not only ImportError) means "no fla", never a crash
        logger.warning("flash-linear-attention unavailable (%s): gated delta rule runs in torch", e)
        return None
    return chunk_gated_delta_rule


def _gated_delta_rule_fla(chunk_op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, ssm_states: torch.Tensor, state_rows: torch.Tensor,
                          query_start_loc: torch.Tensor, query_start_loc_cpu: torch.Tensor,
                          has_state: torch.Tensor) -> torch.Tensor:
    rows = state_rows.long()
    # fla reads the state in any dtype (as float32), handles Hv > Hk itself (value head h uses q/k head
    # h // (Hv/Hk), transformers' repeat_interleave), and returns the final state in float32.
    initial = initial_states(ssm_states, state_rows, has_state)
    # Fresh int64 copies each call: fla memoises the chunk layout it derives from cu_seqlens by tensor
    # identity, so a persistent buffer updated in place between steps would replay a stale layout.
    cu_seqlens = query_start_loc.to(torch.int64, copy=True)
    cu_seqlens_cpu = query_start_loc_cpu.to(torch.int64, copy=True)
    o, final = chunk_op(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g=g.unsqueeze(0), beta=beta.unsqueeze(0),
                        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True,
                        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    o = o.squeeze(0)
    ssm_states.index_copy_(0, rows, final.to(ssm_states.dtype))
    return o.to(v.dtype)


def gated_delta_rule_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            ssm_states: torch.Tensor, state_rows: torch.Tensor, query_start_loc: torch.Tensor,
                            query_start_loc_cpu: torch.Tensor, has_state: torch.Tensor, *,
                            decode_only: bool = False, cuda_kernels: bool = False,
                            draft_rows: torch.Tensor | None = None, max_query_len: int | None = None,
                            live_lens: torch.Tensor | None = None) -> torch.Tensor:
    """o [T, Hv, Dv] in v's dtype for q/k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv] (log decay, <= 0) and beta
    [T, Hv], requests one after another (request i owns tokens query_start_loc[i]:query_start_loc[i+1]).
    Request i starts from ssm_states[state_rows[i]] ([R, Hv, Dk, Dv] pool) if has_state[i], else from
    zeros, and its final state is written back there in the pool's dtype.

    decode_only: one token per request (T == N); CUDA-graph safe; padding requests may repeat a row
    (its result is then undefined). cuda_kernels: flash-linear-attention's kernels and ferrox's verify recurrence
    (CUDA tensors: the Triton op set asks for them, layers/ops.py); the torch path where fla does not import.

    draft_rows: [N, K] int64 pool rows, -1 for none (speculative decoding, worker/recurrent_states.py): the state
    after request i's token t (t < K) also goes to row draft_rows[i, t]. K < RECURRENT_MAX_LEN, so a verify query
    (1 + its drafts) runs the recurrence, which passes through every state: with cuda_kernels the one-launch kernel
    when no query of the step is longer (a prefill chunk beside the verify queries: the torch path).

    max_query_len: the step's longest query (AttentionMetadata.max_query_len, which the layer passes); read from
    query_start_loc_cpu when None.

    live_lens: [N] int32 (AttentionMetadata.live_query_lens: a CUDA graph's verify step padded per request), or None:
    request i's state goes through its first live_lens[i] tokens only; its later rows are padding, with zero outputs
    and no draft states. Short queries only (the recurrence)."""
    if q.shape != k.shape or q.dim() != 3 or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} must be [T, Hk, Dk] and v {tuple(v.shape)} "
                         "[T, Hv, Dv]")
    if v.shape[1] % q.shape[1]:
        raise ValueError(f"{v.shape[1]} value heads do not split over {q.shape[1]} key heads")
    if ssm_states.shape[1:] != (v.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"ssm_states {tuple(ssm_states.shape)} must be [rows, {v.shape[1]}, {q.shape[2]}, "
                         f"{v.shape[2]}]")
    # (fla's kernels are run and tested here at the releases' head dims, 128; heads under 16 dims -- tiny test
    # models -- take the torch path rather than tile shapes fla's kernels were not checked at)
    if draft_rows is not None:
        if draft_rows.shape[1] >= RECURRENT_MAX_LEN:
            raise ValueError(f"draft_rows: {draft_rows.shape[1]} drafts per request; a verify query of 1 + that many "
                             f"tokens must be at most {RECURRENT_MAX_LEN} (the recurrence)")
    # (host data: the step's query lengths; under a CUDA graph those of the captured step)
    if cuda_kernels and (decode_only or longest_query(query_start_loc_cpu, max_query_len) <= RECURRENT_MAX_LEN):
        from ferrox.kernels.gated_delta_recurrent import gated_delta_recurrent

        return gated_delta_recurrent(q, k, v, g.float(), beta.float(), ssm_states, state_rows, query_start_loc,
                                     has_state, draft_rows, live_lens)
    if cuda_kernels and draft_rows is None and live_lens is None and min(q.shape[2], v.shape[2]) >= 16:
        chunk_op = _fla_chunk_op()
        if chunk_op is not None:
            return _gated_delta_rule_fla(chunk_op, q, k, v, g, beta, ssm_states, state_rows, query_start_loc,
                                         query_start_loc_cpu, has_state)
    return gated_delta_rule_torch(q, k, v, g, beta, ssm_states, state_rows, query_start_loc, query_start_loc_cpu,
                                  has_state, decode_only=decode_only, draft_rows=draft_rows, live_lens=live_lens)
