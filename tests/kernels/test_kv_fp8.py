"""FP8 KV cache (kv_cache_dtype="fp8"): every writer stores fp8(clamp(x / scale)) and every reader
attends as if over the dequantized cache, fp8 * scale.

References: the quantization rule written out here, and kernel_refs.paged_attention_ref run over a
float32 copy of the cache dequantized by hand. Kernels run on CUDA, or on CPU in the Triton
interpreter child (conftest.py); the torch backend's tests run in any process.
"""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.backend import get_attention_backend
from ferrox.attention.kv_cache import KVCacheScales, allocate_kv_caches
from ferrox.attention.metadata import AttentionMetadata
from ferrox.attention.triton_backend import PREFILL_MIN_QUERY_LEN
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.interpreter import INTERPRETED, interpreted_or, wide_row_tiles
from tests.kernels.kernel_refs import (
    PagedBatch,
    paged_attention_ref,
    relative_error,
    sliced_paged_attention_ref,
)

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.37, 2.3  # not powers of two: a missed or doubled scale changes the result
# fp32 attention over an fp8 cache: the kernels see the same fp8 values as the reference, so only
# the order of float32 operations differs (the k scale joins the softmax scale, not K).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def quantize_ref(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-448.0, 448.0).to(FP8)


def fp8_cache(cache: torch.Tensor, k_scale: float = K_SCALE, v_scale: float = V_SCALE):
    """(the cache quantized, the quantized cache dequantized to float32 by hand)."""
    q = torch.stack((quantize_ref(cache[0], k_scale), quantize_ref(cache[1], v_scale)))
    deq = torch.stack((q[0].float() * k_scale, q[1].float() * v_scale))
    return q, deq


def scales_tensor(device: torch.device, k_scale: float = K_SCALE, v_scale: float = V_SCALE) -> torch.Tensor:
    return torch.tensor([k_scale, v_scale], dtype=torch.float32, device=device)


def layer_scales(device: torch.device, k_scale: float = K_SCALE, v_scale: float = V_SCALE) -> KVCacheScales:
    scales = KVCacheScales(device)
    scales.load("k", torch.tensor(k_scale), "k_scale")
    scales.load("v", torch.tensor(v_scale), "v_scale")
    return scales


def meta_of(batch: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=batch.num_actual_tokens, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table, query_start_loc_cpu=batch.query_start_loc.cpu(),
        seq_lens_cpu=batch.seq_lens.cpu(), decode_only=batch.max_query_len == 1,
    )


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# ---------------------------------------------------------------- the KV write


def _check_write(batch: PagedBatch) -> None:
    from ferrox.kernels.reshape_and_cache import reshape_and_cache

    batch.k[::3] *= 400.0  # some rows far past 448 * k_scale: they must saturate, not turn NaN
    cache, _ = fp8_cache(batch.kv_cache)
    expected = bytes_of(cache).clone()
    valid = batch.slot_mapping >= 0
    slots = batch.slot_mapping[valid]
    blocks, offsets = slots // batch.block_size, slots % batch.block_size
    expected[0, blocks, offsets] = bytes_of(quantize_ref(batch.k[valid], K_SCALE))
    expected[1, blocks, offsets] = bytes_of(quantize_ref(batch.v[valid], V_SCALE))
    reshape_and_cache(batch.k, batch.v, cache, batch.slot_mapping, scales_tensor(cache.device))
    assert not cache.float().isnan().any()
    if cache.device.type == "cpu":
        assert torch.equal(bytes_of(cache), expected)  # same bytes, untouched slots unchanged
        return
    # On the GPU the hardware conversion may land on the neighbouring code of a value at a rounding
    # boundary (measured on an H200): at most one code apart, and rarely.
    apart = (bytes_of(cache).int() - expected.int()).abs()
    assert int(apart.max()) <= 1 and float((apart > 0).float().mean()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_reshape_and_cache_fp8(kernel_device, seed, dtype):
    _check_write(PagedBatch([5, 1, 3], [0, 17, 6], 4, 2, 32, 16, dtype, kernel_device, num_pad_tokens=3))


@pytest.mark.gpu
def test_reshape_and_cache_fp8_llama8b_shapes(cuda_device, seed):
    query_lens = [512, 300] + [1] * 64
    context_lens = [0, 1000] + torch.randint(1, 4000, (64,)).tolist()
    _check_write(PagedBatch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device,
                            num_pad_tokens=16))


# ---------------------------------------------------------------- the attention kernels


