"""Chunked local attention (Llama 4: a query at p sees keys (p // C) * C <= k <= p) in the Triton kernels against
the torch backend, the oracle (which tests/models/test_llama4.py holds to transformers): the unified kernel on
decodes, mixed batches and split-KV decodes, the prefill kernel on long chunks (tiles across chunk edges, and
tiles inside one TILE_N-aligned chunk that keep the unmasked phase), with a sliding window too. Runs on CUDA, or
on CPU in the Triton interpreter child (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.torch_backend import TorchAttentionBackend
from ferrox.attention.triton_backend import TritonAttentionBackend
from ferrox.kernels.paged_attention import unified_attention
from ferrox.kernels.prefill_attention import PrefillLaunchConfig, prefill_attention

from tests.helpers.interpreter import interpreted_or, prefill_kernel_from
from tests.kernels.kernel_refs import PagedBatch, relative_error
from tests.kernels.test_triton_backend import TOLERANCE, _dtype, _meta


def _reference(batch: PagedBatch, *, chunk: int, window: int = 0) -> torch.Tensor:
    meta = _meta(batch)
    backend = TorchAttentionBackend()
    backend.begin_forward(meta)
    return backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), meta, batch.scale, window=window,
                           chunk=chunk)


def _written(batch: PagedBatch) -> torch.Tensor:
    """The cache with this step's k/v written (what the kernels read)."""
    cache = batch.kv_cache.clone()
    TorchAttentionBackend().forward(batch.q, batch.k, batch.v, cache, _meta(batch), batch.scale)
    return cache


def test_torch_backend_masks_each_query_to_its_chunk():
    """The oracle itself against attention written out position by position (one request, cached context)."""
    batch = PagedBatch([12], [21], 2, 1, 8, 8, torch.float32, torch.device("cpu"))
    out = _reference(batch, chunk=8)
    cache = _written(batch)
    n_blocks = -(-33 // 8)
    keys = cache[0, batch.block_table[0, :n_blocks].long()].flatten(0, 1)[:33, 0]  # [33, D]
    values = cache[1, batch.block_table[0, :n_blocks].long()].flatten(0, 1)[:33, 0]
    for i in range(12):
        p = 21 + i
        lo = p // 8 * 8
        for h in range(2):
            probs = torch.softmax(keys[lo:p + 1] @ batch.q[i, h] * batch.scale, dim=0)
            torch.testing.assert_close(out[i, h], probs @ values[lo:p + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("query_lens, context_lens, chunk, window", [
    ([1, 1, 1], [5, 90, 31], 16, 0),  # decode-only: the unified kernel (the CUDA decode kernel has no chunks)
    ([6, 1, 9], [0, 20, 47], 8, 0),  # short chunks across attention-chunk edges, mixed with a decode
    ([1, 150, 3], [40, 20, 7], 16, 0),  # a long chunk: the prefill kernel, every tile across chunk edges
    ([150, 1], [200, 70], 128, 0),  # TILE_N-aligned chunks: tiles inside one chunk keep the unmasked phase
    ([1, 150, 3], [40, 20, 7], 16, 5),  # a window inside the chunk too
    ([5, 11, 3], [0, 0, 0], 200, 0),  # a chunk longer than every request: full attention
])
def test_triton_backend_with_chunks_matches_torch(kernel_device, seed, query_lens, context_lens, chunk, window):
    dtype = _dtype(kernel_device)
    batch = PagedBatch(query_lens, context_lens, 4, 2, 32, 16, dtype, kernel_device)
    meta = _meta(batch)
    ref = _reference(batch, chunk=chunk, window=window)
    backend = TritonAttentionBackend()
    backend.begin_forward(meta)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.q, batch.k, batch.v, cache, meta, batch.scale, window=window, chunk=chunk)
    n = batch.num_actual_tokens
    assert not out[:n].isnan().any()
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]
    full = _reference(batch, chunk=0, window=window)
    if chunk < max(c + q for c, q in zip(context_lens, query_lens, strict=True)):
        assert relative_error(ref[:n], full[:n]) > 10 * TOLERANCE[dtype]  # the chunks matter here
    else:
        assert relative_error(ref[:n], full[:n]) < TOLERANCE[dtype]


def test_split_kv_decode_with_chunks_matches_torch(kernel_device, seed):
    """Split-KV: the splits before a query's chunk hold nothing and weigh nothing in the merge."""
    dtype = _dtype(kernel_device)
    batch = PagedBatch([1, 1], [300, 41], 4, 2, 32, 16, dtype, kernel_device)
    ref = _reference(batch, chunk=64)
    meta = _meta(batch)
    out = unified_attention(batch.q, _written(batch), meta.query_start_loc, meta.seq_lens, meta.block_table,
                            max_query_len=1, max_seq_len=batch.max_seq_len, scale=batch.scale, num_splits=4, chunk=64)
    assert relative_error(out[:2], ref[:2]) < TOLERANCE[dtype]


@pytest.mark.parametrize("chunk", [16, 24])
def test_prefill_kernel_small_tiles_with_chunks_matches_torch(kernel_device, seed, chunk):
    """16-position tiles: chunks of 16 start on a tile boundary (tiles within one chunk run unmasked up to their
    first query), chunks of 24 do not (every tile masked)."""
    dtype = _dtype(kernel_device)
    batch = PagedBatch([70, 33], [9, 50], 4, 2, 32, 16, dtype, kernel_device)
    ref = _reference(batch, chunk=chunk)
    meta = _meta(batch)
    config = PrefillLaunchConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1)
    out = prefill_attention(batch.q, _written(batch), meta.query_start_loc, meta.seq_lens, meta.block_table,
                            scale=batch.scale, config=config, use_tma=False, chunk=chunk)
    n = batch.num_actual_tokens
    assert relative_error(out[:n], ref[:n]) < TOLERANCE[dtype]


