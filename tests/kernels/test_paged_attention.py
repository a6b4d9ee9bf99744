"""Unified paged attention (and its split-KV path) against a per-request float32 reference."""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels import paged_attention as pa
from ferrox.kernels.paged_attention import _num_sms, choose_num_splits, unified_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache

from tests.kernels.kernel_refs import PagedBatch, paged_attention_ref, relative_error

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


def _run(batch: PagedBatch, num_splits: int | None = None) -> torch.Tensor:
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))  # poison: unwritten rows stay NaN
    unified_attention(
        batch.q,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
        out=out,
        num_splits=num_splits,
    )
    return out


def _check(batch: PagedBatch, dtype: torch.dtype, num_splits: int | None = None) -> torch.Tensor:
    out = _run(batch, num_splits)
    ref = paged_attention_ref(
        batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale
    )
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any(), "attention left output rows unwritten"
    err = relative_error(out[:n], ref[:n])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"
    return out


# (query_lens, context_lens, heads, kv_heads, head_dim, block_size, num_splits)
TINY_CASES = {
    "mixed-prefill-chunk-decode": ([7, 1, 1, 12], [0, 9, 33, 5], 4, 2, 32, 16, None),
    "decode-gqa3-dim24-block8": ([1, 1, 1], [70, 3, 40], 6, 2, 24, 8, None),
    "mha-block4": ([5, 1], [0, 60], 4, 4, 16, 4, None),
    "mqa-block32-forced-split": ([9, 1], [20, 80], 8, 1, 16, 32, 4),
    "block1-chunk-longer-than-tile": ([40, 1], [3, 2], 2, 1, 16, 1, None),
    "split-count-not-power-of-two": ([1, 3, 1], [200, 90, 7], 4, 2, 32, 16, 3),
}


