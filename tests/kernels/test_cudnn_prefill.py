"""Long prefill chunks through cuDNN (kernels/cudnn_prefill.py).

The merge of two attention parts runs under the Triton interpreter on CPU against a float64
softmax over the union of both key sets; the FP8 cache's gather-and-widen and scale folding run on
CPU through the backend with cuDNN's call replaced by a torch softmax (the rest of the path real). On an H200 the cuDNN path runs at real shapes against the
Triton prefill kernel and the float32 reference (ragged chunks, block tables with holes, GQA 4 and
8, head_dim 64 and 128), and through the attention backend with decodes leading the batch.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.triton_backend import TritonAttentionBackend, _plan_step
from ferrox.kernels import cudnn_prefill
from ferrox.kernels.cudnn_prefill import CUDNN_MIN_LEN, merge_attention_parts, plan_buckets
from ferrox.kernels.prefill_attention import prefill_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache

from tests.helpers.interpreter import prefill_kernel_from
from tests.kernels.kernel_refs import PagedBatch, relative_error, sliced_paged_attention_ref
from tests.kernels.test_kv_fp8 import FP8, K_SCALE, V_SCALE, fp8_cache, layer_scales, scales_tensor
from tests.kernels.test_prefill_attention import _meta


def _part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """float64 attention of q [T, H, D] over k/v [S, H, D] (no mask): (out [T, H, D], lse [H, T])."""
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), v.double())
    return out, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens, heads, head_dim, out_scale", [(37, 3, 16, 1.0), (5, 2, 24, V_SCALE)],
                         ids=["ragged", "dim24-scaled"])
def test_merge_matches_attention_over_both_key_sets(kernel_device, seed, dtype, tokens, heads, head_dim,
                                                     out_scale):
    q = torch.randn(tokens, heads, head_dim, device=kernel_device)
    k = 2 * torch.randn(29, heads, head_dim, device=kernel_device)  # wide scores: the parts' lse differ
    v = torch.randn(29, heads, head_dim, device=kernel_device)
    scale = head_dim ** -0.5
    a, lse_a = _part(q, k[:11], v[:11], scale)
    b, lse_b = _part(q, k[11:], v[11:], scale)
    expected, _ = _part(q, k, v, scale)
    # The parts as cuDNN returns them: [1, H, T, D] over token-major storage, seen as [T, H, D].
    a_buf = a.to(dtype).transpose(0, 1).contiguous().transpose(0, 1)  # head-major storage: other strides
    out = torch.full((tokens, heads, head_dim), float("nan"), dtype=dtype, device=kernel_device)
    lse_a_token_major = lse_a.float().t().contiguous().t()  # cuDNN's ragged path: [H, T] over [T, H]
    merge_attention_parts(out, a_buf, lse_a_token_major, b.to(dtype), lse_b.float().contiguous(), out_scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out.double(), expected * out_scale) < tol


def test_merge_names_the_bad_argument():
    out = torch.empty(4, 2, 8)
    good_lse = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="lse_b must be float32"):
        merge_attention_parts(out, out, good_lse, out, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="a must be"):
        merge_attention_parts(out, torch.empty(4, 2, 4), good_lse, out, good_lse)


@pytest.mark.parametrize("contiguous", [True, False], ids=["cache", "strided-cache"])
def test_gather_context_follows_the_block_table(contiguous):
    """Runs on any device (plain torch): positions 0..context-1 of a request whose blocks are scattered."""
    cache = torch.randn(2, 9, 4, 2, 8)
    if not contiguous:
        cache = torch.randn(2, 9, 4, 3, 8)[:, :, :, :2]
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    k, v = cudnn_prefill.gather_context(cache, blocks, 10)
    assert k.is_contiguous() and v.is_contiguous() and k.shape == (10, 2, 8)
    for pos in range(10):
        block, offset = int(blocks[pos // 4]), pos % 4
        assert torch.equal(k[pos], cache[0, block, offset]) and torch.equal(v[pos], cache[1, block, offset])


def test_gather_widened_reads_an_fp8_cache_exactly():
    """Runs on any device (plain torch): both planes of positions 0..length-1, widened without rounding."""
    cache = (torch.randn(2, 9, 4, 2, 8) * 40).to(FP8)
    blocks = torch.tensor([5, 2, 7], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        kv = cudnn_prefill.gather_widened(cache, blocks, 10, dtype)
        assert kv.shape == (2, 10, 2, 8) and kv.dtype == dtype and kv.is_contiguous()
        for pos in range(10):
            block, offset = int(blocks[pos // 4]), pos % 4
            assert torch.equal(kv[:, pos].float(), cache[:, block, offset].float())


def _torch_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """cudnn_prefill._attend's contract in float64 torch (q [1, H, T, D]; k/v [S, Hkv, D]): what the
    CPU tests put in place of the cuDNN call, to run the rest of the path."""
    group = q.shape[1] // k.shape[1]
    kh = k.double().transpose(0, 1).repeat_interleave(group, 0)
    vh = v.double().transpose(0, 1).repeat_interleave(group, 0)
    scores = q[0].double() @ kh.transpose(1, 2) * scale
    if causal:  # square, top-left: the chunk over its own rows
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vh
    return out.unsqueeze(0).to(q.dtype), torch.logsumexp(scores, dim=-1).float()


# Chunks of LONG tokens or more take the prefill kernel's plan (PREFILL_MIN_QUERY_LEN, 128 in production) and
# cuDNN (CUDNN_MIN_LEN): chunks the interpreter runs in a second, the cuts around them as in production.
LONG = 40


def long_chunks_from(monkeypatch, tokens: int) -> None:
    prefill_kernel_from(monkeypatch, tokens)
    monkeypatch.setattr(cudnn_prefill, "CUDNN_MIN_LEN", tokens)


def test_fp8_cache_chunks_read_the_cache_widened_with_scales_folded(kernel_device, seed, monkeypatch):
    """An FP8 cache through the backend's cuDNN path (cuDNN's call replaced by a torch softmax): the
    chunks' own rows and contexts are read back from the cache and widened, k_scale joins the softmax
    scale and v_scale the output, so the step agrees with the Triton kernels over the same cache and
    with attention over the hand-dequantized cache; both backends write the same bytes."""
    long_chunks_from(monkeypatch, LONG)
    monkeypatch.setattr(cudnn_prefill, "_attend", _torch_attend)
    calls: list[tuple[float, float] | None] = []  # kv_scales, the tenth argument
    real = cudnn_prefill.cudnn_prefill_request
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", lambda *a: (calls.append(a[9]), real(*a))[1])
    batch = PagedBatch([1, LONG + 2, LONG + 8], [9, 0, LONG + 10], 4, 2, 16, 16, torch.float32, kernel_device)
    cache, deq = fp8_cache(batch.kv_cache)
    meta = _meta(batch)
    off_cache, on_cache = cache.clone(), cache.clone()
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, off_cache, meta, batch.scale,
                                                layer_scales(kernel_device))
    backend = TritonAttentionBackend()
    backend._long_block_size = 16  # the path on, as _decide_long_path sets it on an sm90 GPU
    out = backend.forward(batch.q, batch.k, batch.v, on_cache, meta, batch.scale, layer_scales(kernel_device))
    assert calls == [pytest.approx((K_SCALE, V_SCALE))] * 2  # (float32 scales as host numbers)
    assert torch.equal(on_cache.view(torch.uint8), off_cache.view(torch.uint8))
    assert relative_error(out, expected) < 1e-5
    # the reference over the written cache, dequantized by hand
    batch.kv_cache = torch.stack((on_cache[0].float() * K_SCALE, on_cache[1].float() * V_SCALE))
    assert relative_error(out, sliced_paged_attention_ref(batch)) < 1e-5
    assert deq.shape == batch.kv_cache.shape


def test_plan_buckets_cover_every_reachable_length():
    chunks, contexts = plan_buckets(8192, 131072)
    assert chunks == [1024, 2048, 4096, 8192]
    assert contexts[0] == CUDNN_MIN_LEN and contexts[-1] == 131072
    assert plan_buckets(512, 131072) == ([], [])  # token budget below the cut: the path is never taken
    assert plan_buckets(8192, 1500)[0] == [1024, 2048]  # a chunk can't be longer than the model
    for query, context in ((1024, 0), (5000, 1024), (8192, 122880 - 8192)):
        assert cudnn_prefill.takes_cudnn_path(query, context)
    for query, context in ((1023, 0), (4096, 1023), (4096, 7)):
        assert not cudnn_prefill.takes_cudnn_path(query, context)


def test_exact_plans_cover_a_long_prompt_cut_into_whole_chunks():
    # A 122,880-token prompt in 8192-token chunks sees contexts 8192, ..., 114,688: all built.
    contexts = cudnn_prefill.exact_contexts(8192, 131072)
    assert contexts == [j * 8192 for j in range(1, 16)]
    assert all(cudnn_prefill.takes_exact_plan(8192, c, 8192) for c in range(8192, 122880, 8192))
    assert not cudnn_prefill.takes_exact_plan(8192, 0, 8192)  # the first chunk: no context part
    # The last, shorter chunk, a chunk beside decodes, a prefix hit off the grid: their buckets.
    for query, context in ((8192 - 3, 8192), (5000, 114688), (8192, 8192 + 16)):
        assert not cudnn_prefill.takes_exact_plan(query, context, 8192)
    assert not cudnn_prefill.takes_exact_plan(8192, 8192, 0)  # no warm-up, no exact plans
    assert cudnn_prefill.exact_contexts(512, 131072) == []  # chunks under the cut never take cuDNN
    assert cudnn_prefill.exact_contexts(1024, 131072) == []  # 128 plans: too many to build
    assert cudnn_prefill.exact_contexts(8192, 4096) == []  # a chunk longer than the model


def test_scratch_reserve_covers_the_largest_gather():
    # Llama-3.1-8B heads, bf16, 8192-token chunks, 128k context: the gathered K/V alone is ~0.5 GiB.
    reserve = cudnn_prefill.scratch_bytes(32, 8, 128, 2, 8192, 131072)
    gathered = 2 * (131072 - CUDNN_MIN_LEN) * 8 * 128 * 2
    assert gathered < reserve < gathered + (512 << 20)  # + q/k/v copies, two outputs, workspace
    assert cudnn_prefill.scratch_bytes(32, 8, 128, 2, 512, 131072) == 0  # chunks never reach the cut
    # An FP8 cache gathers the chunk's rows too, as bytes, then widens them: half as much again.
    fp8 = cudnn_prefill.scratch_bytes(32, 8, 128, 2, 8192, 131072, fp8_cache=True)
    assert fp8 - reserve >= gathered // 2


def test_step_plan_divides_requests_between_cudnn_and_the_prefill_kernel():
    cpu = torch.device("cpu")
    batch = PagedBatch([1, 1, 1100, 1030], [40, 8, 0, 2000], 4, 1, 16, 16, torch.float32, cpu)
    plan = _plan_step(_meta(batch), block_size=16)
    assert plan.num_decodes == 2
    assert plan.long_requests == ((2, 2, 1102, 0, 0), (3, 1102, 2132, 2000, 125))
    assert plan.prefill_runs == ()
    assert _plan_step(_meta(batch)).long_requests == ()  # off for this backend
    # Short chunks (and a context under the cut) beside long ones: runs of consecutive requests.
    mixed = PagedBatch([1, 200, 300, 1100, 1024, 5000], [40, 0, 3000, 0, 500, 4096], 4, 1, 16, 16, torch.float32, cpu)
    plan = _plan_step(_meta(mixed), block_size=16)
    assert [c[0] for c in plan.long_requests] == [3, 5]
    assert plan.prefill_runs == ((1, 3, 1, 501), (4, 5, 1601, 2625))
    short = PagedBatch([1, 200, 300], [40, 0, 3000], 4, 1, 16, 16, torch.float32, cpu)
    assert _plan_step(_meta(short), block_size=16).long_requests == ()


def test_a_cudnn_failure_falls_back_to_the_prefill_kernel(kernel_device, seed, monkeypatch, caplog):
    """A step whose cuDNN call raises (as cuDNN does for a shape it has no plan for) is attended by the
    Triton kernels instead, and the backend keeps them; nothing reaches the step's requests."""
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    long_chunks_from(monkeypatch, LONG)
    batch = PagedBatch([1, LONG + 2], [9, 0], 2, 1, 16, 16, dtype, kernel_device)
    meta = _meta(batch)
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, batch.scale)

    def refuse(*args):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", refuse)
    backend = TritonAttentionBackend()
    backend._long_block_size = 16  # the path on, as _decide_long_path sets it on an sm90 GPU
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, batch.scale)
    assert torch.equal(out, expected)
    assert backend._long_block_size == 0 and "cuDNN attention failed" in caplog.text


