"""Shared, expensive fixtures for the engine tests: one engine and one transformers reference
model per session. Further engines (other scheduler settings) reuse the loaded weights."""

from __future__ import annotations

import os

import pytest
import torch

# A small KV cache keeps start-up fast; tests that need preemption build their own engine. Engines on the
# embedded model run dtype float32 (its GGUF dequantized): the tests compare with transformers and
# across batch shapes bit for bit, which the default quantized CPU path (bf16 activations) does not promise.
TEST_KV_CACHE_MEMORY = 192 << 20


@pytest.fixture(scope="session")
def llm():
    from ferrox import LLM

    # max_model_len within the cache's 4368 tokens: start-up refuses an engine that cannot finish one
    # full-length request (model_setup.check_kv_capacity).
    return LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=4096, max_num_seqs=32)


@pytest.fixture(scope="session")
def kv_bound_llm():
    """An engine whose KV cache (4368 tokens) holds less than its max_model_len (8192), built past the
    start-up check that refuses it, for the tests of the engine's own KV-capacity request rule."""
    from ferrox import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("ferrox.worker.model_setup.check_kv_capacity", lambda *args, **kwargs: None)
        return LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_num_seqs=32)


@pytest.fixture(scope="session")
def hf_model():
    """transformers on the same GGUF file, float32: the greedy-token and logprob reference."""
    transformers = pytest.importorskip("transformers")
    from ferrox.loader.source import resolve_model

    path = resolve_model(None).path
    folder, name = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    return model
