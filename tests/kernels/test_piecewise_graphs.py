"""PiecewiseGraphRunner: prefill and mixed steps replayed as graphs around eager attention equal the
eager forward (GPU only), hidden states and the K/V they write."""

from __future__ import annotations

import pytest
import torch
from ferrox.worker.dummy_batch import upload_step
from ferrox.worker.piecewise_graphs import token_ladder
from ferrox.worker.step_inputs import Uploader
from ferrox.worker.warmup import EngineLimits, Recipe, RequestShape, build_step

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_cuda_graphs import BLOCK, _tiny_llama


def test_token_ladder():
    assert token_ladder(8192) == [8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert token_ladder(100) == [8, 16, 32, 48, 64, 96, 100]  # the budget itself closes the ladder
    assert token_ladder(64) == [8, 16, 32, 48, 64]
    assert token_ladder(5) == [5]
    assert token_ladder(0) == []
    assert token_ladder(8192, max_tokens=48) == [8, 16, 32, 48]
    assert token_ladder(8192, max_tokens=2048)[10:] == [512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048]
    assert token_ladder(1000, max_tokens=2048)[-2:] == [896, 1000]


def test_attention_buffers_fill_adjacent_views_in_one_copy():
    """q/k/v as a fused projection's column views land in the shared buffer as they are; separate
    tensors (Qwen3's normed q and k) too; the result is the output buffer's first t rows."""
    from ferrox.worker.piecewise_graphs import _AttentionBuffers

    t, heads, kv_heads, dim = 5, 4, 2, 8
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim)
    fused = qkv.view(t, heads + 2 * kv_heads, dim)
    q, k, v = fused[:, :heads], fused[:, heads:heads + kv_heads], fused[:, heads + kv_heads:]
    bufs = _AttentionBuffers(8, q, k, v)
    out = bufs.fill(q, k, v)
    assert out.data_ptr() == bufs.out.data_ptr() and out.shape == (t, heads, dim)
    assert torch.equal(bufs.qkv[:t], qkv) and not bufs.qkv[t:].any()
    q2, k2, v2 = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, kv_heads, dim)
    bufs.fill(q2, k2, v2)
    assert torch.equal(bufs.q[:t], q2) and torch.equal(bufs.k[:t], k2) and torch.equal(bufs.v[:t], v2)
    with pytest.raises(RuntimeError, match="attention shapes differ"):
        bufs.check(torch.randn(t, heads, 2 * dim), k2, v2)


def _steps(num_blocks: int):
    """Steps of every kind the runner serves (decodes first, as the core schedules them): a fresh
    prompt, several prompts, decodes beside a prefill chunk, a prefix hit beside a decode, and a
    token count that is a ladder size exactly."""
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, block_size=BLOCK,
                          num_blocks=num_blocks, decode_graph_max=8)
    recipes = [
        Recipe("one prompt", (RequestShape(5, 5),)),
        Recipe("three prompts", (RequestShape(13, 13), RequestShape(2, 2), RequestShape(21, 21))),
        Recipe("decodes + prefill", (RequestShape(40, 1), RequestShape(7, 1), RequestShape(30, 30))),
        Recipe("decode + prefix hit", (RequestShape(90, 1), RequestShape(64 + 19, 19))),
        Recipe("exactly 32", (RequestShape(3, 1), RequestShape(31, 31))),
    ]
    return [(r.name, build_step(r, limits, vocab_size=1000)) for r in recipes]


@pytest.mark.gpu
def test_piecewise_replay_matches_eager(cuda_device, seed):
    from ferrox.worker.piecewise_graphs import PiecewiseGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    runner = PiecewiseGraphRunner(model, kv_caches, max_num_batched_tokens=64, block_size=BLOCK, device=cuda_device)
    assert runner.capture() > 0 and sorted(runner.pieces) == [8, 16, 32, 48, 64]
    assert all(len(p.graphs) == 4 and len(p.sites) == 3 for p in runner.pieces.values())  # 3 layers
    assert not any(kv.any() for kv in kv_caches), "capture wrote K/V into the cache"
    assert model.backend.piecewise is None  # the hook is gone after capture
    with torch.inference_mode():
        for kv in kv_caches:  # context for the prefix hits and decodes to attend over
            kv.normal_()
    upload = Uploader(cuda_device)
    for name, step in _steps(kv_caches[0].shape[1]):
        upload.next_step()
        t = upload_step(step.so, upload)
        tokens = t.input_ids.shape[0]
        assert runner.can_run(t.meta), name
        ids = torch.randint(0, 1000, (tokens,), device=cuda_device)
        with torch.inference_mode():
            before = [kv.clone() for kv in kv_caches]
            eager = model.forward(ids, t.positions, kv_caches, t.meta).clone()
            after_eager = [kv.clone() for kv in kv_caches]
            for kv, old in zip(kv_caches, before, strict=True):
                kv.copy_(old)
        graphed = runner.run(ids, t.positions, t.meta)
        assert graphed.shape == eager.shape and not graphed.isnan().any(), name
        assert relative_error(graphed, eager) < 2e-2, name
        # The same K/V rows written (up to bf16 rounding of the padded GEMMs); pad rows write nothing.
        for kv, ref in zip(kv_caches, after_eager, strict=True):
            torch.testing.assert_close(kv, ref, atol=5e-2, rtol=5e-2)
        size = runner.padded_size(tokens)
        if size > tokens:
            assert runner.input_ids[tokens:size].eq(0).all() and runner.positions[tokens:size].eq(0).all()
    too_long = RequestShape(65, 65)
    assert not runner.can_run(upload_step(build_step(Recipe("long", (too_long,)), EngineLimits(
        max_num_seqs=8, max_num_batched_tokens=128, max_model_len=1024, block_size=BLOCK,
        num_blocks=kv_caches[0].shape[1], decode_graph_max=8), vocab_size=1000).so, upload).meta)


@pytest.mark.gpu
def test_piecewise_sizes_clipped_to_the_cache(cuda_device):
    """A size whose dummy prefill does not fit the cache is not captured."""
    from ferrox.worker.piecewise_graphs import PiecewiseGraphRunner

    model, kv_caches = _tiny_llama(cuda_device)
    small = [kv[:, :4].contiguous() for kv in kv_caches]  # 3 usable blocks: prompts of < 48 tokens
    runner = PiecewiseGraphRunner(model, small, max_num_batched_tokens=512, block_size=BLOCK, device=cuda_device)
    assert runner.sizes == [8, 16, 32] and runner.max_tokens == 32
