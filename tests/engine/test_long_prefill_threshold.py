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


def test_partial_prefills_let_a_short_prompt_pass_long_ones(llm):
    """vLLM's max_num_partial_prefills / max_long_partial_prefills (rust/partial_prefills.rs): two prompts
    prefill together, one of them long, so a short prompt queued behind two long ones starts at once and
    the second long one waits for the first; the tokens are those of the default engine."""
    engine = LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=4096, max_num_seqs=32,
                 max_num_batched_tokens=128, max_num_partial_prefills=2, max_long_partial_prefills=1)
    try:
        # (The threshold defaults to 4% of the context, as vLLM's: 163 tokens of 4096; without one the core
        # refuses max_num_partial_prefills > 1.)
        longs = [[(i * k) % 40000 + 100 for i in range(400)] for k in (37, 41)]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        prompts = [{"prompt_token_ids": longs[0]}, {"prompt_token_ids": longs[1]}, "Hello"]
        outs = engine.generate(prompts, params, use_tqdm=False)
        first = [o.metrics.first_token_time for o in outs]
        assert first[2] < first[0] < first[1]
        want = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    finally:
        engine.engine.shutdown()


def test_partial_prefill_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="max_long_partial_prefills: 3 is more than max_num_partial_prefills"):
        LLM(dtype="float32", max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="max_num_partial_prefills: .*chunked prefill"):
        LLM(dtype="float32", enable_chunked_prefill=False, max_num_partial_prefills=2)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        LLM(dtype="float32", max_num_partial_prefills=0)