def _check_unified(batch: PagedBatch, dtype: torch.dtype, num_splits: int | None = None) -> None:
    from ferrox.kernels.paged_attention import unified_attention

    cache, deq = fp8_cache(batch.kv_cache)
    out = torch.full_like(batch.q, float("nan"))
    unified_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                      max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=batch.scale, out=out,
                      num_splits=num_splits, kv_scale=scales_tensor(cache.device))
    ref = paged_attention_ref(batch.q, deq, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any(), "attention left output rows unwritten"
    err = relative_error(out[:n], ref[:n])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


# (query_lens, context_lens, heads, kv_heads, head_dim, block_size, num_splits)
UNIFIED_CASES = {
    "decode-gqa3-dim24": ([1, 1, 1], [70, 3, 40], 6, 2, 24, 8, None),
    "mixed-chunk-and-decodes": ([7, 1, 1, 12], [0, 9, 33, 5], 4, 2, 32, 16, None),
    "split-kv": ([1, 3, 1], [200, 90, 7], 4, 2, 32, 16, 3),
    "split-kv-by-heuristic": ([1], [900], 4, 2, 16, 16, None),
}


@pytest.mark.parametrize("case", list(UNIFIED_CASES), ids=list(UNIFIED_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_unified_attention_fp8(kernel_device, seed, case, dtype):
    query_lens, context_lens, heads, kv_heads, head_dim, block_size, splits = UNIFIED_CASES[case]
    batch = PagedBatch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, kernel_device,
                       num_pad_tokens=2)
    _check_unified(batch, dtype, splits)


def _check_prefill(batch: PagedBatch, dtype: torch.dtype, config=None, use_tma: bool | None = None) -> None:
    from ferrox.kernels.prefill_attention import prefill_attention

    cache, deq = fp8_cache(batch.kv_cache)
    out = torch.full_like(batch.q, float("nan"))
    prefill_attention(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.block_table, scale=batch.scale,
                      out=out, config=config, use_tma=use_tma, kv_scale=scales_tensor(cache.device))
    batch.kv_cache = deq  # the reference reads the dequantized copy
    ref = sliced_paged_attention_ref(batch)
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any(), "attention left output rows unwritten"
    err = relative_error(out[:n], ref[:n])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_prefill_attention_fp8(kernel_device, seed, dtype, use_tma):
    from ferrox.kernels.prefill_attention import PrefillLaunchConfig, tma_usable

    tiny = PrefillLaunchConfig(block_m=32, tile_n=16, num_warps=4, num_stages=1)
    batch = PagedBatch([40, 1, 23], [100, 7, 0], 8, 2, 32, 16, dtype, kernel_device, num_pad_tokens=3,
                       spare_blocks=5)
    if use_tma and not tma_usable(batch.kv_cache.to(FP8), tiny):
        pytest.skip("TMA needs an sm90 GPU")
    _check_prefill(batch, dtype, tiny, use_tma)


# ---------------------------------------------------------------- the backends


def _backend_pair(batch: PagedBatch, device: torch.device):
    """The torch and Triton backends over copies of one FP8 cache: (outputs, caches after the write)."""
    meta = meta_of(batch)
    cache, _ = fp8_cache(batch.kv_cache)
    results = []
    for name in ("torch", "triton"):
        backend = get_attention_backend(device, name)
        backend.begin_forward(meta)
        c = cache.clone()
        out = backend.forward(batch.q, batch.k, batch.v, c, meta, batch.scale, layer_scales(device))
        results.append((out, c))
    return results


@pytest.mark.parametrize("kind", ["mixed", "decode", "long-chunk"])
def test_triton_backend_matches_torch_backend_fp8(kernel_device, seed, kind):
    """Same bytes written, same attention: the prefill kernel (a chunk of PREFILL_MIN_QUERY_LEN
    tokens and more), the unified kernel (decodes, short chunks) and the two together."""
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    lens = {"mixed": ([6, 1, 1, 9], [0, 20, 47, 13]), "decode": ([1, 1, 1], [5, 90, 31]),
            "long-chunk": ([1, PREFILL_MIN_QUERY_LEN + 3], [12, 20])}[kind]
    batch = PagedBatch(*lens, 4, 2, 16, 8, dtype, kernel_device, num_pad_tokens=2)
    (ref, ref_cache), (out, cache) = _backend_pair(batch, kernel_device)
    n = batch.num_actual_tokens
    assert torch.equal(bytes_of(cache), bytes_of(ref_cache)), "the two backends wrote different bytes"
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]


def test_torch_backend_fp8_attends_over_the_dequantized_cache(seed):
    """The reference backend (any process, no interpreter): a fresh prompt, a chunk after cached
    context and decodes, written into an FP8 cache and attended, against attention over the
    dequantized cache after the same write."""
    cpu = torch.device("cpu")
    batch = PagedBatch([9, 1, 6, 1], [0, 30, 11, 4], 6, 2, 16, 4, torch.float32, cpu, num_pad_tokens=2)
    meta = meta_of(batch)
    cache, _ = fp8_cache(batch.kv_cache)
    backend = get_attention_backend(cpu, "torch")
    backend.begin_forward(meta)
    out = backend.forward(batch.q, batch.k, batch.v, cache, meta, batch.scale, layer_scales(cpu))
    deq = torch.stack((cache[0].float() * K_SCALE, cache[1].float() * V_SCALE))
    ref = paged_attention_ref(batch.q, deq, batch.query_start_loc, batch.seq_lens, batch.block_table, batch.scale)
    n = batch.num_actual_tokens
    assert relative_error(out[:n], ref[:n]) < 1e-5
    slots = batch.slot_mapping[:n]
    written = cache[0].view(-1, 2, 16)[slots]
    assert torch.equal(bytes_of(written), bytes_of(quantize_ref(batch.k[:n], K_SCALE)))


def test_kv_scales_follow_vllm_loading_rules():
    scales = KVCacheScales("cpu")
    assert (scales.k_scale, scales.v_scale) == (1.0, 1.0)
    scales.load("k", torch.tensor([0.5]), "model.layers.0.self_attn.k_scale")
    assert (scales.k_scale, scales.v_scale) == (0.5, 0.5)  # alone, k's scale stands for both
    scales.load("v", torch.tensor(0.25), "model.layers.0.self_attn.v_scale")
    assert (scales.k_scale, scales.v_scale) == (0.5, 0.25)
    assert scales.scales.tolist() == [0.5, 0.25]
    with pytest.raises(ValueError, match="self_attn.k_scale.*one number"):
        scales.load("k", torch.ones(4), "model.layers.0.self_attn.k_scale")
    with pytest.raises(ValueError, match="positive"):
        scales.load("kv", torch.tensor(0.0), "model.layers.0.self_attn.kv_scale")


def test_zero_kv_blocks_clears_fp8_and_float_caches():
    """What warm-up and CUDA-graph capture use to forget their steps' blocks (torch has no
    index_fill_ for float8 types)."""
    from ferrox.attention.kv_cache import zero_kv_blocks

    caches = [torch.randn(2, 5, 4, 2, 8).to(dtype) for dtype in (FP8, torch.float32)]
    before = [c.float().clone() for c in caches]
    zero_kv_blocks(caches, torch.tensor([1, 3]))
    for cache, old in zip(caches, before, strict=True):
        assert not cache[:, [1, 3]].float().any()
        assert torch.equal(cache[:, [0, 2, 4]].float(), old[:, [0, 2, 4]])


# ---------------------------------------------------------------- the fused one-token path

BLOCK = 4
_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 48, "num_hidden_layers": 2, "vocab_size": 61,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
}


