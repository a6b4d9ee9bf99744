"""layers/gated_delta_rule.py and layers/causal_conv.py (the Gated DeltaNet ops of Qwen3-Next / Qwen3.5) on
flat varlen batches with pooled states: against transformers' token-by-token recurrence and a per-request
F.conv1d, fresh requests whose rows hold garbage, queries shorter than the conv's history, a prompt split
over two steps, the CUDA-graph-safe decode paths (padding requests repeating row 0), bfloat16; on a GPU,
fla's kernels against the torch path, and the decode paths under CUDA graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ferrox.layers.causal_conv import causal_conv1d_varlen
from ferrox.layers.gated_delta_rule import gated_delta_rule_torch, gated_delta_rule_varlen
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

HK, HV, DK, DV = 2, 4, 16, 8
ROWS = 8


def qsl(lengths: list[int], device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0).to(torch.int32)
    return cpu.to(device), cpu


def gdn_inputs(num_tokens: int, dtype: torch.dtype = torch.float32, dk: int = DK, dv: int = DV, seed: int = 0,
               device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, HK, dk, generator=gen)
    k = torch.randn(num_tokens, HK, dk, generator=gen)
    v = torch.randn(num_tokens, HV, dv, generator=gen)
    # Decays spread over (0, 1): some heads forget fast, some barely; betas over (0, 1).
    g = F.logsigmoid(torch.randn(num_tokens, HV, generator=gen) * 2 + 2)
    beta = torch.sigmoid(torch.randn(num_tokens, HV, generator=gen))
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device), beta.to(device, dtype))


def state_pool(dk: int = DK, dv: int = DV, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(ROWS, HV, dk, dv, generator=gen) * 0.3).to(dtype)


def reference_gdn(q, k, v, g, beta, pool, rows, lengths, has_state):
    """transformers' recurrence per request, in float32: (outputs [T, Hv, Dv], final states per request)."""
    outs, finals, start = [], [], 0
    for row, n, fresh in zip(rows, lengths, [not h for h in has_state], strict=True):
        sl = slice(start, start + n)
        start += n
        init = torch.zeros(1, HV, q.shape[-1], v.shape[-1]) if fresh else pool[row:row + 1].float()
        o, s = torch_recurrent_gated_delta_rule(*(t[sl].float()[None] for t in (q, k, v, g, beta)), initial_state=init,
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), finals


def run_gdn(q, k, v, g, beta, pool, rows, lengths, has_state, **kwargs):
    loc, loc_cpu = qsl(lengths, q.device)
    return gated_delta_rule_varlen(q, k, v, g, beta, pool, torch.tensor(rows, device=q.device), loc, loc_cpu,
                                   torch.tensor(has_state, device=q.device), cuda_kernels=q.is_cuda, **kwargs)


def test_gdn_matches_transformers_mixed_batch():
    lengths = [1, 5, 70, 17, 1, 64]
    rows = [3, 1, 6, 2, 5, 4]
    has_state = [True, False, True, False, True, True]
    q, k, v, g, beta = gdn_inputs(sum(lengths))
    pool = state_pool()
    for row, h in zip(rows, has_state, strict=True):
        if not h:
            pool[row] = float("nan")  # a recycled row: must be ignored, not multiplied by zero
    before = pool.clone()
    out = run_gdn(q, k, v, g, beta, pool, rows, lengths, has_state)
    ref, finals = reference_gdn(q, k, v, g, beta, before, rows, lengths, has_state)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for row, final in zip(rows, finals, strict=True):
        torch.testing.assert_close(pool[row], final, rtol=1e-4, atol=1e-5)
    untouched = [r for r in range(ROWS) if r not in rows]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("split", [37, 140, 64])
def test_gdn_prompt_split_over_two_steps(split):
    total = 150
    q, k, v, g, beta = gdn_inputs(total, seed=3)
    whole = state_pool()
    parts = whole.clone()
    out_whole = run_gdn(q, k, v, g, beta, whole, [2], [total], [True])
    first = run_gdn(*(t[:split] for t in (q, k, v, g, beta)), parts, [2], [split], [True])
    second = run_gdn(*(t[split:] for t in (q, k, v, g, beta)), parts, [2], [total - split], [True])
    torch.testing.assert_close(torch.cat([first, second]), out_whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts, whole, rtol=1e-4, atol=1e-5)


