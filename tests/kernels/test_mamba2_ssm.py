"""Mamba2's selective scan (layers/mamba2_ssm.py) against a token-by-token reference written from transformers'
mamba2_selective_state_update (state [head_dim, d_state], S <- exp(dt A) S + (dt x) B^T, y = S C + D x): the torch
path's chunked form (prompts crossing its 64-token chunks, from stored states) and its grouped recurrence (short
queries, draft states); then the one-launch recurrence (kernels/mamba2_recurrent.py: on CUDA, or under
TRITON_INTERPRET=1) against the torch path, with ragged queries, draft rows, a fresh request whose row holds NaN,
bfloat16 pools, and verify steps padded per request (live_lens)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ferrox.kernels.mamba2_recurrent import mamba2_recurrent
from ferrox.layers.mamba2_ssm import mamba2_ssm_torch

from tests.helpers.padded_queries import (
    DRAFT_ROWS,
    HAS_STATE,
    LENGTHS,
    STATE_ROWS,
    assert_stops_at_live_tokens,
    pad_queries,
)

H, G = 4, 2
ROWS = 16  # request rows 1-7, draft rows 8-15


def _inputs(lengths: list[int], p: int, n: int, dtype: torch.dtype = torch.float32, device="cpu"):
    tokens = sum(lengths)
    # x, B, C as the mixer has them: column blocks of one [T, H P + 2 G N] tensor (strided rows).
    xbc = torch.randn(tokens, H * p + 2 * G * n)
    x, b, c = xbc.to(device, dtype).split([H * p, G * n, G * n], dim=-1)
    dt = F.softplus(torch.randn(tokens, H) - 1).to(device)
    a = -torch.empty(H).uniform_(0.05, 1.0).to(device)
    d = torch.randn(H).to(device)
    return x.reshape(tokens, H, p), dt, a, b.reshape(tokens, G, n), c.reshape(tokens, G, n), d


def _naive(x, dt, a, b, c, d, pool, rows, lengths, has_state):
    """Token by token in transformers' layout ([head_dim, d_state] states); returns (y, final states [N, H, N, P]
    in the pool's layout)."""
    out, finals, start = torch.zeros(x.shape), [], 0
    group = H // G
    for i, n in enumerate(lengths):
        state = pool[int(rows[i])].float().transpose(-1, -2).clone() if has_state[i] else torch.zeros(
            H, x.shape[2], b.shape[2])
        for t in range(start, start + n):
            for h in range(H):
                bt, ct = b[t, h // group].float(), c[t, h // group].float()
                xt = x[t, h].float()
                state[h] = state[h] * torch.exp(dt[t, h] * a[h]) + torch.outer(dt[t, h] * xt, bt)
                out[t, h] = state[h] @ ct + d[h] * xt
        finals.append(state.transpose(-1, -2))
        start += n
    return out, torch.stack(finals)


def _loc(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)


def test_torch_path_matches_the_token_by_token_scan(seed):
    """A 150-token prompt from a stored state (three 64-token chunks, the last partial), a 20-token fresh one whose
    row holds NaN, two decodes of equal length stepping together and a 5-token query: outputs and final states."""
    lengths = [150, 20, 1, 5, 1]
    rows = torch.tensor([3, 6, 1, 2, 5], dtype=torch.int32)
    has_state = torch.tensor([True, False, True, True, True])
    x, dt, a, b, c, d = _inputs(lengths, 8, 16)
    pool = torch.randn(ROWS, H, 16, 8) * 0.5
    pool[6] = float("nan")
    ref, finals = _naive(x, dt, a, b, c, d, pool, rows, lengths, has_state)
    got_pool = pool.clone()
    out = mamba2_ssm_torch(x, dt, a, b, c, d, got_pool, rows, _loc(lengths), _loc(lengths), has_state)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_pool[rows.long()], finals, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_pool[[4, 7]], pool[[4, 7]])


def test_torch_decode_path_is_the_recurrence(seed):
    lengths = [1, 1, 1]
    rows = torch.tensor([5, 2, 7], dtype=torch.int32)
    has_state = torch.tensor([True, False, True])
    x, dt, a, b, c, d = _inputs(lengths, 8, 16)
    pool = torch.randn(ROWS, H, 16, 8)
    ref, finals = _naive(x, dt, a, b, c, d, pool, rows, lengths, has_state)
    loc = _loc(lengths)
    out = mamba2_ssm_torch(x, dt, a, b, c, d, pool, rows, loc, loc, has_state, decode_only=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[rows.long()], finals, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("p", "n", "dtype"), [(8, 16, torch.float32), (24, 12, torch.float32),
                                               (64, 128, torch.bfloat16)])