def test_qkv_rope_gemv_stores_fp8(kernel_device, seed):
    """The fused projection's KV store: with an FP8 cache it writes exactly quantize(what it writes
    into a float32 cache), and q is unchanged."""
    from ferrox.kernels.gemv import qkv_rope_gemv

    hq, hkv, d, hidden = 4, 2, 16, 32
    x = torch.randn(1, hidden, device=kernel_device)
    w = torch.randn((hq + 2 * hkv) * d, hidden, device=kernel_device)
    norm = 1 + 0.1 * torch.randn(hidden, device=kernel_device)
    pos = torch.tensor([5.0], device=kernel_device)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=kernel_device) / d)
    rope = torch.cat((torch.cos(pos * inv), torch.sin(pos * inv)))
    slot = torch.tensor([6], dtype=torch.int64, device=kernel_device)

    def run(cache_dtype, kv_scale=None):
        cache = torch.zeros(2, 3, BLOCK, hkv, d, dtype=cache_dtype, device=kernel_device)
        q = qkv_rope_gemv(x, w, None, norm_weight=norm, eps=1e-5, rope_row=rope, slot_mapping=slot, kv_cache=cache,
                          num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_scale=kv_scale)
        return q, cache

    q32, cache32 = run(torch.float32)
    q8, cache8 = run(FP8, scales_tensor(kernel_device, 0.01, 0.3))  # small scales: some values saturate
    assert torch.equal(q8, q32)
    expected = torch.stack((quantize_ref(cache32[0], 0.01), quantize_ref(cache32[1], 0.3)))
    assert torch.equal(bytes_of(cache8), bytes_of(expected))
    assert (cache8[0].float().abs() == 448).any(), "the test meant some values to saturate"


