"""The prefill attention kernel (and the backend's prefill/decode split) against a float32 reference.

On CPU these run in the Triton interpreter at tiny shapes, the TMA path included (the interpreter
emulates tensor descriptors; tile_n 16 with block_size 16 makes every K/V tile one box). On the
GPU the same tests run natively, plus Llama-class shapes (GQA 4 and 8, head_dim 64 and 128,
block sizes 16 (pointer loads) and 128 (TMA on sm90)).
"""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.backend import get_attention_backend
from ferrox.attention.metadata import AttentionMetadata
from ferrox.attention.triton_backend import PREFILL_MIN_QUERY_LEN
from ferrox.kernels.prefill_attention import PrefillLaunchConfig, prefill_attention, tma_usable
from ferrox.kernels.reshape_and_cache import reshape_and_cache

from tests.kernels.kernel_refs import PagedBatch, relative_error, sliced_paged_attention_ref

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
# Small tiles so tiny shapes still cross several unmasked tiles, the diagonal and a ragged end.
TINY_CONFIG = PrefillLaunchConfig(block_m=32, tile_n=16, num_warps=4, num_stages=1)

# (query_lens, context_lens, heads, kv_heads, head_dim, block_size)
TINY_CASES = {
    "fresh-prompt-gqa4": ([70], [0], 8, 2, 32, 16),
    "chunk-after-context-gqa8-dim64": ([40], [100], 8, 1, 64, 16),
    "ragged-with-decodes-block8": ([1, 23, 1, 50], [30, 0, 7, 45], 4, 1, 16, 8),
    "gqa3-dim24-block4": ([19, 6], [5, 33], 6, 2, 24, 4),
    "block1-profiling-layout": ([21, 9], [0, 0], 4, 2, 16, 1),
}


def _run(batch: PagedBatch, config: PrefillLaunchConfig | None, use_tma: bool | None) -> torch.Tensor:
    reshape_and_cache(batch.k, batch.v, batch.kv_cache, batch.slot_mapping)
    out = torch.full_like(batch.q, float("nan"))  # poison: unwritten rows stay NaN
    prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                      scale=batch.scale, out=out, config=config, use_tma=use_tma)
    return out


