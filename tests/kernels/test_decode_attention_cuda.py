"""cuda/decode_attention.cu (kernels/decode_attention_cuda.py) against the float32 reference and the Triton
kernel it stands in for: ragged contexts (0, one position, tile edges, thousands), block tables with holes,
GQA groups of 1-16, head dims 64 and 128, block sizes 16 and 64, split counts from 1 to the cap, CUDA-graph
launches for a long max_seq_len replaying short contexts, and a cache poisoned with NaN outside every
request (a kernel reading past a context, or trusting unwritten partials, fails)."""

from __future__ import annotations

import os

import pytest
import torch
from ferrox.kernels import decode_attention_cuda as dac
from ferrox.kernels import nvrtc
from ferrox.kernels.cuda_sampling import PACKAGED_SOURCE_DIR
from ferrox.kernels.paged_attention import unified_attention

from tests.kernels.kernel_refs import PagedBatch, paged_attention_ref, relative_error
from tests.kernels.test_kv_fp8 import fp8_cache, scales_tensor

TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


@pytest.mark.skipif(nvrtc.bindings() is None, reason="cuda-bindings (NVRTC) not installed")
@pytest.mark.parametrize("act", ["Bf16", "F16"])
def test_module_compiles_for_hopper(tmp_path, monkeypatch, act):
    """Every kernel the module declares compiles for sm_90 (no GPU needed: NVRTC only)."""
    monkeypatch.setenv("FERROX_CACHE_DIR", str(tmp_path))
    source = dac.module_source(act, (PACKAGED_SOURCE_DIR / dac.SOURCE_NAME).read_text())
    assert len(nvrtc.compile_cubin(source, "sm_90", (), "decode_attention_test.cu")) > 0


def test_split_plan():
    """The host twin of the kernel's plan: one split up to single_max, then whole tiles of at least
    min_split, fewer live splits than launched for short contexts, none for an empty request."""
    assert dac.live_splits(0, 33, 64, 0) == 0
    assert dac.live_splits(1, 33, 64, 0) == 1
    assert dac.live_splits(64, 33, 64, 0) == 1
    assert dac.live_splits(65, 33, 64, 0) == 2
    assert dac.live_splits(160, 33, 64, 0) == 3
    assert dac.live_splits(160, 33, 64, 512) == 1
    assert dac.live_splits(512, 16, 128, 512) == 1
    assert dac.live_splits(513, 16, 128, 512) == 5
    assert dac.live_splits(122880, 33, 64, 512) == 33
    assert dac.live_splits(5000, 1, 64, 512) == 1


def test_split_count_fills_the_gpu_only_when_it_is_not_full():
    cfg = dac.DecodeAttentionConfig(warps=4, stages=4, min_split=64, single_max=0, waves=1.0, signal=2)
    assert dac.choose_num_splits(8, 131072, cfg, 1, 132) == 16  # batch 1, 8 KV heads: one wave of 132 SMs, not 136
    assert dac.choose_num_splits(8, 100, cfg, 1, 132) == 2  # never shorter than min_split
    assert dac.choose_num_splits(1024, 131072, cfg, 1, 132) == 1
    assert dac.choose_num_splits(8, 512, dac.CONFIG, 1, 132) == 1  # one split up to single_max: nothing to launch


