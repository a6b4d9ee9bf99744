"""The torch driver both recurrent token mixers share (layers/gated_delta_rule.py, layers/mamba2_ssm.py): a flat
batch of requests, each resuming a state kept in a pool row, some with long queries (prompt chunks) and some
with short ones (decodes, speculative verification).

- A query longer than RECURRENT_MAX_LEN runs the mixer's chunked form on its own.
- Short queries of equal length step together, one token a step, through the mixer's one-token step; a verify
  step keeps the state after each draft in the request's draft rows (-1: none, written to scratch row 0, which no
  request reads), and with live_lens (a verify step padded for a CUDA graph) a pad token leaves the state as it
  was and outputs zeros. When every request has the same short length the indices stay on the device: no host
  sync, so a CUDA graph can hold the step.
- Every request's final state goes back to its pool row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# The longest query stepped token by token (batched over requests of the same length); longer ones take the
# chunked form, whose fixed cost per chunk only pays off on longer runs. Also the longest padded query.
RECURRENT_MAX_LEN = 16

Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # (state, *one token's inputs) -> (output, new state)


def initial_states(ssm_states: torch.Tensor, state_rows: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
    """The requests' pool rows in float32, zeros for fresh requests (torch.where, not a multiply: a recycled row
    may hold NaN)."""
    old = ssm_states.index_select(0, state_rows.long()).float()
    return torch.where(has_state.view(-1, *[1] * (old.dim() - 1)), old,
                       torch.zeros((), dtype=old.dtype, device=old.device))


def run_varlen(states: torch.Tensor, inputs: Sequence[torch.Tensor], out: torch.Tensor, *, chunked: Step, step: Step,
               ssm_states: torch.Tensor, state_rows: torch.Tensor, query_start_loc: torch.Tensor,
               query_start_loc_cpu: torch.Tensor, draft_rows: torch.Tensor | None,
               live_lens: torch.Tensor | None) -> torch.Tensor:
    """Fill `out` ([T, H, D] float32, zeros) with every token's output and write the final states to the pool
    (module docstring). states: [N, ...] float32 (initial_states); inputs: per-token tensors [T, ...], each
    request's tokens contiguous (query_start_loc); chunked(state, *request's inputs) and step(state, *one token's
    inputs for a batch) the mixer's two forms. Returns `out`."""
    bounds = query_start_loc_cpu.tolist()
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > RECURRENT_MAX_LEN:
            if live_lens is not None:
                raise ValueError(f"live_lens: a query of {n} tokens; padded queries are at most {RECURRENT_MAX_LEN}")
            span = slice(bounds[i], bounds[i + 1])
            out[span], states[i] = chunked(states[i], *(x[span] for x in inputs))
        elif n > 0:
            by_length.setdefault(n, []).append(i)
    device = out.device
    for n, reqs in by_length.items():
        if len(reqs) == len(lengths):  # every request (a uniform verify step): device indices, CUDA-graph safe
            req_idx = torch.arange(len(reqs), device=device)
            first = query_start_loc[:-1].long()
        else:
            req_idx = torch.tensor(reqs, device=device)
            first = torch.tensor([bounds[i] for i in reqs], device=device)
        state = states.index_select(0, req_idx)
        drafts = draft_rows.index_select(0, req_idx) if draft_rows is not None else None
        live = live_lens.index_select(0, req_idx) if live_lens is not None else None
        for t in range(n):
            tok = first + t
            o, stepped = step(state, *(x.index_select(0, tok) for x in inputs))
            if live is None:
                state = stepped
            else:  # (a pad row: a zero output, the state as it was)
                keep = (live > t).view(-1, *[1] * (state.dim() - 1))
                state = torch.where(keep, stepped, state)
                o = torch.where(keep.view(-1, *[1] * (o.dim() - 1)), o, 0.0)
            out.index_copy_(0, tok, o)
            if drafts is not None and t < drafts.shape[1]:
                row = drafts[:, t] if live is None else torch.where(live > t, drafts[:, t], -1)
                ssm_states.index_copy_(0, row.clamp(min=0), state.to(ssm_states.dtype))
        states.index_copy_(0, req_idx, state)
    ssm_states.index_copy_(0, state_rows.long(), states.to(ssm_states.dtype))
    return out
