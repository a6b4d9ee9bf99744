"""Long prefill chunks through FlashAttention-3 (kernels/fa3_prefill.py).

On CPU the whole path runs through the attention backend with the kernel call replaced by a float64
softmax under FlashAttention-3's contract (causal aligned bottom-right): the gather of each
request's context and own rows from a paged cache with holes, an FP8 cache widened with its scales
folded, the step plan, the fallback when the library raises. On an H100/H200 with the `fa3-fwd`
wheel the real kernel runs at real shapes against the Triton prefill kernel and the float32
reference (ragged chunks, contexts off the block grid and under the cuDNN cut, GQA 4 and 8,
head_dim 64, 80, 128 and 256, block sizes 16-128), over an FP8 cache, and through the backend with decodes
leading the batch.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.triton_backend import TritonAttentionBackend, _plan_step
from ferrox.kernels import fa3_prefill
from ferrox.kernels.prefill_attention import prefill_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache

from tests.helpers.interpreter import prefill_kernel_from
from tests.kernels.kernel_refs import PagedBatch, relative_error, sliced_paged_attention_ref
from tests.kernels.test_kv_fp8 import K_SCALE, V_SCALE, fp8_cache, layer_scales, scales_tensor
from tests.kernels.test_prefill_attention import _meta


def torch_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True,
              out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fa3_prefill._fwd's contract in float64 torch (what the CPU tests put in place of the kernel): q [1, T,
    H, D], k [1, S, Hkv, D], v [1, S, Hkv, Dv]; causal with the diagonal at the bottom right (row i sees keys
    0 .. S - T + i); returns (out [1, T, H, Dv] in q's dtype, written into `out` when given, lse [1, H, T])."""
    t, s, group = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    kh = k[0].double().repeat_interleave(group, 1)
    vh = v[0].double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q[0].double(), kh) * scale
    if causal:
        visible = torch.arange(s)[None, :] <= (s - t + torch.arange(t))[:, None]
        scores = scores.masked_fill(~visible.to(scores.device)[None], float("-inf"))
    result = torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vh)[None]
    if out is None:
        out = torch.empty(result.shape, dtype=q.dtype, device=q.device)
    out.copy_(result)
    return out, torch.logsumexp(scores, dim=-1).float()[None]


# Chunks of LONG tokens or more take the prefill kernel's plan (PREFILL_MIN_QUERY_LEN, 128 in production) and
# FlashAttention-3 (FA3_MIN_LEN): chunks the interpreter runs in a second, the cuts around them as in production.
LONG = 40


def long_chunks_from(monkeypatch, tokens: int) -> None:
    prefill_kernel_from(monkeypatch, tokens)
    monkeypatch.setattr(fa3_prefill, "FA3_MIN_LEN", tokens)


def _fa3_backend() -> TritonAttentionBackend:
    backend = TritonAttentionBackend()
    backend._long_block_size, backend._long_kernel = 16, "fa3"  # as _decide_long_path sets them on sm90
    return backend


def test_step_plan_gives_fa3_long_chunks_after_any_context():
    """FlashAttention-3 builds no plans, so a long chunk takes it whatever its cached context (cuDNN
    needs 0 or >= its cut); short chunks keep the Triton kernel in runs, decodes lead."""
    cpu = torch.device("cpu")
    batch = PagedBatch([1, 1100, 1030, 300, 1024], [40, 0, 500, 3000, 17], 4, 1, 16, 16, torch.float32, cpu)
    plan = _plan_step(_meta(batch), 16, fa3_prefill.takes_fa3_path)
    assert plan.num_decodes == 1
    assert [(r, context) for r, _, _, context, _ in plan.long_requests] == [(1, 0), (2, 500), (4, 17)]
    assert plan.prefill_runs == ((3, 4, 2131, 2431),)
    cudnn = _plan_step(_meta(batch), 16)  # the cuDNN rule: the 500- and 17-token contexts stay on Triton
    assert [r for r, *_ in cudnn.long_requests] == [1]