def test_exact_plans_failing_to_build_keep_the_buckets(monkeypatch, caplog):
    """The exact-shape plans are an extra: if cuDNN refuses them, whole chunks take their buckets and
    the cuDNN path stays on."""
    def refuse(*args):
        raise RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    monkeypatch.setattr(cudnn_prefill, "warm_up_plans", lambda *args: 7)
    monkeypatch.setattr(cudnn_prefill, "warm_up_exact_plans", refuse)
    backend = TritonAttentionBackend()
    backend._long_block_size = 16  # the path on, as _decide_long_path sets it on an sm90 GPU
    backend._long_shape = (32, 8, 128, torch.bfloat16, torch.device("cpu"))
    assert backend.warm_up_plans(8192, 131072) == 7
    assert backend._long_block_size == 16 and backend._cudnn_exact_chunk == 0
    assert "whole chunks take their length buckets" in caplog.text


# ---------------------------------------------------------------------------------------------- GPU


def _cudnn_or_skip(device: torch.device) -> None:
    if not cudnn_prefill.cudnn_prefill_supported(device, torch.bfloat16, 128):
        pytest.skip("the cuDNN prefill path needs an sm90 GPU with cuDNN 9")
    cudnn_prefill.enable_bucketed_plans()


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True], ids=["bucketed", "exact"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(32, 8, 128, 16), (32, 4, 64, 16),
                                                                    (28, 4, 128, 128), (16, 2, 64, 32)],
                         ids=["llama8b", "gqa8-dim64", "qwen-block128", "gqa8-block32"])
