"""Top-k/top-p sampling: the CUDA kernel (GPU) and the torch fallback (everywhere) against a
brute-force kept-set oracle, and their empirical distributions against the renormalized one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from ferrox.kernels import cuda_sampling
from ferrox.kernels.cuda_sampling import top_k_top_p_sample, top_k_top_p_sample_torch

from tests.kernels.kernel_refs import top_k_top_p_mask_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(INTERPRETED, reason="no Triton here: runs in the parent process only")


def _peaked_probs(batch: int, vocab: int, device, temperature: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(batch, vocab, device=device) * temperature, dim=-1)


def _params(batch: int, vocab: int, device):
    top_k = torch.randint(0, min(vocab, 200), (batch,), dtype=torch.int32, device=device)
    top_p = torch.rand(batch, device=device) * 0.9 + 0.05
    top_k[::3] = 0  # top-k off
    top_p[1::3] = 1.0  # top-p off
    return top_k, top_p


def _check_never_excluded(sample_fn, probs, top_k, top_p, draws: int) -> None:
    keep = top_k_top_p_mask_ref(probs.cpu(), top_k.cpu(), top_p.cpu())
    for _ in range(draws):
        u = torch.rand(probs.shape[0], device=probs.device)
        tokens = sample_fn(probs, top_k, top_p, u).cpu()
        assert tokens.dtype == torch.int64
        ok = keep.gather(1, tokens[:, None]).squeeze(1)
        assert ok.all(), f"rows {torch.nonzero(~ok).flatten().tolist()} sampled excluded tokens"


def _check_distribution(sample_fn, device, vocab: int = 48, samples: int = 40000) -> None:
    """One row repeated `samples` times with fresh uniforms: total variation to the renormalized kept
    distribution must be within sampling noise (about sqrt(vocab / samples) / 2 ~ 0.02)."""
    probs = _peaked_probs(1, vocab, device, temperature=1.0)
    for k, p in [(0, 1.0), (10, 1.0), (0, 0.7), (12, 0.6)]:
        top_k = torch.full((samples,), k, dtype=torch.int32, device=device)
        top_p = torch.full((samples,), p, device=device)
        tokens = sample_fn(probs.expand(samples, vocab).contiguous(), top_k, top_p, torch.rand(samples, device=device))
        freq = torch.bincount(tokens.cpu(), minlength=vocab).double() / samples
        keep = top_k_top_p_mask_ref(probs.cpu(), top_k[:1].cpu(), top_p[:1].cpu())[0]
        expected = torch.where(keep, probs[0].cpu().double(), torch.zeros(vocab, dtype=torch.float64))
        expected /= expected.sum()
        tv = 0.5 * (freq - expected).abs().sum().item()
        assert tv < 0.03, f"top_k={k} top_p={p}: total variation {tv:.3f}"


def test_torch_path_never_emits_excluded_tokens(seed):
    probs = _peaked_probs(16, 500, "cpu")
    top_k, top_p = _params(16, 500, "cpu")
    _check_never_excluded(top_k_top_p_sample_torch, probs, top_k, top_p, draws=20)


def test_torch_path_greedy_limits_equal_argmax(seed):
    probs = _peaked_probs(8, 1000, "cpu")
    u = torch.rand(8)
    ones = torch.ones(8, dtype=torch.int32)
    assert torch.equal(top_k_top_p_sample_torch(probs, ones, torch.ones(8), u), probs.argmax(1))
    assert torch.equal(top_k_top_p_sample_torch(probs, ones * 0, torch.full((8,), 1e-9), u), probs.argmax(1))


def test_torch_path_distribution(seed):
    _check_distribution(top_k_top_p_sample_torch, "cpu")


def test_cpu_tensors_take_the_torch_path(seed):
    probs = _peaked_probs(4, 100, "cpu")
    top_k, top_p = _params(4, 100, "cpu")
    u = torch.rand(4)
    assert torch.equal(top_k_top_p_sample(probs, top_k, top_p, u), top_k_top_p_sample_torch(probs, top_k, top_p, u))


def test_a_build_lock_left_by_a_dead_build_is_removed(tmp_path):
    """torch's JIT build waits forever on a `lock` file that a killed build left in its folder
    (an engine that exited while its daemon thread built the kernel): the next start removes it."""
    (tmp_path / "lock").write_text("")
    with cuda_sampling.exclusive_build(tmp_path, wait_s=5) as ours:
        assert ours and not (tmp_path / "lock").exists()


def test_a_live_build_in_another_process_is_waited_for(tmp_path):
    """While another process holds the build folder its `lock` is live: waited for (here: given up
    after the wait) and left alone; once that process is gone, the folder is ours."""
    (tmp_path / "lock").write_text("")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        handle = open({str(tmp_path / "ferrox-build.flock")!r}, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with cuda_sampling.exclusive_build(tmp_path, wait_s=0.5) as ours:
            assert not ours and (tmp_path / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
    with cuda_sampling.exclusive_build(tmp_path, wait_s=5) as ours:  # the OS dropped the dead holder's flock
        assert ours and not (tmp_path / "lock").exists()


def _fake_sources(folder, text: str):
    folder.mkdir(exist_ok=True)
    for name in cuda_sampling._CUDA_SOURCES:
        (folder / name).write_text(f"// {name}: {text}\n")
    return folder


def test_a_changed_kernel_source_gets_a_build_folder_of_its_own(tmp_path, monkeypatch):
    """An upgrade that changes the kernel must find no module on disk (so it builds in the
    background for the next start), not rebuild in the folder of the old one on the start-up
    thread; the same sources, reinstalled, find the folder built before."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    src = _fake_sources(tmp_path / "a", "v1")
    first = cuda_sampling._build_dir(src)
    same = _fake_sources(tmp_path / "b", "v1")
    assert cuda_sampling._build_dir(same) == first
    assert cuda_sampling._build_dir(_fake_sources(tmp_path / "a", "v2")) != first


