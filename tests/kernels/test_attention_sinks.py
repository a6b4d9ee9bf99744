"""Attention sinks (gpt-oss) in the Triton attention kernels against the torch backend, the oracle (which
tests/models/test_gpt_oss.py holds to transformers): the unified kernel on mixed batches and split-KV
decodes, the prefill kernel on a 130-token chunk, with and without a sliding window; and a whole tiny
gpt-oss on the Triton kernel set (sinks, the experts' biases and clamped SwiGLU in kernels/fused_moe.py)
against the torch set. Runs on CUDA, or on CPU in the Triton interpreter child (conftest.py)."""

from __future__ import annotations

import pytest
import torch
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.attention.torch_backend import TorchAttentionBackend
from ferrox.attention.triton_backend import TritonAttentionBackend
from ferrox.kernels.paged_attention import unified_attention
from ferrox.kernels.reshape_and_cache import reshape_and_cache
from ferrox.loader.model_config import spec_from_hf_config
from ferrox.loader.model_loader import init_dummy_weights
from ferrox.model_spec import spec_for_context
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.interpreter import INTERPRETED, interpreted_or, prefill_kernel_from, wide_row_tiles
from tests.kernels.kernel_refs import relative_error

BLOCK = 8
HEADS, KV_HEADS, DIM = 4, 2, 16


def _step(device, requests: list[tuple[int, int]]):
    """A step of (query_len, context_len) requests with random q/k/v, a cache holding random context."""
    gen = torch.Generator().manual_seed(sum(q * 31 + c for q, c in requests))
    reqs, nxt = [], 1
    for q_len, context in requests:
        blocks = -(-(q_len + context) // BLOCK)
        reqs.append(StepRequest([0] * q_len, context, list(range(nxt, nxt + blocks))))
        nxt += blocks
    _, _, meta = build_step(reqs, BLOCK, device)
    t = meta.num_actual_tokens
    q, k, v = (torch.randn(t, h, DIM, generator=gen).to(device) for h in (HEADS, KV_HEADS, KV_HEADS))
    cache = torch.randn(2, nxt, BLOCK, KV_HEADS, DIM, generator=gen).to(device)
    sinks = (torch.randn(HEADS, generator=gen) * 2.0).to(device)
    return q, k, v, cache, meta, sinks


def _both(q, k, v, cache, meta, sinks, window: int):
    ref = TorchAttentionBackend()
    ref.begin_forward(meta)
    want = ref.forward(q, k, v, cache.clone(), meta, 0.25, window=window, sinks=sinks)
    backend = TritonAttentionBackend()
    backend.begin_forward(meta)
    got = backend.forward(q, k, v, cache.clone(), meta, 0.25, window=window, sinks=sinks)
    return got, want


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("requests", [[(1, 9), (1, 30), (7, 0), (12, 5)], [(130, 0), (1, 20)], [(3, 140)]],
                         ids=["mixed", "prefill-kernel", "chunk-after-context"])
def test_triton_backend_with_sinks_matches_torch(kernel_device, requests, window):
    q, k, v, cache, meta, sinks = _step(kernel_device, requests)
    got, want = _both(q, k, v, cache, meta, sinks, window)
    assert relative_error(got, want) < 1e-5
    # The sinks change the result (so the comparison above tests them).
    without = TorchAttentionBackend()
    without.begin_forward(meta)
    assert (without.forward(q, k, v, cache.clone(), meta, 0.25, window=window) - want).abs().max() > 1e-3


@pytest.mark.parametrize("window", [0, 5])
def test_split_kv_decode_with_sinks_matches_torch(kernel_device, window):
    """Forced split-KV (the sink rides in each request's first split, the merge weighs it in)."""
    q, k, v, cache, meta, sinks = _step(kernel_device, [(1, 70), (1, 9), (1, 33)])
    _, want = _both(q, k, v, cache, meta, sinks, window)
    written = cache.clone()
    reshape_and_cache(k, v, written, meta.slot_mapping)
    for splits in (2, 3):
        got = unified_attention(q, written, meta.query_start_loc, meta.seq_lens, meta.block_table, max_query_len=1,
                                max_seq_len=meta.max_seq_len, scale=0.25, num_splits=splits, window=window,
                                sinks=sinks)
        assert relative_error(got, want) < 1e-5, splits


def test_sinks_must_be_float32_per_head(kernel_device):
    q, k, v, cache, meta, sinks = _step(kernel_device, [(1, 9)])
    with pytest.raises(ValueError, match="sinks"):
        unified_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_table, max_query_len=1,
                          max_seq_len=meta.max_seq_len, scale=0.25, sinks=sinks[:2])