@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
def test_backend_fa3_path_matches_the_triton_kernels(kernel_device, seed, monkeypatch, fp8):
    """Decodes, long chunks (one after a context ending mid-block, one fresh) and a short chunk in
    one step, the kernel call replaced by a float64 softmax: each long request's call gets its
    context and own rows in order from the cache (FP8: widened, k_scale in the softmax scale and
    v_scale on the output), and the step agrees with the Triton kernels over the same cache."""
    long_chunks_from(monkeypatch, LONG)
    scales: list[float] = []

    def fake(q, k, v, scale, causal, out):
        scales.append(scale)
        return torch_fwd(q, k, v, scale, causal, out)

    monkeypatch.setattr(fa3_prefill, "_fwd", fake)
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    batch = PagedBatch([1, LONG + 2, 20, LONG + 8], [9, 37, 5, 0], 4, 2, 16, 16, dtype, kernel_device)
    meta = _meta(batch)
    cache, layer = batch.kv_cache, None
    if fp8:
        cache, layer = fp8_cache(batch.kv_cache)[0], layer_scales(kernel_device)
    off_cache, on_cache = cache.clone(), cache.clone()
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, off_cache, meta, batch.scale, layer)
    out = _fa3_backend().forward(batch.q, batch.k, batch.v, on_cache, meta, batch.scale, layer)
    assert scales == [pytest.approx(batch.scale * (K_SCALE if fp8 else 1.0))] * 2
    assert torch.equal(on_cache.view(torch.uint8), off_cache.view(torch.uint8))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert relative_error(out.float(), expected.float()) < tol
    if fp8:  # the reference over the written cache, dequantized by hand
        batch.kv_cache = torch.stack((on_cache[0].float() * K_SCALE, on_cache[1].float() * V_SCALE))
    else:
        batch.kv_cache = on_cache
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < tol


def test_a_fa3_failure_falls_back_to_the_prefill_kernel(kernel_device, seed, monkeypatch, caplog):
    """A FlashAttention-3 call that raises leaves the step to the Triton kernels, which the backend
    keeps from then on; the step's requests see nothing."""
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    long_chunks_from(monkeypatch, LONG)
    batch = PagedBatch([1, LONG + 2], [9, 3], 2, 1, 16, 16, dtype, kernel_device)
    meta = _meta(batch)
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), meta, batch.scale)

    def refuse(*args):
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")

    monkeypatch.setattr(fa3_prefill, "_fwd", refuse)
    backend = _fa3_backend()
    out = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache, meta, batch.scale)
    assert torch.equal(out, expected)
    assert backend._long_block_size == 0 and "FlashAttention-3 failed" in caplog.text


def test_the_path_stays_off_without_an_sm90_gpu_or_when_disabled(monkeypatch):
    assert not fa3_prefill.fa3_prefill_supported(torch.device("cpu"), torch.bfloat16, 128)
    monkeypatch.setenv("FERROX_FA3_PREFILL", "0")
    assert not fa3_prefill.fa3_prefill_supported(torch.device("cuda"), torch.bfloat16, 128)
    assert not fa3_prefill.fa3_prefill_applies(torch.device("cuda"), torch.bfloat16, torch.bfloat16, 128)


# ---------------------------------------------------------------------------------------------- GPU