def test_kernel_matches_the_torch_recurrence(kernel_device, seed, p, n, dtype):
    """Verify queries of different lengths beside a decode, with their draft states; head dims and state sizes that
    are not powers of two; bfloat16 inputs and pools. Rows nobody names stay untouched."""
    lengths = [3, 1, 4, 2]
    rows = torch.tensor([3, 1, 6, 2], dtype=torch.int32)
    has_state = torch.tensor([True, True, False, True])
    draft_rows = torch.tensor([[8, 9, -1], [-1, -1, -1], [10, 11, 12], [13, -1, -1]])
    x, dt, a, b, c, d = _inputs(lengths, p, n, dtype)
    pool = (torch.randn(ROWS, H, n, p) * 0.3).to(dtype)
    pool[6] = float("nan")
    pool[8:] = float("nan")
    loc = _loc(lengths)
    original, ref_pool = pool.clone(), pool.clone()
    ref = mamba2_ssm_torch(x, dt, a, b, c, d, ref_pool, rows, loc, loc, has_state, draft_rows=draft_rows)
    dev = kernel_device
    got_pool = pool.to(dev)
    out = mamba2_recurrent(*(t.to(dev) for t in (x, dt, a, b, c, d)), got_pool, rows.to(dev), loc.to(dev),
                           has_state.to(dev), draft_rows.to(dev))
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert out.dtype == dtype
    torch.testing.assert_close(out.float().cpu(), ref.float(), **tol)
    written = [1, 2, 3, 6, 8, 9, 10, 11, 12, 13]
    torch.testing.assert_close(got_pool[written].float().cpu(), ref_pool[written].float(), **tol)
    untouched = [0, 4, 5, 7]  # (the torch path parks its "no draft row" writes in scratch row 0; the kernel skips them)
    assert torch.equal(got_pool[untouched].cpu(), original[untouched])
    assert got_pool[[14, 15]].isnan().all()


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_padded_queries_stop_at_their_live_tokens(kernel_device, seed, path):
    """A verify step padded per request to 4 rows (worker/cuda_graphs.py) with live_lens: the real rows' outputs,
    the final states and the draft states are the unpadded step's; pad rows are zeros and write no draft state."""
    p, n, width = 8, 16, 4
    x, dt, a, b, c, d = _inputs(LENGTHS, p, n)
    x, b, c = x.contiguous(), b.contiguous(), c.contiguous()
    pool = torch.randn(ROWS, H, n, p) * 0.3
    pool[6] = float("nan")
    pool[8:] = float("nan")
    loc = _loc(LENGTHS)
    ref_pool = pool.clone()
    ref = mamba2_ssm_torch(x, dt, a, b, c, d, ref_pool, STATE_ROWS, loc, loc, HAS_STATE, draft_rows=DRAFT_ROWS)
    px, pdt, pb, pc = (pad_queries(t, LENGTHS, width) for t in (x, dt, b, c))
    pdt = pdt.abs()  # (a step is positive in the pad rows too)
    padded_loc = torch.arange(len(LENGTHS) + 1, dtype=torch.int32) * width
    live = torch.tensor(LENGTHS, dtype=torch.int32)
    if path == "kernel":
        dev = kernel_device
        got_pool = pool.to(dev)
        out = mamba2_recurrent(*(t.to(dev) for t in (px, pdt, a, pb, pc, d)), got_pool, STATE_ROWS.to(dev),
                               padded_loc.to(dev), HAS_STATE.to(dev), DRAFT_ROWS.to(dev), live.to(dev)).cpu()
        got_pool = got_pool.cpu()
    else:
        got_pool = pool.clone()
        out = mamba2_ssm_torch(px, pdt, a, pb, pc, d, got_pool, STATE_ROWS, padded_loc, padded_loc, HAS_STATE,
                               draft_rows=DRAFT_ROWS, live_lens=live)
    assert_stops_at_live_tokens(out, ref, got_pool, ref_pool, width, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paths_match_the_torch_scan(cuda_device, seed, dtype):
    """mamba2_ssm_varlen with cuda_kernels (fla's chunk_simple_gla for a step with prompts, the one-launch
    recurrence for decodes) against the torch path, at the releases' head shapes (head_dim 64, d_state 128): prompts
    of 300 and 70 tokens from stored states beside a fresh 17-token one, then a decode step for each."""
    from ferrox.layers.mamba2_ssm import _fla_chunk_op, mamba2_ssm_varlen

    if _fla_chunk_op() is None:
        pytest.skip("flash-linear-attention is not installed")
    lengths = [300, 17, 70]
    rows = torch.tensor([3, 6, 1], dtype=torch.int32)
    has_state = torch.tensor([True, False, True])
    pool = (torch.randn(ROWS, H, 128, 64) * 0.3).to(dtype)
    pool[6] = float("nan")
    ref_pool, got_pool = pool.clone(), pool.to(cuda_device)
    tol = {"rtol": 2e-3, "atol": 2e-3} if dtype == torch.float32 else {"rtol": 5e-2, "atol": 5e-2}
    for step in (lengths, [1, 1, 1]):
        x, dt, a, b, c, d = _inputs(step, 64, 128, dtype)
        loc = _loc(step)
        ref = mamba2_ssm_torch(x, dt, a, b, c, d, ref_pool, rows, loc, loc, has_state)
        dev = cuda_device
        out = mamba2_ssm_varlen(*(t.to(dev) for t in (x, dt, a, b, c, d)), got_pool, rows.to(dev), loc.to(dev), loc,
                                has_state.to(dev), cuda_kernels=True, decode_only=step == [1, 1, 1])
        torch.testing.assert_close(out.float().cpu(), ref.float(), **tol)
        torch.testing.assert_close(got_pool[rows.long()].float().cpu(), ref_pool[rows.long()].float(), **tol)
        has_state = torch.tensor([True, True, True])


def test_granite_4_h_on_the_triton_kernel_set(kernel_device, tmp_path):
    """A tiny Granite 4.0-H on the GPU's op set (kernels="triton": the conv's and the scan's one-launch kernels for
    its decode steps, Triton norms) in the interpreter: last-prompt logits and greedy tokens as transformers'. (On a
    GPU the engine tests run these kernels: tests/models/test_granitemoehybrid.py.)"""
    if kernel_device.type == "cuda":
        pytest.skip("the CUDA engine test covers this on a GPU")
    transformers = pytest.importorskip("transformers")
    from tests.helpers.tiny_granitemoehybrid import make_tiny_granitemoehybrid
    from tests.models.conftest import assert_triton_kernel_set_matches

    folder = make_tiny_granitemoehybrid(tmp_path / "granite", experts=4, rope=True, seed=1)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_triton_kernel_set_matches(folder, ref, [(7 * i) % 300 + 3 for i in range(20)])
