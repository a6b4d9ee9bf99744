"""The torch paged-attention backend against a naive dense reference (float64 softmax attention
over each request's full K/V), on mixed batches of fresh prefills, chunks with cached context and
decodes, GQA, shuffled block tables and several block sizes."""

from __future__ import annotations

import math

import pytest
import torch
from ferrox.attention.backend import get_attention_backend
from ferrox.attention.metadata import AttentionMetadata

H, HKV, D = 6, 2, 16


def _reference(q, k_all, v_all, context_len):
    """q [Lq, H, D] at positions context_len.., k_all/v_all [L, HKV, D]; causal, GQA."""
    group = H // HKV
    k = k_all.double().repeat_interleave(group, dim=1)
    v = v_all.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(D)
    q_pos = torch.arange(context_len, context_len + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _run_case(requests, block_size, *, pad_tokens=0, seed=0):
    """requests: list of (context_len, query_len). Returns (backend output, reference) for the
    real (unpadded) rows."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // block_size) for c, q in requests]
    num_blocks = 1 + sum(blocks_needed) + 3
    # Shuffled, non-contiguous block ids (block 0 is the null block).
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.zeros(2, num_blocks, block_size, HKV, D)
    tables, ctx_kv, qs, ks, vs, slots, starts, seq_lens = [], [], [], [], [], [], [0], []
    for (context, q_len), n in zip(requests, blocks_needed, strict=True):
        table = [perm.pop() for _ in range(n)]
        tables.append(table)
        ck, cv = torch.randn(context, HKV, D, generator=gen), torch.randn(context, HKV, D, generator=gen)
        for p in range(context):  # prior context already in the cache
            cache[0, table[p // block_size], p % block_size] = ck[p]
            cache[1, table[p // block_size], p % block_size] = cv[p]
        ctx_kv.append((ck, cv))
        qs.append(torch.randn(q_len, H, D, generator=gen))
        ks.append(torch.randn(q_len, HKV, D, generator=gen))
        vs.append(torch.randn(q_len, HKV, D, generator=gen))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(context, context + q_len)]
        starts.append(starts[-1] + q_len)
        seq_lens.append(context + q_len)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    n_tokens = q.shape[0]
    if pad_tokens:  # rows past num_actual_tokens (CUDA-graph padding): ignored, never written
        q = torch.cat([q, torch.randn(pad_tokens, H, D, generator=gen)])
        k = torch.cat([k, torch.randn(pad_tokens, HKV, D, generator=gen)])
        v = torch.cat([v, torch.randn(pad_tokens, HKV, D, generator=gen)])
        slots += [0] * pad_tokens
    table_t = torch.zeros(len(requests), max(blocks_needed), dtype=torch.int32)
    for i, t in enumerate(tables):
        table_t[i, :len(t)] = torch.tensor(t)
    qsl, sl = torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        num_actual_tokens=n_tokens, max_query_len=max(q for _, q in requests), max_seq_len=max(seq_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64), query_start_loc=qsl, seq_lens=sl, block_table=table_t,
        query_start_loc_cpu=qsl, seq_lens_cpu=sl, decode_only=all(q == 1 for _, q in requests),
    )
    backend = get_attention_backend("cpu", "torch")
    backend.begin_forward(meta)
    out = backend.forward(q, k, v, cache, meta, 1 / math.sqrt(D))
    assert out.shape == q.shape
    refs = []
    for i, (context, _) in enumerate(requests):
        ck, cv = ctx_kv[i]
        refs.append(_reference(qs[i], torch.cat([ck, ks[i]]), torch.cat([cv, vs[i]]), context))
        # the step's k/v landed in the cache at the request's slots
        for j, p in enumerate(range(context, seq_lens[i])):
            torch.testing.assert_close(cache[0, tables[i][p // block_size], p % block_size], ks[i][j])
            torch.testing.assert_close(cache[1, tables[i][p // block_size], p % block_size], vs[i][j])
    return out[:n_tokens], torch.cat(refs).float()


MIXED = [(0, 5), (7, 4), (20, 1), (33, 1), (0, 1), (16, 16), (3, 1)]


@pytest.mark.parametrize("block_size", [16, 8, 5])
def test_mixed_prefill_chunks_and_decodes(block_size):
    out, ref = _run_case(MIXED, block_size)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_only_batch_of_different_lengths(block_size):
    out, ref = _run_case([(1, 1), (40, 1), (17, 1), (64, 1)], block_size, seed=1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_decodes_after_prefills_and_padding_rows():
    # Decodes not leading the batch (index path) and padded rows past num_actual_tokens.
    out, ref = _run_case([(0, 3), (9, 1), (4, 6), (30, 1)], 8, pad_tokens=3, seed=2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_single_decode_and_single_prefill():
    for case in ([(50, 1)], [(0, 37)], [(21, 9)]):
        out, ref = _run_case(case, 16, seed=3)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_empty_cache_profiling_forward():
    # A profiling run before the cache exists: fresh prompts attend over their own k/v only.
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(10, h, D, generator=gen) for h in (H, HKV, HKV))
    qsl, sl = torch.tensor([0, 4, 9, 10], dtype=torch.int32), torch.tensor([4, 5, 1], dtype=torch.int32)
    meta = AttentionMetadata(num_actual_tokens=10, max_query_len=5, max_seq_len=5,
                             slot_mapping=torch.zeros(10, dtype=torch.int64), query_start_loc=qsl, seq_lens=sl,
                             block_table=torch.zeros(3, 1, dtype=torch.int32), query_start_loc_cpu=qsl,
                             seq_lens_cpu=sl)
    out = get_attention_backend("cpu").forward(q, k, v, torch.empty(0), meta, 1 / math.sqrt(D))
    ref = torch.cat([_reference(q[a:b], k[a:b], v[a:b], 0) for a, b in ((0, 4), (4, 9), (9, 10))]).float()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="attention backend 'nope'"):
        get_attention_backend("cpu", "nope")
