"""The one-launch short-query causal conv (kernels/causal_conv_short.py) against the torch path of
layers/causal_conv.py (itself checked against a per-request F.conv1d in tests/layers): outputs, new states and the
state after each draft, for verify queries of several lengths, a decode, queries shorter than the history, a fresh
request whose row holds NaN, widths 2-4, channels that are not a multiple of the block, x as a strided view of one
projection, bfloat16; rows nobody names stay untouched."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels.causal_conv_short import causal_conv_short
from ferrox.layers.causal_conv import causal_conv1d_varlen

from tests.helpers.padded_queries import (
    DRAFT_ROWS,
    HAS_STATE,
    LENGTHS,
    STATE_ROWS,
    assert_stops_at_live_tokens,
    pad_queries,
)

ROWS = 16  # request rows 1-7, draft rows 8-15


@pytest.mark.parametrize(("channels", "width", "dtype", "bias"), [(12, 4, torch.float32, True),
                                                                  (200, 4, torch.bfloat16, False),
                                                                  (40, 2, torch.float32, True),
                                                                  (33, 3, torch.float32, False)])
def test_matches_the_torch_conv(kernel_device, seed, channels, width, dtype, bias):
    lengths = [3, 1, 4, 2]
    rows = torch.tensor([3, 1, 6, 2], dtype=torch.int32)
    has_state = torch.tensor([True, True, False, True])
    draft_rows = torch.tensor([[8, 9, -1], [-1, -1, -1], [10, 11, 12], [13, -1, -1]])
    tokens = sum(lengths)
    x = torch.randn(tokens, channels + 7)[:, 3:3 + channels].to(dtype)  # (rows strided, as the projection's split)
    weight = (torch.randn(channels, width) * 0.5).to(dtype)
    b = (torch.randn(channels) * 0.1).to(dtype) if bias else None
    pool = torch.randn(ROWS, channels, width - 1).to(dtype)
    pool[6] = float("nan")  # the fresh request's recycled row
    pool[8:] = float("nan")
    loc = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    original, ref_pool = pool.clone(), pool.clone()
    ref = causal_conv1d_varlen(x, weight, b, ref_pool, rows, loc, loc, has_state, activation="silu",
                               draft_rows=draft_rows)
    dev = kernel_device
    pool = pool.to(dev)
    y = causal_conv_short(x.to(dev), weight.to(dev), b.to(dev) if b is not None else None, pool, rows.to(dev),
                          loc.to(dev), has_state.to(dev), "silu", draft_rows.to(dev))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    assert y.dtype == dtype
    torch.testing.assert_close(y.float().cpu(), ref.float(), **tol)
    written = [1, 2, 3, 6, 8, 9, 10, 11, 12, 13]
    torch.testing.assert_close(pool[written].float().cpu(), ref_pool[written].float(), **tol)
    assert torch.equal(pool[[0, 4, 5, 7]].cpu(), original[[0, 4, 5, 7]])
    assert pool[[14, 15]].isnan().all()


def test_decode_and_no_activation(kernel_device, seed):
    """One token per request without draft rows or activation, as the decode path."""
    channels, width = 24, 4
    rows = torch.tensor([5, 2, 7], dtype=torch.int32)
    has_state = torch.tensor([True, False, True])
    x = torch.randn(3, channels)
    weight = torch.randn(channels, width) * 0.5
    pool = torch.randn(ROWS, channels, width - 1)
    loc = torch.arange(4, dtype=torch.int32)
    ref_pool = pool.clone()
    ref = causal_conv1d_varlen(x, weight, None, ref_pool, rows, loc, loc, has_state, activation=None,
                               decode_only=True)
    pool = pool.to(kernel_device)
    y = causal_conv_short(x.to(kernel_device), weight.to(kernel_device), None, pool, rows.to(kernel_device),
                          loc.to(kernel_device), has_state.to(kernel_device), None)
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.cpu(), ref_pool, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_padded_queries_stop_at_their_live_tokens(kernel_device, seed, path):
    """A verify step padded per request to 4 rows (worker/cuda_graphs.py) with live_lens: the real rows' outputs,
    the new states (the last inputs before the padding, a query shorter than the history keeping part of its old
    state) and the draft states are the unpadded step's; pad rows are zeros and write no draft state."""
    channels, width, q_width = 20, 4, 4
    x = torch.randn(sum(LENGTHS), channels)
    weight, b = torch.randn(channels, width) * 0.5, torch.randn(channels) * 0.1
    pool = torch.randn(ROWS, channels, width - 1)
    pool[6] = float("nan")
    pool[8:] = float("nan")
    loc = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0).to(torch.int32)
    ref_pool = pool.clone()
    ref = causal_conv1d_varlen(x, weight, b, ref_pool, STATE_ROWS, loc, loc, HAS_STATE, activation="silu",
                               draft_rows=DRAFT_ROWS)
    xp = pad_queries(x, LENGTHS, q_width)
    padded_loc = torch.arange(len(LENGTHS) + 1, dtype=torch.int32) * q_width
    live = torch.tensor(LENGTHS, dtype=torch.int32)
    if path == "kernel":
        dev = kernel_device
        got_pool = pool.to(dev)
        y = causal_conv_short(xp.to(dev), weight.to(dev), b.to(dev), got_pool, STATE_ROWS.to(dev), padded_loc.to(dev),
                              HAS_STATE.to(dev), "silu", DRAFT_ROWS.to(dev), live.to(dev)).cpu()
        got_pool = got_pool.cpu()
    else:
        got_pool = pool.clone()
        y = causal_conv1d_varlen(xp, weight, b, got_pool, STATE_ROWS, padded_loc, padded_loc, HAS_STATE,
                                 activation="silu", draft_rows=DRAFT_ROWS, live_lens=live)
    assert_stops_at_live_tokens(y, ref, got_pool, ref_pool, q_width, rtol=1e-5, atol=1e-5)