def test_staged_sources_keep_their_first_write_time(tmp_path):
    """torch's build compares times: the copies it builds from are written once per content, so a
    reinstall (same text, new file times) does not make a built module look stale."""
    src, build = _fake_sources(tmp_path / "src", "v1"), tmp_path / "build"
    build.mkdir()
    staged = cuda_sampling.stage_sources(src, build)
    assert [p.read_bytes() for p in staged] == [(src / n).read_bytes() for n in cuda_sampling._CUDA_SOURCES]
    past = 1_000_000_000
    for path in staged:
        os.utime(path, (past, past))
    _fake_sources(src, "v1")  # rewritten: same text, a new time
    assert [p.stat().st_mtime for p in cuda_sampling.stage_sources(src, build)] == [past] * len(staged)
    _fake_sources(src, "v2")
    again = cuda_sampling.stage_sources(src, build)
    assert all(p.stat().st_mtime > past and p.read_text().endswith("v2\n") for p in again)


def test_bad_shapes_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p_sample(torch.ones(2, 5), torch.zeros(2, dtype=torch.int32), torch.ones(3), torch.rand(2))


def _cuda_kernel():
    ext = cuda_sampling.load_extension()
    if ext is None:
        pytest.skip("CUDA sampling kernel could not be built here (no nvcc?)")
    return ext


@pytest.mark.gpu
def test_cuda_kernel_greedy_limits_equal_argmax(cuda_device, seed):
    _cuda_kernel()
    probs = _peaked_probs(64, 128256, cuda_device)
    u = torch.rand(64, device=cuda_device)
    ones = torch.ones(64, dtype=torch.int32, device=cuda_device)
    argmax = probs.argmax(1)
    assert torch.equal(top_k_top_p_sample(probs, ones, torch.ones(64, device=cuda_device), u), argmax)
    assert torch.equal(top_k_top_p_sample(probs, ones * 0, torch.full((64,), 1e-9, device=cuda_device), u), argmax)


@pytest.mark.gpu
def test_cuda_kernel_never_emits_excluded_tokens(cuda_device, seed):
    _cuda_kernel()
    for vocab, temperature in [(128256, 2.0), (128256, 0.5), (49152, 4.0), (1000, 1.0)]:
        probs = _peaked_probs(48, vocab, cuda_device, temperature)
        top_k, top_p = _params(48, vocab, cuda_device)
        _check_never_excluded(top_k_top_p_sample, probs, top_k, top_p, draws=4)


@pytest.mark.gpu
def test_cuda_kernel_distribution(cuda_device, seed):
    _cuda_kernel()
    _check_distribution(top_k_top_p_sample, cuda_device)