def _tiny_models(device: torch.device, dtype: torch.dtype = torch.float32):
    spec = spec_from_hf_config(_CONFIG, "test config")
    cls = get_model_class(["LlamaForCausalLM"])
    ref = cls(spec, dtype, device, kernels="torch")
    init_dummy_weights(ref, seed=3)
    with torch.no_grad():
        for name, param in ref.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(10.0)  # logits far from ties
    fused = cls(spec, dtype, device, kernels="triton")
    fused.load_state_dict(ref.state_dict())
    for model in (ref, fused):
        for i, layer in enumerate(model.model.layers):  # per-layer scales, as a checkpoint gives
            layer.self_attn.kv_scales.load("k", torch.tensor(0.3 + 0.1 * i), "k_scale")
            layer.self_attn.kv_scales.load("v", torch.tensor(0.2 + 0.3 * i), "v_scale")
        model.finalize_weights()
        model.eval()
    return ref, fused


@torch.inference_mode()
def _logits(model, device: torch.device, prompt: list[int], decode: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(model.spec, 8, BLOCK, FP8, device)
    blocks = list(range(1, 8))
    ids, pos, meta = build_step([StepRequest(prompt, 0, blocks)], BLOCK, device)
    rows = [model.compute_logits(model(ids, pos, caches, meta)[-1:])]
    for i, token in enumerate(decode):
        ids, pos, meta = build_step([StepRequest([token], len(prompt) + i, blocks)], BLOCK, device)
        rows.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(rows)


def test_fused_decode_with_fp8_cache_matches_torch_model(kernel_device, monkeypatch):
    """A tiny Llama on the Triton kernel set (fused one-token path: the qkv kernel writes the FP8
    cache) against the same weights and scales on the torch kernel set; then with the fused path
    off (reshape_and_cache + unified attention). Interpreted, the one-token products take wide row
    tiles and the unfused run two decode steps (tests/helpers/interpreter.py)."""
    from ferrox.attention.fused_decode import FusedOneTokenDecode

    if INTERPRETED:
        wide_row_tiles(monkeypatch)
    ref, fused = _tiny_models(kernel_device)
    assert isinstance(fused.model.decode_path, FusedOneTokenDecode)
    prompt, decode = [3, 9, 27, 41, 50, 20], [11, 42, 5, 60]
    expected = _logits(ref, kernel_device, prompt, decode)
    got = _logits(fused, kernel_device, prompt, decode)
    # The two paths round k at different points before quantizing (fused rotary): a value at an fp8
    # rounding boundary may land one step apart, hence a looser bound than fp32 attention alone.
    assert relative_error(got, expected) < 2e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    monkeypatch.setenv("FERROX_FUSED_DECODE", "0")
    decode = interpreted_or(decode, decode[:2])
    assert relative_error(_logits(fused, kernel_device, prompt, decode), expected[:1 + len(decode)]) < 2e-3


# ---------------------------------------------------------------- real shapes (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["decode-b64", "decode-b1-split-16k", "mixed"])
def test_unified_attention_fp8_llama8b_shapes(cuda_device, seed, case):
    query_lens, context_lens = {
        "decode-b64": ([1] * 64, torch.randint(1, 4000, (64,)).tolist()),
        "decode-b1-split-16k": ([1], [16384]),
        "mixed": ([1] * 16 + [100, 37], torch.randint(1, 3000, (16,)).tolist() + [500, 0]),
    }[case]
    batch = PagedBatch(query_lens, context_lens, 32, 8, 128, 16, torch.bfloat16, cuda_device, num_pad_tokens=4)
    _check_unified(batch, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128], ids=["pointer", "tma-on-sm90"])
def test_prefill_attention_fp8_llama8b_shapes(cuda_device, seed, block_size):
    batch = PagedBatch([2048, 1, 777], [0, 5000, 2500], 32, 8, 128, block_size, torch.bfloat16, cuda_device,
                       num_pad_tokens=8, spare_blocks=50)
    _check_prefill(batch, torch.bfloat16)


@pytest.mark.gpu
def test_fused_decode_fp8_cuda_graph_replays_loaded_scales(cuda_device):
    """Scales are read by pointer: a step captured in a CUDA graph and replayed gives the eager
    step's logits, and a scale changed after capture is seen by the replay."""
    _, fused = _tiny_models(cuda_device, torch.bfloat16)
    caches = allocate_kv_caches(fused.spec, 8, BLOCK, FP8, cuda_device)
    blocks = list(range(1, 8))
    with torch.inference_mode():
        ids, pos, meta = build_step([StepRequest([3, 9, 27, 41], 0, blocks)], BLOCK, cuda_device)
        fused(ids, pos, caches, meta)
        ids, pos, meta = build_step([StepRequest([11], 4, blocks)], BLOCK, cuda_device)
        eager = fused.compute_logits(fused(ids, pos, caches, meta))
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = fused(ids, pos, caches, meta)
        graph.replay()
        assert torch.equal(fused.compute_logits(hidden), eager)
        for layer in fused.model.layers:
            layer.self_attn.kv_scales.load("v", torch.tensor(3.0), "v_scale")
        graph.replay()
        assert not torch.equal(fused.compute_logits(hidden), eager)
