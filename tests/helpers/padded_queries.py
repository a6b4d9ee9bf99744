"""Verify steps padded per request, as a CUDA graph stages them (worker/cuda_graphs.py), for the recurrent kernels'
live-length tests (tests/kernels/test_gated_delta_recurrent.py, test_causal_conv_short.py)."""

from __future__ import annotations

import torch

# Rows the tests' pools hold: request rows 1-7, draft rows 8-15. Request 1 (one token) names draft row 15 for a pad
# token, which must stay untouched; request 3 (two tokens) names row 14 for its second.
LENGTHS = [3, 1, 4, 2]
STATE_ROWS = torch.tensor([3, 1, 6, 2], dtype=torch.int32)
HAS_STATE = torch.tensor([True, True, False, True])
DRAFT_ROWS = torch.tensor([[8, 9, -1], [-1, 15, -1], [10, 11, 12], [13, 14, -1]])
WRITTEN = [1, 2, 3, 6, 8, 9, 10, 11, 12, 13, 14]


def pad_queries(t: torch.Tensor, lengths: list[int], width: int) -> torch.Tensor:
    """t's queries each padded to `width` rows with noise (a CUDA graph's pad rows hold whatever was there)."""
    parts, start = [], 0
    for n in lengths:
        noise = torch.randn((width - n, *t.shape[1:])).to(t.device, t.dtype) * 5
        parts += [t[start:start + n], noise]
        start += n
    return torch.cat(parts)


def assert_stops_at_live_tokens(out: torch.Tensor, ref: torch.Tensor, pool: torch.Tensor, ref_pool: torch.Tensor,
                                width: int, **tol: float) -> None:
    """The padded step's real rows and written pool rows are the unpadded step's; pad rows are zeros; the pad token's
    draft row is untouched (NaN)."""
    real = torch.cat([torch.arange(n) + i * width for i, n in enumerate(LENGTHS)])
    pad = torch.tensor(sorted(set(range(len(LENGTHS) * width)) - set(real.tolist())))
    torch.testing.assert_close(out[real], ref, **tol)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    torch.testing.assert_close(pool[WRITTEN], ref_pool[WRITTEN], **tol)
    assert pool[15].isnan().all()