def test_gdn_decode_only_matches_general_path():
    rows = [3, 1, 6, 2, 0, 0]  # the last two are padding, repeating row 0
    has_state = [True, False, True, True, True, False]
    real = 4
    q, k, v, g, beta = gdn_inputs(len(rows), seed=5)
    pool = state_pool()
    pool[1] = float("nan")
    general_pool = pool.clone()
    out = run_gdn(q, k, v, g, beta, pool, rows, [1] * len(rows), has_state, decode_only=True)
    ref = run_gdn(*(t[:real] for t in (q, k, v, g, beta)), general_pool, rows[:real], [1] * real, has_state[:real])
    torch.testing.assert_close(out[:real], ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pool[1:], general_pool[1:], rtol=1e-5, atol=1e-6)


def test_gdn_bfloat16():
    lengths = [3, 80, 1]
    rows, has_state = [1, 2, 3], [True, False, True]
    q, k, v, g, beta = gdn_inputs(sum(lengths), dtype=torch.bfloat16, seed=7)
    pool = state_pool(dtype=torch.bfloat16)
    before = pool.clone()
    out = run_gdn(q, k, v, g, beta, pool, rows, lengths, has_state)
    assert out.dtype == torch.bfloat16 and pool.dtype == torch.bfloat16
    ref, finals = reference_gdn(q, k, v, g, beta, before, rows, lengths, has_state)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    for row, final in zip(rows, finals, strict=True):
        torch.testing.assert_close(pool[row].float(), final, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["beside_a_prefill", "uniform"])
def test_gdn_keeps_the_state_after_each_draft(layout):
    """Speculative verification: requests of 1 + d tokens keep the state after each of their first d tokens in
    their draft rows (what the reference reaches on that prefix). Two layouts: verify queries of different
    lengths beside a prefill that keeps none, and every query 1 + k tokens (MTP's steady state; the path a CUDA
    graph replays, its indices from the device)."""
    if layout == "beside_a_prefill":
        lengths, rows, has_state = [3, 20, 4], [1, 2, 3], [True, False, True]
        drafts = [[10, 11, -1], [-1, -1, -1], [12, 13, 14]]
    else:
        lengths, rows, has_state = [3, 3, 3], [2, 5, 1], [True, True, False]
        drafts = [[10, 11], [12, -1], [13, 14]]
    q, k, v, g, beta = gdn_inputs(sum(lengths), seed=5)
    pool = torch.cat([state_pool(), torch.full((8, HV, DK, DV), float("nan"))])
    before = pool.clone()
    out = run_gdn(q, k, v, g, beta, pool, rows, lengths, has_state, draft_rows=torch.tensor(drafts))
    ref, finals = reference_gdn(q, k, v, g, beta, before, rows, lengths, has_state)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for row, final in zip(rows, finals, strict=True):
        torch.testing.assert_close(pool[row], final, rtol=1e-4, atol=1e-5)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for i, row_drafts in enumerate(drafts):
        for t, row in enumerate(row_drafts):
            if row < 0:
                continue
            sl = slice(starts[i], starts[i] + t + 1)
            _, prefix = reference_gdn(*(x[sl] for x in (q, k, v, g, beta)), before, [rows[i]], [t + 1],
                                      [has_state[i]])
            torch.testing.assert_close(pool[row], prefix[0], rtol=1e-4, atol=1e-5)
    assert torch.isnan(pool[15:]).all()  # (rows not named stay as they were)


# --- causal conv -------------------------------------------------------------------------------------------

C, W = 12, 4


def conv_inputs(num_tokens: int, dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, C, generator=gen)
    weight = torch.randn(C, W, generator=gen) * 0.5
    bias = torch.randn(C, generator=gen) * 0.1
    states = torch.randn(ROWS, C, W - 1, generator=gen)
    return x.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype), states.to(device, dtype)


def reference_conv(x, weight, bias, states, rows, lengths, has_state, activation="silu"):
    """A plain F.conv1d per request over [history, tokens] in float32: (outputs, new state per request)."""
    outs, finals, start = [], [], 0
    for row, n, h in zip(rows, lengths, has_state, strict=True):
        hist = states[row].float() if h else torch.zeros(C, W - 1)
        full = torch.cat([hist, x[start:start + n].float().T], dim=1)
        start += n
        if n == 0:
            finals.append(full)  # an empty query leaves its history as it was
            continue
        y = F.conv1d(full[None], weight.float()[:, None], bias.float(), groups=C)[0].T
        outs.append(F.silu(y) if activation == "silu" else y)
        finals.append(full[:, -(W - 1):])
    return torch.cat(outs), finals


