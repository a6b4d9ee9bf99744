"""DeepSeek's latent attention expanded for long prefill chunks (kernels/mla_prefill.py).

On CPU the whole request path runs with FlashAttention-3's call replaced by a float64 softmax under its
contract (tests/kernels/test_fa3_prefill.py `torch_fwd`): the latent rows gathered through a block table
with holes, expanded through kv_b_proj's halves, the context in many slices merged by log-sum-exp, an FP8
cache widened and scaled -- against the absorbed attention written out in float64 (the form the Triton
MLA kernels compute). The backend's skip (the step's other requests attended absorbed, in runs) runs under
the interpreter, and the tiny DeepSeek on the Triton kernels with the path forced on matches transformers
(tests/kernels/test_mla_attention.py). On an H100/H200 the real kernel runs at DeepSeek-V2/V3's head dims.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.kernels import fa3_prefill, mla_prefill
from ferrox.kernels.kv_fp8 import FP8_KV_DTYPE
from ferrox.kernels.mla_attention import write_latent
from ferrox.models.mla_attention import MlaShape, MlaTritonBackend

from tests.kernels.kernel_refs import relative_error
from tests.kernels.test_fa3_prefill import torch_fwd
from tests.kernels.test_mla_attention import SCALE, _step

K_SCALE = 0.37


def _case(device, *, heads, nope, rope, v, rank, block_size, context, tokens, dtype, seed=0):
    """(cache [1, blocks, block_size, 1, rank + rope], block_ids with holes, q_nope, q_pe, w_uk, w_uv)."""
    gen = torch.Generator().manual_seed(seed)
    needed = -(-(context + tokens) // block_size)
    total = 2 * needed + 3
    block_ids = (torch.randperm(total - 1, generator=gen)[:needed] + 1).to(torch.int32)
    cache = torch.randn(1, total, block_size, 1, rank + rope, generator=gen)
    q_nope = torch.randn(tokens, heads, nope, generator=gen)
    q_pe = torch.randn(tokens, heads, rope, generator=gen)
    w_uk = torch.randn(heads, nope, rank, generator=gen) * rank ** -0.5
    w_uv = torch.randn(heads, rank, v, generator=gen) * rank ** -0.5
    return [t.to(device, dtype) for t in (cache, q_nope, q_pe, w_uk, w_uv)], block_ids.to(device)


def _absorbed_reference(cache, block_ids, context, q_nope, q_pe, w_uk, w_uv, scale):
    """The absorbed form in float64: q_h = [q_nope_h W_UK_h | q_pe_h] against the latent rows, causal (query i
    at position context + i), values the rows' first rank dims, then W_UV_h."""
    rank, tokens, block_size = w_uk.shape[2], q_nope.shape[0], cache.shape[2]
    pos = torch.arange(context + tokens, device=cache.device)
    rows = cache[0, block_ids.long()[pos // block_size], pos % block_size, 0].double()  # [S, D]
    q = torch.cat((torch.einsum("thn,hnr->thr", q_nope.double(), w_uk.double()), q_pe.double()), dim=-1)
    scores = torch.einsum("thd,sd->hts", q, rows) * scale
    visible = pos[None, :] <= (context + torch.arange(tokens, device=cache.device))[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    latent = torch.einsum("hts,sr->thr", torch.softmax(scores, dim=-1), rows[:, :rank])
    return torch.einsum("thr,hrv->thv", latent, w_uv.double())


@pytest.mark.parametrize("context", [0, 70, 300], ids=["fresh", "one-slice-and-a-bit", "ten-slices"])
@pytest.mark.parametrize("fp8", [False, True], ids=["cache", "fp8-cache"])
def test_expanded_request_matches_the_absorbed_form(monkeypatch, context, fp8):
    """Plain torch on any device (the kernel replaced by a float64 softmax): 37 query rows after a context
    ending mid-block, the context cut into 32-position slices; the result lands in a strided view (as the
    layer's [H, T, v] output seen token-major)."""
    monkeypatch.setattr(fa3_prefill, "_fwd", torch_fwd)
    heads, nope, rope, v, rank = 4, 16, 8, 16, 32
    monkeypatch.setattr(mla_prefill, "SLICE_BYTES", 32 * heads * ((nope + v) + (nope + rope)) * 4)  # 32 positions
    (cache, q_nope, q_pe, w_uk, w_uv), block_ids = _case(torch.device("cpu"), heads=heads, nope=nope, rope=rope, v=v,
                                                         rank=rank, block_size=16, context=context, tokens=37,
                                                         dtype=torch.float32)
    stored, scale = cache, 1.0
    if fp8:  # written as latent / k_scale, read back widened times k_scale
        stored, scale = (cache / K_SCALE).to(FP8_KV_DTYPE), K_SCALE
        cache = stored.float() * K_SCALE
    out = torch.full((heads, 37, v), float("nan")).transpose(0, 1)
    mla_prefill.mla_prefill_request(out, q_nope, q_pe, stored.expand(2, -1, -1, -1, -1), block_ids, context, w_uk,
                                    w_uv, SCALE, scale)
    want = _absorbed_reference(cache, block_ids, context, q_nope, q_pe, w_uk, w_uv, SCALE)
    assert relative_error(out.double(), want) < 1e-5


def test_plan_takes_long_chunks_whatever_their_context():
    from tests.kernels.kernel_refs import PagedBatch
    from tests.kernels.test_prefill_attention import _meta

    n = mla_prefill.EXPANDED_MIN_LEN
    batch = PagedBatch([1, n, n - 1, n + 30], [40, 0, 9, 77], 4, 1, 16, 16, torch.float32, torch.device("cpu"))
    assert mla_prefill.plan_expanded(_meta(batch)) == ((1, 1, n + 1, 0), (3, 2 * n, 3 * n + 30, 77))
    short = PagedBatch([1, n - 1], [40, 0], 4, 1, 16, 16, torch.float32, torch.device("cpu"))
    assert mla_prefill.plan_expanded(_meta(short)) == ()


def test_backend_skips_the_expanded_requests(kernel_device, monkeypatch):
    """MlaTritonBackend.forward with skip: every latent row is written, the other requests' rows are the
    full forward's (absorbed, in runs of consecutive requests: decodes first, a short chunk between
    expanded ones); the path's own rows are left to the layer."""
    monkeypatch.setattr(mla_prefill, "EXPANDED_MIN_LEN", 10)
    rank, rope, heads = 32, 16, 4
    q, rows, cache, meta = _step(kernel_device, [(1, 9), (1, 40), (12, 5), (7, 0), (20, 0), (3, 30)], 8,
                                 rank=rank, rope=rope, heads=heads, seed=6)
    backend = MlaTritonBackend(MlaShape(rank, None, 16, rope, 16, False, SCALE))
    backend._expand = True  # as expanded_requests decides on an sm90 GPU with the wheel
    plan = backend.expanded_requests(meta, q.dtype, cache)
    assert [r for r, *_ in plan] == [2, 4]
    full_cache, skip_cache = cache.clone(), cache.clone()
    want = backend.forward(q, rows, rows, full_cache, meta, SCALE)
    got = backend.forward(q, rows, rows, skip_cache, meta, SCALE, skip=plan)
    assert torch.equal(skip_cache, full_cache)
    starts = meta.query_start_loc_cpu.tolist()
    for r in (0, 1, 3, 5):
        a, b = starts[r], starts[r + 1]
        assert relative_error(got[a:b], want[a:b]) < 1e-6, r


def test_tiny_deepseek_with_the_expanded_path_matches_transformers(kernel_device, tmp_path, monkeypatch):
    """The layer's whole expanded path on the Triton kernel set, forced on with the kernel call replaced by
    a float64 softmax: 16-token chunks take it (the first fresh, the next after 16 and 32 cached positions,
    cut into 8-position slices), decodes stay absorbed; greedy tokens equal transformers'."""
    import transformers
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer
    from ferrox.models.deepseek_v2 import DeepseekV2ForCausalLM

    from tests.helpers.driver import run_greedy
    from tests.helpers.tiny_deepseek import load_on_triton_kernels, make_tiny_deepseek
    from tests.models.conftest import cut_at_eos, hf_greedy

    calls: list[int] = []

    def fake(q, k, v, scale, causal=True, out=None):
        calls.append(q.shape[1])
        return torch_fwd(q, k, v, scale, causal, out)

    monkeypatch.setattr(fa3_prefill, "_fwd", fake)
    monkeypatch.setattr(mla_prefill, "EXPANDED_MIN_LEN", 16)
    monkeypatch.setattr(mla_prefill, "SLICE_BYTES", 8 * 4 * (32 + 40) * 4)  # 8 positions of 4 heads, float32
    monkeypatch.setattr(mla_prefill, "expanded_supported", lambda *args: True)
    folder = make_tiny_deepseek(tmp_path / "v2", version=2, q_lora_rank=None, topk_method="greedy", seed=3,
                                num_layers=2, v_head_dim=24)
    model = load_on_triton_kernels(folder, DeepseekV2ForCausalLM, kernel_device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [list(range(3, 51)), [5, 17, 33, 2, 9]]
    got = run_greedy(model, prompts, 4, block_size=8, prefill_chunk=16)
    assert calls, "no chunk took the expanded path"
    eos = load_tokenizer(resolve_model(folder)).eos_token_ids
    for ids, tokens in zip(prompts, got, strict=True):
        assert cut_at_eos(tokens, eos) == hf_greedy(ref, ids, 4)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("heads, context", [(16, 3000), (128, 700), (16, 0)], ids=["v2-lite", "v3-heads", "fresh"])
def test_gpu_expanded_request_at_deepseek_shapes(cuda_device, monkeypatch, heads, context, fp8):
    """The real kernel at V2 / V3's dims (192 / 128 heads, latent 512 + 64), bf16: a 1,500-token chunk after
    `context` cached positions in ~3 slices, against the absorbed form in float64."""
    if not mla_prefill.expanded_supported(cuda_device, torch.bfloat16, torch.bfloat16, 192, 128):
        pytest.skip("FlashAttention-3 needs an sm90 GPU and the fa3-fwd wheel")
    nope, rope, v, rank, tokens = 128, 64, 128, 512, 1500
    monkeypatch.setattr(mla_prefill, "SLICE_BYTES", max(context, 1) // 3 * heads * (256 + 192) * 2 + 1)
    (cache, q_nope, q_pe, w_uk, w_uv), block_ids = _case(cuda_device, heads=heads, nope=nope, rope=rope, v=v,
                                                         rank=rank, block_size=16, context=context, tokens=tokens,
                                                         dtype=torch.bfloat16)
    scale = 192 ** -0.5
    stored, k_scale = cache, 1.0
    if fp8:
        stored, k_scale = (cache.float() / K_SCALE).to(FP8_KV_DTYPE), K_SCALE
        cache = stored.float() * K_SCALE
    out = torch.full((tokens, heads, v), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    mla_prefill.mla_prefill_request(out, q_nope, q_pe, stored, block_ids, context, w_uk, w_uv, scale, k_scale)
    want = _absorbed_reference(cache.float(), block_ids, context, q_nope, q_pe, w_uk, w_uv, scale)
    assert not out.isnan().any()
    assert relative_error(out.double(), want) < 2e-2


@pytest.mark.gpu
def test_gpu_latent_write_then_expanded_read(cuda_device):
    """The rows the absorbed path writes (write_latent) are the rows the expanded path reads: a chunk's own
    latent rows written this step, then attended expanded, against the reference over the same cache."""
    if not mla_prefill.expanded_supported(cuda_device, torch.bfloat16, torch.bfloat16, 192, 128):
        pytest.skip("FlashAttention-3 needs an sm90 GPU and the fa3-fwd wheel")
    heads, tokens, context = 16, 600, 200
    (cache, q_nope, q_pe, w_uk, w_uv), block_ids = _case(cuda_device, heads=heads, nope=128, rope=64, v=128, rank=512,
                                                         block_size=16, context=context, tokens=tokens,
                                                         dtype=torch.bfloat16, seed=2)
    rows = torch.randn(tokens, 1, 576, device=cuda_device, dtype=torch.bfloat16)
    pos = torch.arange(context, context + tokens, device=cuda_device)
    slots = (block_ids.long()[pos // 16] * 16 + pos % 16)
    write_latent(rows, cache.expand(2, -1, -1, -1, -1), slots)  # (the backends' two-plane view of the latent)
    out = torch.empty(tokens, heads, 128, dtype=torch.bfloat16, device=cuda_device)
    mla_prefill.mla_prefill_request(out, q_nope, q_pe, cache, block_ids, context, w_uk, w_uv, 192 ** -0.5)
    want = _absorbed_reference(cache.float(), block_ids, context, q_nope, q_pe, w_uk, w_uv, 192 ** -0.5)
    assert relative_error(out.double(), want) < 2e-2
