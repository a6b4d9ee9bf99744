"""Programmatic dependent launch (kernels/pdl.py): off where it cannot run, really on in a CUDA
graph on Hopper, and a captured one-token chain launched with it computes what it computes without."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from ferrox.kernels.pdl import pdl_enabled, pdl_launch, pdl_launch_dependents, pdl_wait, triton_supports_pdl


def test_the_installed_triton_has_pdl():
    """(The pinned toolchain has it; an older Triton makes pdl_enabled False instead of failing.)"""
    assert triton_supports_pdl()


def test_pdl_is_off_on_the_cpu_and_in_the_interpreter(monkeypatch):
    assert pdl_launch(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))  # decided before asking any device


def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _busy_kernel(end_ptr, ns, USE_PDL: tl.constexpr):
    """Runs for `ns` nanoseconds, then records when it ended."""
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)
    start = _now()
    t = start
    while t - start < ns:
        t = _now()
    tl.atomic_max(end_ptr, t)


@triton.jit
def _stamp_kernel(out_ptr, USE_PDL: tl.constexpr):
    """Records when each program started and when its wait for the previous kernel returned."""
    pdl_launch_dependents(USE_PDL)
    started = _now()
    pdl_wait(USE_PDL)
    waited = _now()
    pid = tl.program_id(0)
    tl.store(out_ptr + 2 * pid, started)
    tl.store(out_ptr + 2 * pid + 1, waited)


@pytest.mark.gpu
def test_a_captured_pdl_kernel_starts_early_and_waits(cuda_device):
    if not _hopper(cuda_device):
        pytest.skip("PDL needs sm90+")
    end = torch.zeros(1, dtype=torch.int64, device=cuda_device)
    stamps = torch.zeros(64, 2, dtype=torch.int64, device=cuda_device)

    def launches():
        _busy_kernel[(16,)](end, 50_000, **pdl_launch(cuda_device))
        _stamp_kernel[(64,)](stamps, **pdl_launch(cuda_device))

    stream = torch.cuda.Stream(cuda_device)
    with torch.cuda.stream(stream):
        launches()  # compile outside the capture
        torch.cuda.synchronize(cuda_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launches()
    end.zero_()
    graph.replay()
    torch.cuda.synchronize(cuda_device)
    ended = end.item()
    started, waited = stamps[:, 0].cpu(), stamps[:, 1].cpu()
    # Every program saw the previous kernel's end before going on (the correctness half) ...
    assert int(waited.min()) >= ended
    # ... and the programs were running before it ended (PDL is really on: without it they start
    # after the 50 us busy kernel; with it, once the busy kernel's programs have all started).
    assert int(started.min()) < ended - 10_000


@pytest.mark.gpu
def test_a_captured_moe_chain_with_pdl_equals_the_chain_without(cuda_device, seed, monkeypatch):
    from ferrox.kernels.fused_moe import fused_moe_from_logits
    from ferrox.kernels.gemv import gemv
    from ferrox.kernels.rmsnorm import rms_norm

    hidden, inter, experts, top_k, layers = 2048, 768, 64, 8, 6
    dt = torch.bfloat16
    weights = [((torch.randn(hidden, hidden, device=cuda_device) / hidden**0.5).to(dt),
                (torch.randn(experts, hidden, device=cuda_device) / hidden**0.5).to(dt),
                (torch.randn(experts, 2 * inter, hidden, device=cuda_device) / hidden**0.5).to(dt),
                (torch.randn(experts, hidden, inter, device=cuda_device) / inter**0.5).to(dt))
               for _ in range(layers)]
    norm = (1 + 0.1 * torch.randn(hidden, device=cuda_device)).to(dt)
    h0 = torch.randn(1, hidden, device=cuda_device, dtype=dt)

    def chain() -> torch.Tensor:
        h = h0
        for o_proj, router, w13, w2 in weights:
            h = gemv(rms_norm(h, norm, 1e-6), o_proj, residual=h)
            logits = gemv(h, router, norm_weight=norm, eps=1e-6, out_dtype=torch.float32)
            h, _, _ = fused_moe_from_logits(h, logits, w13, w2, top_k=top_k, renormalize=True,
                                            norm_weight=norm, eps=1e-6, residual=h)
        return h

    monkeypatch.setenv("FERROX_PDL", "0")
    expected = chain()
    monkeypatch.setenv("FERROX_PDL", "1")
    stream = torch.cuda.Stream(cuda_device)
    with torch.cuda.stream(stream):
        chain()
        torch.cuda.synchronize(cuda_device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
    for _ in range(3):  # replays, each racing nothing if every kernel waits where it must
        graph.replay()
        torch.cuda.synchronize(cuda_device)
        assert torch.equal(out, expected)