def run_conv(x, weight, bias, states, rows, lengths, has_state, **kwargs):
    loc, loc_cpu = qsl(lengths, x.device)
    return causal_conv1d_varlen(x, weight, bias, states, torch.tensor(rows, device=x.device), loc, loc_cpu,
                                torch.tensor(has_state, device=x.device), **kwargs)


@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_matches_per_request_conv1d(activation):
    # Fresh and continuing prompts, queries of 1 and 2 tokens (shorter than W-1: the state shifts only
    # partly), an empty query (its state stays), a fresh 2-token query (state = [0, x0, x1]).
    lengths = [7, 1, 2, 9, 0, 2, 1]
    rows = [3, 1, 6, 2, 4, 5, 7]
    has_state = [True, True, True, False, True, False, False]
    x, weight, bias, states = conv_inputs(sum(lengths))
    states[2] = float("nan")
    states[5] = float("inf")
    before = states.clone()
    out = run_conv(x, weight, bias, states, rows, lengths, has_state, activation=activation)
    ref, finals = reference_conv(x, weight, bias, before, rows, lengths, has_state, activation)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for row, final in zip(rows, finals, strict=True):
        torch.testing.assert_close(states[row], final, rtol=0, atol=0)
    assert torch.equal(states[4], before[4])
    assert torch.equal(states[0], before[0])
    # The 2-token continuing request: its oldest history input survives, shifted to the front.
    assert torch.equal(states[6][:, 0], before[6][:, 2])


def test_conv_decode_only_matches_general_and_transformers():
    rows = [3, 1, 6, 2, 0, 0]  # two padding requests on row 0
    has_state = [True, False, True, True, True, True]
    real = 4
    x, weight, bias, states = conv_inputs(len(rows), seed=2)
    states[1] = float("nan")
    general = states.clone()
    before = states.clone()
    out = run_conv(x, weight, bias, states, rows, [1] * len(rows), has_state, decode_only=True)
    ref = run_conv(x[:real], weight, bias, general, rows[:real], [1] * real, has_state[:real])
    torch.testing.assert_close(out[:real], ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(states[1:], general[1:])
    # transformers' own decode update, for a continuing request.
    hf_state = before[3:4].clone()
    hf = causal_conv1d_update(x[:1, :, None], hf_state, weight, bias, activation="silu")
    torch.testing.assert_close(out[:1], hf[:, :, 0], rtol=1e-5, atol=1e-6)
    assert torch.equal(states[3], hf_state[0])


def test_conv_keeps_the_state_after_each_draft():
    """The conv state after each of a verify query's first tokens (including one shorter than the history: the
    old state shifts partly) equals the state the reference leaves after that prefix."""
    lengths, rows, has_state = [3, 5, 2], [1, 2, 3], [True, False, True]
    draft_rows = torch.tensor([[4, 5], [-1, -1], [6, -1]])
    x, weight, bias, states = conv_inputs(sum(lengths), seed=6)
    states = torch.cat([states, torch.full((1, C, W - 1), float("nan"))])  # row 8 untouched
    before = states.clone()
    run_conv(x, weight, bias, states, rows, lengths, has_state, draft_rows=draft_rows)
    starts = [0, 3, 8]
    for i, t, row in [(0, 0, 4), (0, 1, 5), (2, 0, 6)]:
        _, finals = reference_conv(x[starts[i]:starts[i] + t + 1], weight, bias, before, [rows[i]], [t + 1],
                                   [has_state[i]])
        assert torch.equal(states[row], finals[0])
    assert torch.isnan(states[8]).all()


def test_conv_bfloat16():
    lengths = [5, 1, 2]
    rows, has_state = [1, 2, 3], [False, True, True]
    x, weight, bias, states = conv_inputs(sum(lengths), dtype=torch.bfloat16, seed=4)
    before = states.clone()
    out = run_conv(x, weight, bias, states, rows, lengths, has_state)
    assert out.dtype == torch.bfloat16 and states.dtype == torch.bfloat16
    ref, finals = reference_conv(x, weight, bias, before, rows, lengths, has_state)
    # float32 inside, one rounding at the end: within a bf16 ulp or so of the float32 reference.
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2)
    for row, final in zip(rows, finals, strict=True):
        assert torch.equal(states[row].float(), final)  # raw inputs: bf16 round-trips exactly


