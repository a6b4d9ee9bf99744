"""TritonAttentionBackend against the torch reference backend, through the shared interface."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.backend import get_attention_backend
from ferrox.attention.metadata import AttentionMetadata

from tests.kernels.kernel_refs import PagedBatch, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


def _meta(batch: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=batch.num_actual_tokens,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        slot_mapping=batch.slot_mapping,
        query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens,
        block_table=batch.block_table,
        query_start_loc_cpu=batch.query_start_loc.cpu(),
        seq_lens_cpu=batch.seq_lens.cpu(),
        decode_only=batch.max_query_len == 1,
    )


def _compare(batch: PagedBatch, dtype: torch.dtype, with_cache: bool = True, softcap: float = 0.0,
             window: int = 0) -> torch.Tensor:
    """The two backends' outputs agree (softcap: Gemma 2's score cap on both; window: a sliding window
    on both); the reference's output."""
    meta = _meta(batch)
    ref_cache = batch.kv_cache.clone() if with_cache else batch.kv_cache[:, :0]
    cache = batch.kv_cache if with_cache else batch.kv_cache[:, :0]
    torch_backend = get_attention_backend(batch.q.device, "torch")
    torch_backend.softcap = softcap
    ref = torch_backend.forward(batch.q, batch.k, batch.v, ref_cache, meta, batch.scale, window=window)
    triton_backend = get_attention_backend(batch.q.device, "triton")
    triton_backend.softcap = softcap
    assert triton_backend.name == "triton"
    triton_backend.begin_forward(meta)
    out = triton_backend.forward(batch.q, batch.k, batch.v, cache, meta, batch.scale, window=window)
    n = batch.num_actual_tokens
    assert torch.equal(cache, ref_cache), "the two backends wrote different KV caches"
    assert not out[:n].isnan().any()
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]
    return ref


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def test_backend_mixed_batch_matches_torch_backend(kernel_device, seed):
    dtype = _dtype(kernel_device)
    batch = PagedBatch([6, 1, 1, 9], [0, 20, 47, 13], 6, 2, 32, 16, dtype, kernel_device)
    _compare(batch, dtype)


def test_backend_decode_only_matches_torch_backend(kernel_device, seed):
    dtype = _dtype(kernel_device)
    batch = PagedBatch([1, 1, 1], [5, 90, 31], 4, 1, 16, 8, dtype, kernel_device)
    _compare(batch, dtype)


def test_backend_without_cache_matches_torch_backend(kernel_device, seed):
    """The profiling forward: no KV cache, every request a fresh prompt."""
    dtype = _dtype(kernel_device)
    batch = PagedBatch([5, 11, 3], [0, 0, 0], 4, 2, 32, 16, dtype, kernel_device)
    _compare(batch, dtype, with_cache=False)


@pytest.mark.parametrize("query_lens, context_lens", [
    ([1, 1, 1], [5, 90, 31]),  # decode-only: the unified kernel (the CUDA decode kernel has no cap)
    ([1, 150, 3], [40, 20, 7]),  # a long chunk: the prefill kernel's unmasked and masked tiles
])
def test_backend_softcap_matches_torch_backend(kernel_device, seed, query_lens, context_lens):
    """Gemma 2's attention logit cap (softcap * tanh(score / softcap)) in both Triton kernels."""
    dtype = _dtype(kernel_device)
    batch = PagedBatch(query_lens, context_lens, 4, 2, 32, 16, dtype, kernel_device)
    capped = _compare(batch, dtype, softcap=0.7)
    plain = _compare(batch, dtype)  # (the same inputs: rewriting the cache writes the same rows)
    assert relative_error(capped, plain) > 10 * TOLERANCE[dtype]  # the cap matters at these scores


@pytest.mark.parametrize("query_lens, context_lens, window", [
    ([1, 1, 1], [5, 90, 31], 16),  # decode-only: the unified kernel (the CUDA decode kernel has no window)
    ([1, 150, 3], [40, 20, 7], 37),  # a long chunk: the prefill kernel, tiles across the window's edge
    ([6, 1, 9], [0, 20, 47], 4),  # a window shorter than the chunks
    ([5, 11, 3], [0, 0, 0], 200),  # a window longer than every request: full attention
])
def test_backend_sliding_window_matches_torch_backend(kernel_device, seed, query_lens, context_lens, window):
    """A query at position p attends keys p - window < k <= p, in both Triton kernels."""
    dtype = _dtype(kernel_device)
    batch = PagedBatch(query_lens, context_lens, 4, 2, 32, 16, dtype, kernel_device)
    windowed = _compare(batch, dtype, window=window)
    full = _compare(batch, dtype)
    if window < max(c + q for c, q in zip(context_lens, query_lens, strict=True)):
        assert relative_error(windowed, full) > 10 * TOLERANCE[dtype]  # the window matters here
    else:
        assert relative_error(windowed, full) < TOLERANCE[dtype]


def test_split_kv_decode_with_a_window_matches_torch_backend(kernel_device, seed):
    """Split-KV: the splits before the window hold nothing and weigh nothing in the merge."""
    from ferrox.kernels.paged_attention import unified_attention

    dtype = _dtype(kernel_device)
    batch = PagedBatch([1, 1], [300, 41], 4, 2, 32, 16, dtype, kernel_device)
    ref = _compare(batch, dtype, window=50)
    meta = _meta(batch)
    out = unified_attention(batch.q, batch.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                            max_query_len=1, max_seq_len=batch.max_seq_len, scale=batch.scale, num_splits=4,
                            window=50)
    assert relative_error(out[:2], ref[:2]) < TOLERANCE[dtype]


def test_cuda_device_picks_triton():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    assert get_attention_backend("cuda").name == "triton"


@pytest.mark.gpu
def test_backend_llama8b_mixed_batch(cuda_device, seed):
    query_lens = [1024, 200] + [1] * 64
    context_lens = [0, 2000] + torch.randint(1, 6000, (64,)).tolist()
    batch = PagedBatch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device)
    _compare(batch, torch.bfloat16)