def _check(batch: PagedBatch, dtype: torch.dtype, config: PrefillLaunchConfig | None = None,
           use_tma: bool | None = None) -> None:
    out = _run(batch, config, use_tma)
    ref = sliced_paged_attention_ref(batch)
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any(), "attention left output rows unwritten"
    err = relative_error(out[:n], ref[:n])
    assert err < TOLERANCE[dtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
@pytest.mark.parametrize("case", list(TINY_CASES), ids=list(TINY_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_prefill_attention_tiny(kernel_device, seed, case, dtype, use_tma):
    if dtype == torch.bfloat16 and kernel_device.type == "cpu":
        pytest.skip("bf16 tl.dot is broken in the Triton interpreter (see test_paged_attention.py)")
    query_lens, context_lens, heads, kv_heads, head_dim, block_size = TINY_CASES[case]
    batch = PagedBatch(query_lens, context_lens, heads, kv_heads, head_dim, block_size, dtype, kernel_device,
                       num_pad_tokens=3, spare_blocks=7)
    if use_tma and not tma_usable(batch.kv_cache, TINY_CONFIG):
        pytest.skip("TMA needs whole tiles per block and a power-of-two head_dim (and sm90 on a GPU)")
    _check(batch, dtype, TINY_CONFIG, use_tma)


def test_prefill_attention_default_config(kernel_device, seed):
    """The launch config the engine uses on this device (the Hopper one on an H200)."""
    dtype = torch.float16
    batch = PagedBatch([150, 1, 97], [0, 60, 200], 8, 2, 64, 16, dtype, kernel_device, num_pad_tokens=5)
    _check(batch, dtype)


def test_rejects_tma_when_tiles_span_blocks(kernel_device):
    batch = PagedBatch([20], [0], 4, 2, 16, 8, torch.float32, kernel_device)
    with pytest.raises(ValueError, match="use_tma"):
        _run(batch, TINY_CONFIG, use_tma=True)


def test_rejects_non_positive_scale(kernel_device):
    batch = PagedBatch([4], [0], 2, 1, 16, 16, torch.float32, kernel_device)
    with pytest.raises(ValueError, match="scale"):
        prefill_attention(batch.q, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_table,
                          scale=0.0)


def _meta(batch: PagedBatch) -> AttentionMetadata:
    return AttentionMetadata(
        num_actual_tokens=batch.num_actual_tokens, max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len, slot_mapping=batch.slot_mapping, query_start_loc=batch.query_start_loc,
        seq_lens=batch.seq_lens, block_table=batch.block_table, query_start_loc_cpu=batch.query_start_loc.cpu(),
        seq_lens_cpu=batch.seq_lens.cpu(), decode_only=batch.max_query_len == 1,
    )


@pytest.mark.parametrize("with_cache", [True, False], ids=["cached", "profiling-no-cache"])
def test_backend_splits_leading_decodes_from_prefill(kernel_device, seed, with_cache):
    """A step with a long chunk: its leading decodes run the unified kernel, the rest the prefill
    kernel, into one output that matches the torch reference backend."""
    dtype = torch.bfloat16 if kernel_device.type == "cuda" else torch.float32
    chunk = PREFILL_MIN_QUERY_LEN + 7
    if with_cache:
        batch = PagedBatch([1, 1, chunk, 5], [40, 9, 30, 12], 8, 2, 32, 16, dtype, kernel_device, num_pad_tokens=2)
    else:  # the profiling forward: no cache, every request a fresh prompt (1-token ones lead)
        batch = PagedBatch([1, chunk, 3], [0, 0, 0], 8, 2, 32, 16, dtype, kernel_device)
    meta = _meta(batch)
    cache = batch.kv_cache if with_cache else batch.kv_cache[:, :0]
    ref = get_attention_backend(kernel_device, "torch").forward(batch.q, batch.k, batch.v, cache.clone(), meta,
                                                                batch.scale)
    backend = get_attention_backend(kernel_device, "triton")
    backend.begin_forward(meta)
    out = backend.forward(batch.q, batch.k, batch.v, cache, meta, batch.scale)
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any()
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]


# Llama-class shapes: (heads, kv_heads, head_dim) for GQA 4 / head_dim 128 (Llama-3.1-8B), GQA 8 /
# head_dim 128, GQA 8 / head_dim 64.
GPU_HEADS = {"gqa4-d128": (32, 8, 128), "gqa8-d128": (32, 4, 128), "gqa8-d64": (16, 2, 64)}


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("heads", list(GPU_HEADS), ids=list(GPU_HEADS))
def test_prefill_attention_real_shapes(cuda_device, seed, heads, block_size):
    """Ragged chunks (fresh, after a long context, one-token rows between them), block tables
    through a cache with unused blocks between the live ones, bf16."""
    num_heads, num_kv_heads, head_dim = GPU_HEADS[heads]
    query_lens = [2048, 1, 777, 4096, 1]
    context_lens = [0, 5000, 2500, 12000, 900]
    batch = PagedBatch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, torch.bfloat16,
                       cuda_device, num_pad_tokens=8, spare_blocks=400 if block_size == 16 else 50)
    _check(batch, torch.bfloat16)


@pytest.mark.gpu
def test_prefill_chunk_at_long_context(cuda_device, seed):
    """The last 8192-token chunk of a 64k prompt (the shape of long-context TTFT), Llama-3.1-8B heads."""
    batch = PagedBatch([8192], [65536 - 8192], 32, 8, 128, 16, torch.bfloat16, cuda_device)
    _check(batch, torch.bfloat16)
