"""Shared, expensive fixtures for the engine tests: one engine and one transformers reference
model per session. Further engines (other scheduler settings) reuse the loaded weights."""

from __future__ import annotations

import os

import pytest
import torch

# A small KV cache keeps start-up fast; tests that need preemption build their own engine.
TEST_KV_CACHE_MEMORY = 192 << 20


@pytest.fixture(scope="session")
def llm():
    from ferrox import LLM

    return LLM(kv_cache_memory=TEST_KV_CACHE_MEMORY, max_num_seqs=32)


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
