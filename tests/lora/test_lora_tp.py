"""Multi-LoRA under tensor parallelism on CPU (gloo): the tiny Llama sharded over 2 rank processes, each
holding its share of every adapter (lora/layers.py), serves a mixed batch of the base model and two PEFT
adapters (one on every projection, one on q/v/down with rsLoRA) with exactly the greedy tokens transformers
gives with each adapter merged, through chunked prefill; with max_loras=1 the slot is swapped between the
adapters every few steps, the driver's slot plan followed by the other rank (lora/rank_plan.py), and with
n-gram speculation the verify steps go through the sharded adapters too."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams

from tests.helpers.tiny_models import EOS_TOKEN_ID
from tests.lora.adapters import merged_greedy, two_adapters
from tests.models.conftest import cut_at_eos

pytestmark = pytest.mark.slow

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], list(range(3, 43)), [1, 5, 6, 7, 5, 6, 7, 5, 6, 7], [1, 77, 78]]
MAX_TOKENS = 12
NAMES = ["a1", "base", "a2", "a1", "a2", "base", "a2", "a1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir, base, adapters = two_adapters(tmp_path_factory)
    return base_dir, adapters, merged_greedy(base, adapters, PROMPTS, MAX_TOKENS, EOS_TOKEN_ID)


@pytest.mark.parametrize("max_loras,spec", [(2, None), (1, {"method": "ngram", "num_speculative_tokens": 3,
                                                           "prompt_lookup_max": 2})])
def test_sharded_adapters_match_peft_merged(setup, max_loras, spec):
    base_dir, adapters, refs = setup
    llm = LLM(base_dir, tensor_parallel_size=2, device="cpu", enable_lora=True, max_loras=max_loras,
              max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=8 << 20,
              speculative_config=spec)
    try:
        prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(NAMES))]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False,
                            lora_request=[adapters.get(n) for n in NAMES])
        got = [cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID]) for o in outs]
        assert got == [refs[n][i % len(PROMPTS)] for i, n in enumerate(NAMES)]
        if spec is not None:
            assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.gpu
def test_sharded_adapters_on_two_gpus(setup):
    """The same on 2 GPUs (NCCL, CUDA graphs; skipped with fewer): each request's greedy tokens equal one GPU's."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    base_dir, adapters, refs = setup
    common = dict(device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                  kv_cache_memory=64 << 20, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(NAMES))]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    loras = [adapters.get(n) for n in NAMES]
    got = {}
    for tp in (1, 2):
        llm = LLM(base_dir, tensor_parallel_size=tp, **common)
        try:
            got[tp] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False,
                                                                        lora_request=loras)]
        finally:
            llm.engine.shutdown()
    assert got[2] == got[1]