def test_refuses_what_it_cannot_take():
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 16, 2, 128, dtype=torch.bfloat16)
    lens = torch.ones(1, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    assert not dac.supported(q, cache, lens, table, None)  # the CPU


@pytest.mark.gpu
def test_takes_16_bit_caches_and_leaves_the_rest_to_triton(cuda_device):
    q = torch.zeros(1, 8, 128, dtype=torch.bfloat16, device=cuda_device)
    lens = torch.ones(1, dtype=torch.int32, device=cuda_device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=cuda_device)

    def cache(block_size=16, head_dim=128, dtype=torch.bfloat16):
        return torch.zeros(2, 4, block_size, 2, head_dim, dtype=dtype, device=cuda_device)

    ones = torch.ones(2, device=cuda_device)
    assert dac.supported(q, cache(), lens, table, ones)  # a 16-bit cache ignores its (unit) scales
    assert dac.supported(q, cache(dtype=torch.float8_e4m3fn), lens, table, ones)
    assert not dac.supported(q[..., :64], cache(head_dim=64, dtype=torch.float8_e4m3fn), lens, table, ones)
    assert not dac.supported(q, cache(dtype=torch.float8_e5m2), lens, table, ones)
    assert not dac.supported(q, cache(block_size=8), lens, table, None)
    assert not dac.supported(q, cache(block_size=48), lens, table, None)
    assert not dac.supported(q[..., :96], cache(head_dim=96), lens, table, None)
    assert not dac.supported(q, cache(), lens.long(), table, None)


def _decode_batch(context_lens, heads, kv_heads, head_dim, block_size, dtype, device, poison=True):
    batch = PagedBatch([1] * len(context_lens), [max(c - 1, 0) for c in context_lens], heads, kv_heads, head_dim,
                       block_size, dtype, device)
    if poison:  # every slot outside the requests' positions (the null block, spares, block tails) is NaN
        live = torch.zeros(batch.kv_cache.shape[1] * block_size, dtype=torch.bool, device=device)
        for r, n in enumerate(batch.seq_lens_list):
            pos = torch.arange(n, device=device)
            live[batch.block_table[r, pos // block_size].long() * block_size + pos % block_size] = True
        flat = batch.kv_cache.view(2, -1, kv_heads, head_dim)
        flat[:, ~live] = float("nan")
    return batch


def _cuda(batch, out=None, max_seq_len=None, **kwargs):
    out = torch.full_like(batch.q, float("nan")) if out is None else out
    return dac.decode_attention(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table,
                                max_seq_len=max_seq_len or batch.max_seq_len, scale=batch.scale, out=out, **kwargs)


def _ref(batch):
    return paged_attention_ref(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                               batch.scale)


def _assert_close(out, batch, dtype, rows=None):
    ref = _ref(batch)
    rows = [r for r, n in enumerate(batch.seq_lens_list) if n > 0] if rows is None else rows
    assert not out[rows].isnan().any()
    assert relative_error(out[rows], ref[rows]) < TOLERANCE[dtype]


CASES = {  # (context lengths, heads, kv heads, head dim, block size)
    "llama8b": ([1, 15, 16, 17, 63, 64, 65, 300, 512, 513, 4097], 32, 8, 128, 16),
    "qwen3moe-gqa8": ([1, 160, 1000, 2049], 32, 4, 128, 16),
    "mha-d64": ([5, 130, 777], 4, 4, 64, 16),
    "gqa16-block64": ([3, 64, 65, 1500], 16, 1, 128, 64),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_matches_the_reference(cuda_device, seed, case, dtype):
    lens, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = _decode_batch(lens, heads, kv_heads, head_dim, block_size, dtype, cuda_device)
    assert dac.supported(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, None)
    for splits in (None, 1, 2, 7, 64, dac.MAX_SPLITS):
        _assert_close(_cuda(batch, num_splits=splits), batch, dtype)
    counters = dac._counters[cuda_device.index or 0]
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0  # every merging block reset its counter


@pytest.mark.gpu
@pytest.mark.parametrize("warps,stages", dac._COMPILED)
def test_every_compiled_config(cuda_device, seed, warps, stages):
    batch = _decode_batch([1, 33, 700, 9000], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    for min_split, single_max in ((16, 0), (64, 512), (256, 0)):
        cfg = dac.DecodeAttentionConfig(warps, stages, min_split, single_max, 1.0, 2)
        _assert_close(_cuda(batch, config=cfg), batch, torch.bfloat16)


@pytest.mark.gpu
def test_unified_attention_routes_decodes_here(cuda_device, seed, monkeypatch):
    """The engine's entry point takes the CUDA kernel for decode-only calls and agrees with the Triton
    kernel (switched off by FERROX_CUDA_DECODE_ATTN=0) to within rounding."""
    batch = _decode_batch([7, 250, 3000], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    calls = []
    real = dac.decode_attention
    monkeypatch.setattr(dac, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))

    def attend():
        return unified_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                 max_query_len=1, max_seq_len=131072, scale=batch.scale)

    ours = attend()
    monkeypatch.setenv("FERROX_CUDA_DECODE_ATTN", "0")
    triton = attend()
    assert len(calls) == 1
    assert relative_error(ours, triton) < 1e-2
    _assert_close(ours, batch, torch.bfloat16)


@pytest.mark.gpu
def test_graph_replays_short_contexts_under_a_long_bound(cuda_device, seed):
    """A graph captured for max_model_len 131072 (33+ splits launched) replays contexts from 0 to 20k, with
    padding rows of length 0, and the counters stay consistent across replays."""
    batch = _decode_batch([1, 100, 5000, 20000], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    out = torch.full_like(batch.q, float("nan"))
    _cuda(batch, out=out, max_seq_len=131072)  # load the module outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _cuda(batch, out=out, max_seq_len=131072)
    for lens in ([1, 100, 5000, 20000], [0, 64, 65, 0], [1, 17, 4999, 19999]):  # within each table row
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        batch.seq_lens_list = lens
        batch.q.copy_(torch.randn_like(batch.q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, batch, torch.bfloat16)
    assert int(dac._counters[cuda_device.index or 0].abs().sum()) == 0


@pytest.mark.gpu
def test_a_batch_that_fills_the_gpu(cuda_device, seed):
    """200 requests x 8 KV heads, ragged contexts around the one-block limit: BATCH_CONFIG's blocks, one
    split each; 8 requests stay on CONFIG."""
    lens = torch.randint(1, 1200, (200,)).tolist()
    batch = _decode_batch(lens, 32, 8, 128, 16, torch.bfloat16, cuda_device)
    assert dac.supported(batch.q, batch.kv_cache, batch.seq_lens, batch.block_table, None)
    assert dac.config_for(200 * 8, cuda_device) == dac.BATCH_CONFIG
    assert dac.config_for(8, cuda_device) == dac.CONFIG
    d64 = _decode_batch(lens, 32, 8, 64, 16, torch.bfloat16, cuda_device, poison=False)
    assert not dac.supported(d64.q, d64.kv_cache, d64.seq_lens, d64.block_table, None)  # BATCH_HEAD_DIMS
    _assert_close(_cuda(batch), batch, torch.bfloat16)
    assert int(dac._counters[cuda_device.index or 0].abs().sum()) == 0


FP8_CASES = [c for c in CASES if CASES[c][3] in dac.FP8_HEAD_DIMS]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_cache_matches_the_dequantized_reference(cuda_device, seed, case, dtype):
    """An E4M3 cache with scales that are not powers of two (a missed or doubled one shows): the kernel
    against attention over the dequantized cache, every split count, every compiled config, and through
    unified_attention against the Triton kernel."""
    lens, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = _decode_batch(lens, heads, kv_heads, head_dim, block_size, dtype, cuda_device)
    cache, deq = fp8_cache(batch.kv_cache)
    scales = scales_tensor(cuda_device)
    assert dac.supported(batch.q, cache, batch.seq_lens, batch.block_table, scales)
    ref = paged_attention_ref(batch.q, deq, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    rows = [r for r, n in enumerate(lens) if n > 0]

    def check(out):
        assert not out[rows].isnan().any()
        assert relative_error(out[rows], ref[rows]) < TOLERANCE[dtype]

    def cuda(**kwargs):
        return dac.decode_attention(batch.q, cache, batch.seq_lens, batch.block_table, max_seq_len=batch.max_seq_len,
                                    scale=batch.scale, out=torch.full_like(batch.q, float("nan")), kv_scale=scales,
                                    **kwargs)

    for splits in (None, 1, 7, dac.MAX_SPLITS):
        check(cuda(num_splits=splits))
    for warps, stages in dac._COMPILED:
        check(cuda(config=dac.DecodeAttentionConfig(warps, stages, 64, 512, 1.0, 2)))

    def attend():
        return unified_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                 max_query_len=1, max_seq_len=batch.max_seq_len, scale=batch.scale, kv_scale=scales)

    ours = attend()
    os.environ["FERROX_CUDA_DECODE_ATTN"] = "0"
    try:
        triton = attend()
    finally:
        del os.environ["FERROX_CUDA_DECODE_ATTN"]
    check(ours)
    assert relative_error(ours[rows], triton[rows]) < TOLERANCE[dtype]
    torch.cuda.synchronize()
    assert int(dac._counters[cuda_device.index or 0].abs().sum()) == 0


@pytest.mark.gpu
def test_long_context_at_the_split_cap(cuda_device, seed):
    batch = _decode_batch([122879], 32, 8, 128, 16, torch.bfloat16, cuda_device, poison=False)
    _assert_close(_cuda(batch), batch, torch.bfloat16)
    _assert_close(_cuda(batch, num_splits=dac.MAX_SPLITS), batch, torch.bfloat16)