@pytest.mark.gpu
def test_cuda_kernel_is_inverse_cdf_in_thread_major_order(cuda_device, seed):
    """Exact agreement with the documented walk: thread t owns tokens t, t + 1024, ...; the kernel's
    pick for uniform u is the token where the kept mass in that order first exceeds u * total."""
    _cuda_kernel()
    batch, vocab, threads = 32, 128256, 1024
    probs = _peaked_probs(batch, vocab, cuda_device)
    top_k, top_p = _params(batch, vocab, cuda_device)
    u = torch.rand(batch, device=cuda_device)
    got = top_k_top_p_sample(probs, top_k, top_p, u).cpu()
    keep = top_k_top_p_mask_ref(probs.cpu(), top_k.cpu(), top_p.cpu())
    order = torch.arange(vocab).reshape(-1, threads).t().flatten() if vocab % threads == 0 else None
    if order is None:
        idx = torch.arange(vocab)
        order = idx[torch.argsort((idx % threads) * vocab + idx // threads)]
    kept = torch.where(keep, probs.cpu().double(), torch.zeros((), dtype=torch.float64))[:, order]
    csum = kept.cumsum(1)
    pos = torch.searchsorted(csum, (u.cpu().double() * csum[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    expected = order[pos.squeeze(1)]
    agree = (expected == got).float().mean().item()
    assert agree >= 0.9, f"only {agree:.0%} of rows match the inverse-CDF walk"  # float32 sums at the boundary


@pytest.mark.gpu
def test_sampler_uses_the_cuda_kernel_once_built(cuda_device, seed):
    """The engine's Sampler: with a build on disk, prepare_extension hands the kernel over and
    unseeded top-k/top-p rows go through it; tokens stay inside each row's top-k, greedy rows take
    the argmax, and the seeded row (redrawn by the exponential race) draws the same token again
    from a generator reseeded the same way, also when sampled alone."""
    from ferrox.layers.sampler import Sampler, SamplingMetadata

    if cuda_sampling.load_extension() is None:  # runs (or loads) the build
        pytest.skip("no CUDA compiler here")
    kernel = cuda_sampling.prepare_extension()
    assert kernel is not None
    batch, vocab = 6, 5000
    logits = torch.randn(batch, vocab, device=cuda_device) * 3
    top_k = torch.tensor([5, 1, vocab, 20, 5, 3], device=cuda_device)
    gens = {4: torch.Generator(device=cuda_device).manual_seed(7)}
    md = SamplingMetadata(all_greedy=False, greedy_rows=torch.tensor([False, False, False, False, False, True],
                                                                     device=cuda_device),
                          temperature=torch.ones(batch, device=cuda_device), top_k=top_k, generators=gens)
    sampler = Sampler(torch.Generator(device=cuda_device).manual_seed(0), kernel)
    first = sampler(logits.clone(), md).token_ids
    for _ in range(20):
        tokens = sampler(logits.clone(), md).token_ids
        for row in range(batch - 1):
            allowed = torch.topk(logits[row], int(top_k[row])).indices
            assert tokens[row] in allowed
        assert tokens[1] == logits[1].argmax() and tokens[5] == logits[5].argmax()
    gens[4].manual_seed(7)
    assert sampler(logits.clone(), md).token_ids[4] == first[4]
    gens[4].manual_seed(7)
    alone = SamplingMetadata(all_greedy=False, temperature=torch.ones(1, device=cuda_device), top_k=top_k[4:5],
                             generators={0: gens[4]})
    assert sampler(logits[4:5].clone(), alone).token_ids[0] == first[4]


def test_the_cuda_sources_ship_inside_the_package():
    """ferrox/csrc is what pyproject's maturin `include` puts in every sdist and wheel: in a checkout
    it must resolve to the top-level cuda/ sources, or installed packages sample on the torch path."""
    src = cuda_sampling._cuda_source_dir()
    assert src == cuda_sampling.PACKAGED_SOURCE_DIR
    root = cuda_sampling.PACKAGED_SOURCE_DIR.parents[2] / "cuda"
    if root.is_dir():  # a checkout (an installed package has only its copy)
        for name in cuda_sampling._CUDA_SOURCES:
            assert (src / name).read_bytes() == (root / name).read_bytes()