@pytest.mark.parametrize("case", list(TINY_CASES), ids=list(TINY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_unified_attention_tiny(kernel_device, seed, case, dtype):
    if dtype == torch.bfloat16 and kernel_device.type == "cpu":
        # triton 3.9's interpreter computes tl.dot on bf16 as garbage (checked: 1e10 error on a
        # 16x16 product); bf16 runs natively on the GPU.
        pytest.skip("bf16 tl.dot is broken in the Triton interpreter")
    query_lens, context_lens, heads, kv_heads, head_dim, block_size, splits = TINY_CASES[case]
    batch = PagedBatch(
        query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, kernel_device, num_pad_tokens=2
    )
    _check(batch, dtype, splits)


def test_split_kv_is_chosen_and_matches_single_pass(kernel_device, seed):
    """One long decode on a (pretend or real) GPU: the heuristic splits, and split == unsplit."""
    batch = PagedBatch([1], [1500], 4, 2, 16, 16, torch.float32, kernel_device)
    assert choose_num_splits(2, batch.max_seq_len, _num_sms(kernel_device)) > 1
    split_out = _check(batch, torch.float32)
    single = _run(batch, num_splits=1)
    assert relative_error(split_out, single) < 1e-5


def test_heuristic_keeps_one_split_for_big_batches():
    assert choose_num_splits(num_programs=2048, max_seq_len=32768, num_sms=132) == 1
    assert choose_num_splits(num_programs=8, max_seq_len=256, num_sms=132) == 1


def test_heuristic_fills_the_gpu_at_batch_one():
    """Batch 1 at a long context: two waves of programs on all SMs (the H200 sweep's best region),
    and no split shorter than the minimum split length at shorter contexts."""
    num_sms, programs = 132, 8  # one query tile x 8 KV heads
    splits = choose_num_splits(num_programs=programs, max_seq_len=131072, num_sms=num_sms)
    assert programs * splits >= 2 * num_sms
    short = choose_num_splits(num_programs=programs, max_seq_len=4096, num_sms=num_sms)
    assert 1 < short <= 4096 // pa._MIN_SPLIT_LEN


def test_many_splits_merge_in_chunks(kernel_device, seed):
    """More splits than the merge kernel reads per step (and more splits than KV tiles: the empty
    ones must weigh nothing)."""
    batch = PagedBatch([1, 1], [700, 40], 4, 2, 16, 16, torch.float32, kernel_device)
    _check(batch, torch.float32, num_splits=pa._MERGE_CHUNK + 9)


def _graph_shaped_decode(batch: PagedBatch, num_splits: int, max_seq_len: int) -> torch.Tensor:
    """A decode-only step as a CUDA graph replays it: the split count and max_seq_len fixed for the
    graph (not the batch's), and its last request a padding row (slot -1, seq_len 0)."""
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    seq_lens = batch.seq_lens.clone()
    seq_lens[-1] = 0
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, batch.kv_cache, batch.query_start_loc, seq_lens, batch.block_table, max_query_len=1,
                      max_seq_len=max_seq_len, scale=batch.scale, out=out, num_splits=num_splits)
    return out


# (The many-split merge with stale partials covers its fresh case: a fresh buffer holds no NaN to leak.)
@pytest.mark.parametrize(("num_splits", "stale"), [(3, False), (3, True), (pa._MERGE_CHUNK + 5, True)],
                         ids=["3-fresh", "3-nan-partials", "69-nan-partials"])
def test_decode_splits_follow_each_context_not_the_graph_bound(kernel_device, seed, num_splits, stale, monkeypatch):
    """Contexts of one live split (the attention kernel writes the row, the merge leaves it), of
    several (300 tokens: 2 of 3 launched splits live), and a padding row: every real row matches the
    reference, the padding row is zeros. With nan-partials the partial buffers start as NaN, as a
    CUDA graph's pool may hand them over: the merge reads every launched partial and must drop the
    ones past a row's live splits, which nobody wrote."""
    batch = PagedBatch([1, 1, 1, 1], [9, 700, 300, 5], 4, 2, 16, 16, torch.float32, kernel_device)
    if stale:
        empty = torch.empty

        def nan_empty(*args, **kwargs):
            t = empty(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t

        monkeypatch.setattr(torch, "empty", nan_empty)
    batch.slot_mapping[-1] = -1
    out = _graph_shaped_decode(batch, num_splits, max_seq_len=4096)  # (this step's K/V now cached)
    ref = paged_attention_ref(batch.q[:3], batch.kv_cache, batch.query_start_loc[:4], batch.seq_lens[:3],
                              batch.block_table[:3], batch.scale)
    assert relative_error(out[:3], ref) < 1e-5
    assert torch.equal(out[3], torch.zeros_like(out[3]))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_unified_attention_llama8b_mixed_batch(cuda_device, seed, dtype):
    """Llama-3.1-8B heads (32 q / 8 kv, head_dim 128), block 16: two prefill chunks and 48 decodes."""
    decodes = 48
    query_lens = [512, 384] + [1] * decodes
    context_lens = [0, 3000] + torch.randint(1, 8192, (decodes,)).tolist()
    batch = PagedBatch(query_lens, context_lens, 32, 8, 128, 16, dtype, cuda_device, num_pad_tokens=8)
    _check(batch, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("batch_size", [1, 4])
def test_split_kv_llama8b_long_context(cuda_device, seed, batch_size):
    context_lens = torch.randint(16000, 32000, (batch_size,)).tolist()
    batch = PagedBatch([1] * batch_size, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device)
    assert choose_num_splits(batch_size * 8, batch.max_seq_len, _num_sms(cuda_device)) > 1
    _check(batch, torch.bfloat16)


@pytest.mark.gpu
def test_split_kv_decode_at_122k_context(cuda_device, seed):
    """Batch-1 decode at the issue's longest context, with the engine's heuristic split count."""
    batch = PagedBatch([1], [122879], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    assert choose_num_splits(8, batch.max_seq_len, _num_sms(cuda_device)) > 1
    _check(batch, torch.bfloat16)
    _check(batch, torch.bfloat16, num_splits=3 * pa._MERGE_CHUNK + 5)  # a merge over several chunks


@pytest.mark.gpu
def test_decode_attention_replays_in_cuda_graph(cuda_device, seed):
    """The decode path must be capturable: no host syncs, no data-dependent allocation."""
    batch = PagedBatch([1] * 8, torch.randint(100, 3000, (8,)).tolist(), 32, 8, 128, 16, torch.bfloat16, cuda_device)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))

    def step():
        unified_attention(
            batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
            max_query_len=1, max_seq_len=4096, scale=batch.scale, out=out,
        )

    step()  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    batch.q.copy_(torch.randn_like(batch.q))  # new inputs in the same static buffer
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]


def test_rejects_mismatched_heads(kernel_device):
    cache = torch.zeros(2, 4, 16, 3, 32, device=kernel_device)
    q = torch.zeros(2, 4, 32, device=kernel_device)
    loc = torch.tensor([0, 2], dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="num_kv_heads"):
        unified_attention(
            q, cache, loc, loc[1:], torch.zeros(1, 1, dtype=torch.int32, device=kernel_device),
            max_query_len=2, max_seq_len=2, scale=1.0,
        )