def _fa3_or_skip(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
    if not fa3_prefill.fa3_prefill_supported(device, dtype, 128):
        pytest.skip(f"FlashAttention-3 needs an sm90 GPU and the fa3-fwd wheel (with {dtype})")


def _run_requests(batch: PagedBatch, cache: torch.Tensor, context_lens: list[int], kv_scales=None) -> torch.Tensor:
    out = torch.full_like(batch.q, float("nan"))
    starts = batch.query_start_loc.tolist()
    block_size = cache.shape[2]
    for r, context in enumerate(context_lens):
        a, b = starts[r], starts[r + 1]
        blocks = batch.block_table[r, : -(-(context + b - a) // block_size)]
        fa3_prefill.fa3_prefill_request(out[a:b], batch.q[a:b], cache, blocks, context, batch.scale, kv_scales)
    assert not out.isnan().any()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(32, 8, 128, 16), (32, 4, 64, 16),
                                                                    (28, 4, 128, 128), (16, 2, 64, 32),
                                                                    (8, 4, 256, 16), (16, 4, 80, 16)],
                         ids=["llama8b", "gqa8-dim64", "qwen-block128", "gqa8-block32", "gemma3-dim256",
                              "dim80-rounded-up"])
def test_fa3_request_matches_the_prefill_kernel(cuda_device, seed, dtype, heads, kv_heads, head_dim, block_size):
    """Ragged requests (a fresh prompt, chunks after contexts ending mid-block, one under the cuDNN
    cut) over a cache whose blocks are a random permutation: every row against the float32
    reference and the Triton prefill kernel."""
    _fa3_or_skip(cuda_device, dtype)
    query_lens, context_lens = [1500, 1100, 2048, 1024], [0, 3333, 1024, 77]
    batch = PagedBatch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, cuda_device)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    out = _run_requests(batch, batch.kv_cache, context_lens)
    triton_out = prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens,
                                   batch.block_table, scale=batch.scale)
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < 1.5e-2
    assert relative_error(out.float(), triton_out.float()) < 1.5e-2


@pytest.mark.gpu
def test_fa3_request_over_an_fp8_cache(cuda_device, seed):
    _fa3_or_skip(cuda_device)
    query_lens, context_lens = [1500, 1100, 2048], [0, 3333, 500]
    batch = PagedBatch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device)
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    cache, deq = fp8_cache(batch.kv_cache)
    out = _run_requests(batch, cache, context_lens, (K_SCALE, V_SCALE))
    triton_out = prefill_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                                   scale=batch.scale, kv_scale=scales_tensor(cuda_device))
    batch.kv_cache = deq
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < 1.5e-2
    assert relative_error(out.float(), triton_out.float()) < 1.5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_backend_takes_fa3_for_long_chunks_beside_decodes(cuda_device, seed, monkeypatch, fp8):
    """Through TritonAttentionBackend.forward as an engine builds it: decodes first, long chunks
    (one after a 600-token context, under cuDNN's cut) with a short one between; FlashAttention-3
    is chosen and takes the long ones (counted), its warm-up loads its kernels and builds no plans,
    and the step agrees with the same backend with both library paths off and with the reference."""
    _fa3_or_skip(cuda_device)
    batch = PagedBatch([1, 1, 4096, 300, 2000, 1500], [900, 17, 6000, 50, 0, 600], 32, 8, 128, 16,
                       torch.bfloat16, cuda_device)
    meta = _meta(batch)
    calls: list[int] = []
    real = fa3_prefill.fa3_prefill_request
    monkeypatch.setattr(fa3_prefill, "fa3_prefill_request", lambda *a: (calls.append(1), real(*a))[1])
    kv_cache, scales = batch.kv_cache, None
    if fp8:
        kv_cache, scales = fp8_cache(batch.kv_cache)[0], layer_scales(cuda_device)
    backend = TritonAttentionBackend()
    written = kv_cache.clone()  # (the reference reads this step's rows from the cache too)
    out = backend.forward(batch.q, batch.k, batch.v, written, meta, batch.scale, scales)
    assert backend._long_kernel == "fa3" and len(calls) == 3
    assert backend.warm_up_plans(4096, 16384) == 0
    monkeypatch.setenv("FERROX_FA3_PREFILL", "0")
    monkeypatch.setenv("FERROX_CUDNN_PREFILL", "0")
    expected = TritonAttentionBackend().forward(batch.q, batch.k, batch.v, kv_cache.clone(), meta, batch.scale,
                                                scales)
    assert len(calls) == 3
    assert relative_error(out.float(), expected.float()) < 1.5e-2
    batch.kv_cache = written
    if fp8:
        batch.kv_cache = torch.stack((written[0].float() * K_SCALE, written[1].float() * V_SCALE))
    assert relative_error(out.float(), sliced_paged_attention_ref(batch)) < 1.5e-2