def test_cudnn_request_matches_the_prefill_kernel(cuda_device, seed, dtype, heads, kv_heads, head_dim, block_size,
                                                  exact):
    """Requests of ragged lengths (a fresh prompt, chunks after contexts that end mid-block) in a
    cache whose blocks are a random permutation: every row against the float32 reference and the
    Triton prefill kernel, with the query batch-major (a bucketed plan) and head-major (exact)."""
    _cudnn_or_skip(cuda_device)
    query_lens, context_lens = [1500, 1100, 2048], [0, 3333, 1024]
    batch = PagedBatch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, cuda_device)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    ref = sliced_paged_attention_ref(batch)
    triton_out = prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                   batch.block_table, scale=batch.scale)
    out = torch.full_like(batch.q, float("nan"))
    starts = batch.query_start_loc.tolist()
    for r, context in enumerate(context_lens):
        a, b = starts[r], starts[r + 1]
        blocks = batch.block_table[r, : -(-context // block_size)]
        cudnn_prefill.cudnn_prefill_request(out[a:b], batch.q[a:b], batch.k[a:b], batch.v[a:b], batch.kv_cache,
                                            blocks, context, batch.scale, exact)
    assert not out.isnan().any()
    assert relative_error(out.float(), ref) < 1.5e-2
    assert relative_error(out.float(), triton_out.float()) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("exact", [False, True], ids=["bucketed", "exact"])
def test_cudnn_request_over_an_fp8_cache(cuda_device, seed, exact):
    """The same ragged requests over an FP8 cache: the chunk's own rows read back from the cache,
    against the Triton prefill kernel over that cache and the float32 reference over its
    hand-dequantized copy."""
    _cudnn_or_skip(cuda_device)
    query_lens, context_lens = [1500, 1100, 2048], [0, 3333, 1024]
    batch = PagedBatch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    cache, deq = fp8_cache(batch.kv_cache)
    triton_out = prefill_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                   scale=batch.scale, kv_scale=scales_tensor(cuda_device))
    out = torch.full_like(batch.q, float("nan"))
    starts = batch.query_start_loc.tolist()
    for r, context in enumerate(context_lens):
        a, b = starts[r], starts[r + 1]
        blocks = batch.block_table[r, : -(-(context + b - a) // 16)]
        cudnn_prefill.cudnn_prefill_request(out[a:b], batch.q[a:b], batch.k[a:b], batch.v[a:b], cache, blocks,
                                            context, batch.scale, exact, (K_SCALE, V_SCALE))
    assert not out.isnan().any()
    batch.kv_cache = deq
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < 1.5e-2
    assert relative_error(out.float(), triton_out.float()) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_backend_takes_cudnn_for_long_chunks_beside_decodes(cuda_device, seed, monkeypatch, fp8):
    """Through TritonAttentionBackend.forward: decodes first, then two long chunks with a short one
    between them; the cuDNN path is taken for the long ones (counted) and the whole step agrees with
    the same backend with the path off."""
    _cudnn_or_skip(cuda_device)
    monkeypatch.setenv("FERROX_FA3_PREFILL", "0")  # (FlashAttention-3 would take these chunks first)
    batch = PagedBatch([1, 1, 4096, 300, 2000], [900, 17, 6000, 50, 0], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    meta = _meta(batch)
    calls: list[int] = []
    real = cudnn_prefill.cudnn_prefill_request
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", lambda *a: (calls.append(1), real(*a))[1])
    kv_cache, scales = batch.kv_cache, None
    if fp8:
        kv_cache, scales = fp8_cache(batch.kv_cache)[0], layer_scales(cuda_device)
    on_cache = kv_cache.clone()
    out = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, on_cache, meta, batch.scale, scales)
    assert len(calls) == 2
    monkeypatch.setenv("FERROX_CUDNN_PREFILL", "0")
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, kv_cache, meta, batch.scale, scales)
    assert len(calls) == 2
    assert relative_error(out.float(), expected.float()) < 1.5e-2
    if fp8:
        batch.kv_cache = torch.stack((kv_cache[0].float() * K_SCALE, kv_cache[1].float() * V_SCALE))
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < 1.5e-2


@pytest.mark.gpu
def test_warm_up_builds_the_reachable_plans(cuda_device, seed, monkeypatch):
    _cudnn_or_skip(cuda_device)
    monkeypatch.setenv("FERROX_FA3_PREFILL", "0")
    backend = TritonAttentionBackend()
    assert backend.warm_up_plans(8192, 16384) == 0  # no step yet: heads unknown
    batch = PagedBatch([1024], [0], 8, 2, 64, 16, torch.bfloat16, cuda_device)
    backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, _meta(batch), batch.scale)
    chunks, contexts = plan_buckets(4096, 8192)
    built = backend.warm_up_plans(4096, 8192)
    exact = len(cudnn_prefill.exact_contexts(4096, 8192))  # context 4096
    assert exact == 1 and backend._cudnn_exact_chunk == 4096
    assert len(chunks) + exact < built <= len(chunks) * (1 + len(contexts)) + exact
    # A whole second chunk takes its exact plan through the backend and agrees with the Triton kernel.
    batch = PagedBatch([4096], [4096], 8, 2, 64, 16, torch.bfloat16, cuda_device)
    calls: list[bool] = []
    real = cudnn_prefill.cudnn_prefill_request
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", lambda *a: (calls.append(a[8]), real(*a))[1])
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, _meta(batch), batch.scale)
    assert calls == [True]
    expected = prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                 scale=batch.scale)
    assert relative_error(out.float(), expected.float()) < 1.5e-2
