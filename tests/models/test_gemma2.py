"""Gemma 2 against transformers on a tiny random checkpoint: four norms a layer with (1 + weight), the
sqrt(hidden) embedding scale under a tied LM head, the GELU-tanh MLP, query_pre_attn_scalar, and both
soft caps (attention scores and logits) -- logits and greedy tokens through chunked prefill over paged
blocks, then through the engine (its sliding window: tests/models/test_sliding_window.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import UnsupportedModelError

from tests.helpers import tiny_models
from tests.helpers.driver import run_greedy
from tests.models.conftest import cut_at_eos, hf_greedy, hf_last_logits

transformers = pytest.importorskip("transformers")

WINDOW = 128
PROMPTS = [[5, 9, 11], [100, 7, 300, 45, 2, 9, 77, 13], list(range(3, 83))]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(folder, ferrox model, transformers model, the same checkpoint without soft caps in transformers)."""
    root = tmp_path_factory.mktemp("gemma2")
    folder = tiny_models.make_tiny_gemma2(root / "gemma2", sliding_window=WINDOW, seed=31)
    source = resolve_model(folder)
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    uncapped = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_logit_softcapping=None, final_logit_softcapping=None).eval()
    return folder, model, ref, uncapped


@torch.inference_mode()
def test_greedy_and_logits_match_transformers(gemma):
    folder, model, ref, uncapped = gemma
    ours, logits = run_greedy(model, PROMPTS, 10, block_size=8, prefill_chunk=7, return_prefill_logits=True)
    for i, ids in enumerate(PROMPTS):
        expected = hf_last_logits(ref, ids)
        torch.testing.assert_close(logits[i], expected, atol=1e-4, rtol=1e-4)
        assert cut_at_eos(ours[i], [tiny_models.EOS_TOKEN_ID]) == hf_greedy(ref, ids, 10), i
        # The caps bend these logits (a check that the comparison above tests them).
        assert (hf_last_logits(uncapped, ids) - expected).abs().max() > 0.1
    assert logits.abs().max() <= 3.0  # final_logit_softcapping 3.0


def test_engine_matches_transformers(gemma):
    """The real engine with a 16-token step budget over the whole context (max_position_embeddings 256,
    its sliding window of 128 on every other layer)."""
    folder, _, ref, _ = gemma
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        assert llm.engine.max_model_len == 256
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        want = hf_greedy(ref, prompt, 8)
        got = list(out.outputs[0].token_ids)
        assert cut_at_eos(got, [tiny_models.EOS_TOKEN_ID]) == want


def test_other_activations_are_refused_by_name(gemma, tmp_path):
    folder = str(tmp_path / "relu")
    shutil.copytree(gemma[0], folder)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config["hidden_activation"] = "relu"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModelError, match=r"config\.json: hidden_activation 'relu' is not supported"):
        LLM(model=folder, kv_cache_memory=8 << 20)


@torch.inference_mode()
def test_lora_adapter_matches_peft_merged(gemma, tmp_path):
    """An adapter over every projection (LoRAManager wraps the Llama projection names Gemma 2 keeps),
    against peft's merged weights in transformers."""
    pytest.importorskip("peft")
    import numpy as np
    from ferrox.attention.kv_cache import allocate_kv_caches
    from ferrox.lora.manager import LoRAManager
    from ferrox.lora.request import LoRARequest

    from tests.helpers.driver import StepRequest, build_step
    from tests.lora.adapters import make_peft_adapter, merged_reference

    folder, _, ref, _ = gemma
    adapter = make_peft_adapter(ref, tmp_path / "adapter", r=4, lora_alpha=8, seed=5,
                                target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"))
    merged = merged_reference(ref, adapter)
    source = resolve_model(folder)
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    manager = LoRAManager(model, max_loras=1, max_lora_rank=4, max_cpu_loras=None, device="cpu",
                          dtype=torch.float32, max_num_tokens=64)
    manager.add_adapter(LoRARequest("a", 1, adapter))
    prompt = PROMPTS[1]
    caches = allocate_kv_caches(model.spec, 2, 16, torch.float32, "cpu")
    ids, pos, meta = build_step([StepRequest(prompt, 0, [1])], 16, "cpu")
    manager.prepare_step(np.ones(len(prompt), dtype=np.int64))
    logits = model.compute_logits(model(ids, pos, caches, meta)[-1:])[0]
    torch.testing.assert_close(logits, hf_last_logits(merged, prompt), atol=1e-4, rtol=1e-4)
    assert (hf_last_logits(merged, prompt) - hf_last_logits(ref, prompt)).abs().max() > 1e-2
