"""vLLM's long_prefill_token_threshold: a prompt is computed at most that many tokens a step (so a long
one shares steps with others), with the same tokens as the uncapped engine; refused without chunked
prefill."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams

from tests.engine.conftest import TEST_KV_CACHE_MEMORY
from tests.engine.test_chunked_prefill_off import steps_to_finish


def test_prefill_chunks_are_capped_with_the_same_tokens(llm):
    capped = LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=4096, max_num_seqs=32,
                 long_prefill_token_threshold=64)
    prompt = [(i * 53) % 40000 + 100 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    free_steps, free_ids = steps_to_finish(llm, prompt, params)
    capped_steps, capped_ids = steps_to_finish(capped, prompt, params)
    assert (free_steps, capped_steps) == (3, 7)  # one prefill step + 2 decodes; five chunks of <= 64 + 2
    assert capped_ids == free_ids
    # A short prompt arriving beside the long one is not held behind it: both share the capped steps.
    # (a prompt not in the prefix cache yet)
    other = [(i * 71) % 40000 + 100 for i in range(300)]
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = capped.generate([{"prompt_token_ids": other}, "Hello"], [params, short], use_tqdm=False)
    assert outs[1].metrics.first_token_time < outs[0].metrics.first_token_time


def test_refused_without_chunked_prefill():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(dtype="float32", enable_chunked_prefill=False, long_prefill_token_threshold=64)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(dtype="float32", long_prefill_token_threshold=-1)