def test_cudnn_and_the_cuda_decode_kernel_step_aside_for_sinks(kernel_device, monkeypatch):
    """Neither cuDNN prefill nor the CUDA decode kernel has sinks: with the paths on (as on an sm90 GPU), a
    layer with sinks is attended by the Triton kernels; the first layer's sinks turn cuDNN off."""
    from ferrox.kernels import cudnn_prefill, decode_attention_cuda

    def refuse(*args, **kwargs):
        raise AssertionError("a path without sinks was taken")

    monkeypatch.setattr(cudnn_prefill, "CUDNN_MIN_LEN", 128)
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_request", refuse)
    monkeypatch.setattr(decode_attention_cuda, "supported", lambda *args: True)
    monkeypatch.setattr(decode_attention_cuda, "decode_attention", refuse)
    q, k, v, cache, meta, sinks = _step(kernel_device, [(1, 20), (130, 0)])
    ref = TorchAttentionBackend()
    ref.begin_forward(meta)
    want = ref.forward(q, k, v, cache.clone(), meta, 0.25, sinks=sinks)
    backend = TritonAttentionBackend()
    backend._long_block_size = 16  # the path on, as _decide_long_path sets it on an sm90 GPU
    backend.begin_forward(meta)
    assert backend._plan_for(meta).long_requests  # the long chunk would take cuDNN without sinks
    got = backend.forward(q, k, v, cache.clone(), meta, 0.25, sinks=sinks)
    assert relative_error(got, want) < 1e-5
    q, k, v, cache, meta, sinks = _step(kernel_device, [(1, 20), (1, 9)])  # decode-only: the CUDA kernel's step
    got = TritonAttentionBackend().forward(q, k, v, cache.clone(), meta, 0.25, sinks=sinks)
    assert relative_error(got, _both(q, k, v, cache, meta, sinks, 0)[1]) < 1e-5
    monkeypatch.setattr(cudnn_prefill, "cudnn_prefill_applies", lambda *args: True)
    monkeypatch.setattr(cudnn_prefill, "enable_bucketed_plans", lambda: True)
    fresh = TritonAttentionBackend()
    fresh._decide_long_path(q, cache, sinks)
    assert fresh._long_block_size == 0


GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "intermediate_size": 32, "num_hidden_layers": 2, "vocab_size": 61, "num_local_experts": 6,
    "num_experts_per_tok": 4, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    "sliding_window": 20, "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 1.0,
    "attention_bias": True, "rope_theta": 150000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0,
                     "beta_slow": 1.0, "truncate": False},
}


@torch.inference_mode()
def _run(model, device: torch.device, prompt: list[int], decode: list[int]) -> torch.Tensor:
    caches = allocate_kv_caches(model.spec, 24, 16, torch.float32, device)
    blocks = list(range(1, 24))
    ids, pos, meta = build_step([StepRequest(prompt, 0, blocks)], 16, device)
    rows = [model.compute_logits(model(ids, pos, caches, meta)[-1:])]
    for i, token in enumerate(decode):
        ids, pos, meta = build_step([StepRequest([token], len(prompt) + i, blocks)], 16, device)
        rows.append(model.compute_logits(model(ids, pos, caches, meta)))
    return torch.cat(rows)


def test_gpt_oss_on_triton_kernels_matches_torch(kernel_device, monkeypatch):
    """A 130-token prompt (the prefill kernel; grouped expert GEMMs with biases and the clamped SwiGLU), then
    one-token steps (the unified kernel; the small-batch expert kernels). Interpreted, a 48-token prompt
    (past the 20-token window, two query tiles) reaches the prefill kernel, and the one-token products take
    wide row tiles (tests/helpers/interpreter.py)."""
    prompt_len = interpreted_or(130, 48)
    launches = prefill_kernel_from(monkeypatch, prompt_len)
    if INTERPRETED:
        wide_row_tiles(monkeypatch)
    spec = spec_for_context(spec_from_hf_config(GPT_OSS, "test config"), 512)
    cls = get_model_class(GPT_OSS["architectures"])
    ref = cls(spec, torch.float32, kernel_device, kernels="torch")
    init_dummy_weights(ref, seed=3)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(4)
        for name, param in ref.named_parameters():
            if not name.endswith("norm.weight"):  # biases and sinks too (dummy weights leave them at 0)
                param.copy_(torch.randn(param.shape, generator=gen) * (1.0 if name.endswith("sinks") else 0.3))
    triton_model = cls(spec, torch.float32, kernel_device, kernels="triton")
    triton_model.load_state_dict(ref.state_dict())
    for model in (ref, triton_model):
        model.finalize_weights()
        model.eval()
    assert triton_model.model.layers[0].mlp.experts.triton and triton_model.backend.name == "triton"
    prompt = [(7 * i + 3) % 61 for i in range(prompt_len)]
    expected = _run(ref, kernel_device, prompt, [11, 42, 5])
    got = _run(triton_model, kernel_device, prompt, [11, 42, 5])
    assert len(launches) == 2  # the prompt's step, in each layer
    assert relative_error(got, expected) < 1e-4
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
