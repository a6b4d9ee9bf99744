"""The one-launch verify recurrence (kernels/gated_delta_recurrent.py) against the torch path of
layers/gated_delta_rule.py (itself checked against transformers' recurrence in tests/layers): outputs, final states
and the state after each draft, for verify queries of different lengths beside a decode, a fresh request whose row
holds NaN, grouped value heads, head dims that are not powers of two, q / k as strided views of one projection (as
the layer passes them), bfloat16 inputs and pools; rows nobody names stay untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ferrox.kernels.gated_delta_recurrent import gated_delta_recurrent
from ferrox.layers.gated_delta_rule import gated_delta_rule_torch

from tests.helpers.padded_queries import (
    DRAFT_ROWS,
    HAS_STATE,
    LENGTHS,
    STATE_ROWS,
    assert_stops_at_live_tokens,
    pad_queries,
)

HK, HV = 2, 4
ROWS = 16  # request rows 1-7, draft rows 8-15


def _inputs(lengths: list[int], dk: int, dv: int, dtype: torch.dtype, device: torch.device):
    tokens = sum(lengths)
    # q, k, v as the layer has them: column blocks of one [T, 2 Hk Dk + Hv Dv] tensor (strided rows).
    mixed = torch.randn(tokens, 2 * HK * dk + HV * dv)
    q, k, v = mixed.to(device, dtype).split([HK * dk, HK * dk, HV * dv], dim=-1)
    g = F.logsigmoid(torch.randn(tokens, HV) * 2 + 2).to(device)  # decays spread over (0, 1)
    beta = torch.sigmoid(torch.randn(tokens, HV)).to(device)
    return q.reshape(tokens, HK, dk), k.reshape(tokens, HK, dk), v.reshape(tokens, HV, dv), g, beta


@pytest.mark.parametrize(("dk", "dv", "dtype"), [(16, 8, torch.float32), (24, 40, torch.float32),
                                                 (32, 32, torch.bfloat16), (128, 128, torch.bfloat16)])
def test_matches_the_torch_recurrence(kernel_device, seed, dk, dv, dtype):
    lengths = [3, 1, 4, 2]
    rows = torch.tensor([3, 1, 6, 2], dtype=torch.int32)
    has_state = torch.tensor([True, True, False, True])
    draft_rows = torch.tensor([[8, 9, -1], [-1, -1, -1], [10, 11, 12], [13, -1, -1]])
    q, k, v, g, beta = _inputs(lengths, dk, dv, dtype, kernel_device)
    pool = (torch.randn(ROWS, HV, dk, dv) * 0.3).to(dtype)
    pool[6] = float("nan")  # the fresh request's recycled row
    pool[8:] = float("nan")  # draft rows hold nothing yet
    loc_cpu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)

    original, ref_pool = pool.clone(), pool.clone()
    ref = gated_delta_rule_torch(*(t.cpu() for t in (q, k, v, g, beta)), ref_pool, rows.long(), loc_cpu, loc_cpu,
                                 has_state, draft_rows=draft_rows)
    pool = pool.to(kernel_device)
    out = gated_delta_recurrent(q, k, v, g, beta, pool, rows.to(kernel_device), loc_cpu.to(kernel_device),
                                has_state.to(kernel_device), draft_rows.to(kernel_device))
    tol = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref.float(), **tol)
    written = [1, 2, 3, 6, 8, 9, 10, 11, 12, 13]
    torch.testing.assert_close(pool[written].float().cpu(), ref_pool[written].float(), **tol)
    untouched = [0, 4, 5, 7]  # (the torch path parks its "no draft row" writes in scratch row 0; the kernel skips them)
    assert torch.equal(pool[untouched].cpu(), original[untouched])
    assert pool[[14, 15]].isnan().all()


def test_decode_without_drafts(kernel_device, seed):
    """One token per request, no draft rows (the kernel stands in for the decode path too)."""
    lengths = [1, 1, 1]
    rows = torch.tensor([5, 2, 7], dtype=torch.int32)
    has_state = torch.tensor([True, False, True])
    q, k, v, g, beta = _inputs(lengths, 16, 16, torch.float32, kernel_device)
    pool = torch.randn(ROWS, HV, 16, 16) * 0.3
    loc = torch.arange(4, dtype=torch.int32)
    ref_pool = pool.clone()
    ref = gated_delta_rule_torch(*(t.cpu() for t in (q, k, v, g, beta)), ref_pool, rows.long(), loc, loc, has_state,
                                 decode_only=True)
    pool = pool.to(kernel_device)
    out = gated_delta_recurrent(q, k, v, g, beta, pool, rows.to(kernel_device), loc.to(kernel_device),
                                has_state.to(kernel_device))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool.cpu(), ref_pool, rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_padded_queries_stop_at_their_live_tokens(kernel_device, seed, path):
    """A verify step padded per request to 4 rows (worker/cuda_graphs.py) with live_lens: the real rows' outputs,
    the final states and the draft states are the unpadded step's; pad rows are zeros and write no draft state."""
    dk, dv, width = 16, 24, 4
    q, k, v, g, beta = _inputs(LENGTHS, dk, dv, torch.float32, torch.device("cpu"))
    pool = torch.randn(ROWS, HV, dk, dv) * 0.3
    pool[6] = float("nan")
    pool[8:] = float("nan")
    loc = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0).to(torch.int32)
    ref_pool = pool.clone()
    ref = gated_delta_rule_torch(q, k, v, g, beta, ref_pool, STATE_ROWS.long(), loc, loc, HAS_STATE,
                                 draft_rows=DRAFT_ROWS)
    padded = [pad_queries(t, LENGTHS, width) for t in (q, k, v, g, beta)]
    padded[3] = -padded[3].abs()  # (g is a log decay, <= 0, in the pad rows too)
    padded_loc = torch.arange(len(LENGTHS) + 1, dtype=torch.int32) * width
    live = torch.tensor(LENGTHS, dtype=torch.int32)
    if path == "kernel":
        dev = kernel_device
        got_pool = pool.to(dev)
        out = gated_delta_recurrent(*(t.to(dev) for t in padded), got_pool, STATE_ROWS.to(dev), padded_loc.to(dev),
                                    HAS_STATE.to(dev), DRAFT_ROWS.to(dev), live.to(dev)).cpu()
        got_pool = got_pool.cpu()
    else:
        got_pool = pool.clone()
        out = gated_delta_rule_torch(*padded, got_pool, STATE_ROWS.long(), padded_loc, padded_loc, HAS_STATE,
                                     draft_rows=DRAFT_ROWS, live_lens=live)
    assert_stops_at_live_tokens(out, ref, got_pool, ref_pool, width, rtol=1e-4, atol=1e-5)