def test_cudnn_and_the_cuda_decode_kernel_step_aside_for_chunks(kernel_device, monkeypatch):
    """Neither cuDNN prefill nor the CUDA decode kernel has chunks: with the paths on (as on an sm90 GPU), a
    chunked layer is attended by the Triton kernels."""
    from ferrox.kernels import cudnn_prefill, decode_attention_cuda

    def refuse(*args, **kwargs):
        raise AssertionError("a path without chunks was taken")

    monkeypatch.setattr(cudnn_prefill, "CUDNN_MIN_LEN", 128)
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", refuse)
    monkeypatch.setattr(decode_attention_cuda, "supported", lambda *args: True)
    monkeypatch.setattr(decode_attention_cuda, "decode_attention", refuse)
    dtype = _dtype(kernel_device)
    for query_lens, context_lens in (([1, 130], [20, 0]), ([1, 1], [20, 9])):  # a long chunk; decode-only
        batch = PagedBatch(query_lens, context_lens, 4, 2, 32, 16, dtype, kernel_device)
        meta = _meta(batch)
        backend = TritonAttentionBackend()
        backend._long_block_size = 16  # the path on, as _decide_long_path sets it on an sm90 GPU
        backend.begin_forward(meta)
        got = backend.forward(batch.q, batch.k, batch.v, batch.kv_cache.clone(), meta, batch.scale, chunk=16)
        n = batch.num_actual_tokens
        assert relative_error(got[:n], _reference(batch, chunk=16)[:n]) < TOLERANCE[dtype]


LLAMA4 = {
    "architectures": ["Llama4ForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 32, "intermediate_size_mlp": 48, "num_hidden_layers": 4, "vocab_size": 61,
    "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "torch_dtype": "float32", "no_rope_layers": [1, 1, 0, 1], "attention_chunk_size": 32,
    "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 16, "attn_scale": 0.5,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def test_llama4_on_triton_kernels_matches_torch(kernel_device, monkeypatch):
    """A 158-token prompt (the prefill kernel with 32-token chunks, the fused experts, the rotary kernel on
    reordered q/k rows), then one-token steps (the unified kernel) crossing into the next chunk.
    Interpreted: two layers (a chunked RoPE layer with a dense MLP, a NoPE layer of full attention with the
    experts: every kind the four hold) and a 62-token prompt (two chunks), which reaches the prefill kernel
    (tests/helpers/interpreter.py) and whose steps cross the chunk edge at 64."""
    from ferrox.loader.model_config import spec_from_hf_config
    from ferrox.loader.model_loader import init_dummy_weights
    from ferrox.model_spec import spec_for_context
    from ferrox.models.registry import get_model_class

    from tests.kernels.test_attention_sinks import _run

    config = interpreted_or(LLAMA4, LLAMA4 | {"num_hidden_layers": 2, "no_rope_layers": [1, 0]})
    prompt_len = interpreted_or(158, 62)
    launches = prefill_kernel_from(monkeypatch, prompt_len)
    spec = spec_for_context(spec_from_hf_config(config, "test config"), 512)
    cls = get_model_class(config["architectures"])
    ref = cls(spec, torch.float32, kernel_device, kernels="torch")
    init_dummy_weights(ref, seed=3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(4)
        for name, param in ref.named_parameters():
            if not name.endswith("norm.weight"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    triton_model = cls(spec, torch.float32, kernel_device, kernels="triton")
    triton_model.load_state_dict(ref.state_dict())
    for model in (ref, triton_model):
        model.finalize_weights()
        model.eval()
    assert triton_model.backend.name == "triton" and triton_model.model.layers[1].feed_forward.experts.triton
    assert triton_model.model.layout.chunk == interpreted_or((32, 32, 0, 32), (32, 0))
    assert triton_model.model.layout.moe == interpreted_or((False, True, False, True), (False, True))
    prompt = [(7 * i + 3) % 61 for i in range(prompt_len)]
    # Positions 158..161 cross the chunk edge at 160 (interpreted: 62..65, the edge at 64).
    expected = _run(ref, kernel_device, prompt, [11, 42, 5, 9])
    got = _run(triton_model, kernel_device, prompt, [11, 42, 5, 9])
    assert len(launches) == 2  # the prompt's step, in each layer
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