# --- GPU: fla's kernels and CUDA graphs ------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
def test_cuda_kernels_match_torch_path(pool_dtype, decode):
    pytest.importorskip("fla")
    dk = dv = 128  # the head dims of Qwen3-Next / Qwen3.5's linear-attention layers
    if decode:
        lengths, rows, has_state = [1] * 6, [3, 1, 6, 2, 0, 0], [True, False, True, True, True, True]
    else:
        lengths, rows, has_state = [1, 5, 70, 200, 1, 64], [3, 1, 6, 2, 5, 4], [True, False, True, False, True, True]
    real = 4 if decode else len(rows)
    q, k, v, g, beta = gdn_inputs(sum(lengths), dtype=torch.bfloat16, dk=dk, dv=dv, seed=11, device="cuda")
    pool = state_pool(dk, dv, dtype=pool_dtype).cuda()
    pool[1] = float("nan")
    ref_pool = pool.cpu()
    out = run_gdn(q, k, v, g, beta, pool, rows, lengths, has_state, decode_only=decode)
    torch.cuda.synchronize()
    loc, loc_cpu = qsl(lengths)
    ref = gated_delta_rule_torch(*(t.cpu() for t in (q, k, v, g, beta)), ref_pool, torch.tensor(rows), loc, loc_cpu,
                                 torch.tensor(has_state), decode_only=decode)
    assert out.dtype == torch.bfloat16 and pool.dtype == pool_dtype
    n_real = sum(lengths[:real])
    assert rel_err(out[:n_real], ref[:n_real]) < 2e-2
    for row in set(rows[:real]) - ({0} if decode else set()):
        assert rel_err(pool[row], ref_pool[row]) < 2e-2, row


@pytest.mark.gpu
@needs_cuda
def test_decode_paths_under_cuda_graph():
    """Both decode paths captured once and replayed on new inputs give the eager torch results."""
    dk = dv = 128
    n = 8
    rows = torch.tensor([3, 1, 6, 2, 5, 4, 0, 0], device="cuda")
    has_state = torch.tensor([True, False, True, True, False, True, True, True], device="cuda")
    loc, loc_cpu = qsl([1] * n, "cuda")
    static = list(gdn_inputs(n, dtype=torch.bfloat16, dk=dk, dv=dv, seed=1, device="cuda"))
    x, weight, bias, conv_pool = conv_inputs(n, dtype=torch.bfloat16, seed=1, device="cuda")
    ssm_pool = state_pool(dk, dv).cuda()

    def step():
        y = causal_conv1d_varlen(x, weight, bias, conv_pool, rows, loc, loc_cpu, has_state, decode_only=True)
        o = gated_delta_rule_varlen(*static, ssm_pool, rows, loc, loc_cpu, has_state, decode_only=True, cuda_kernels=True)
        return y, o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: fla compiles its kernels here, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_out, o_out = step()

    fresh = gdn_inputs(n, dtype=torch.bfloat16, dk=dk, dv=dv, seed=2, device="cuda")
    for dst, src in zip(static, fresh, strict=True):
        dst.copy_(src)
    x.copy_(conv_inputs(n, dtype=torch.bfloat16, seed=3, device="cuda")[0])
    conv_ref_pool, ssm_ref_pool = conv_pool.cpu(), ssm_pool.cpu()
    graph.replay()
    torch.cuda.synchronize()
    cpu = [t.cpu() for t in (rows, loc, loc_cpu, has_state)]
    y_ref = causal_conv1d_varlen(x.cpu(), weight.cpu(), bias.cpu(), conv_ref_pool, cpu[0], cpu[1], cpu[2], cpu[3],
                                 decode_only=True)
    o_ref = gated_delta_rule_torch(*(t.cpu() for t in static), ssm_ref_pool, *cpu, decode_only=True)
    real = 6
    torch.testing.assert_close(y_out[:real].cpu(), y_ref[:real], rtol=1e-2, atol=1e-2)
    assert rel_err(o_out[:real], o_ref[:real]) < 2e-2
    assert torch.equal(conv_pool[1:].cpu(), conv_ref_pool[1:])
    assert rel_err(ssm_pool[1:], ssm_ref_pool[1:]) < 2e-2
