"""Greedy output of each prompt is the same however the engine schedules it: alone, in a batch of
16, in small prefill chunks, on prefix-cache hits, and after preemption by recompute. Each run
ends with every KV block back in the pool."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block

from tests.engine.prompts import PROMPTS, greedy_ids

PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def assert_no_leaked_blocks(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1  # all but the null block
    assert stats["kv_cache_usage"] == 0.0


@pytest.fixture(scope="module")
def batch_reference(llm):
    """The batch-of-16 run, prefix cache emptied first so every prompt is computed."""
    assert llm.reset_prefix_cache()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert len(outs) == 16
    assert_no_leaked_blocks(llm)
    return greedy_ids(outs)


def test_alone_equals_batch(llm, batch_reference):
    # Each prompt alone for the first half of the batch run's tokens (greedy: a shorter run is a prefix of
    # the longer one): every prompt still prefills and decodes at batch size 1 and is compared token for
    # token with its row of the batch of 16, in half the 16 one-row runs' decode steps.
    alone = PARAMS.clone(max_tokens=PARAMS.max_tokens // 2)
    for prompt, expected in zip(PROMPTS, batch_reference, strict=True):
        llm.reset_prefix_cache()
        (out,) = llm.generate(prompt, alone, use_tqdm=False)
        assert out.outputs[0].token_ids == expected[: alone.max_tokens], prompt
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("hash_algo", ["sha256", "xxhash"])
def test_prefix_cache_hits_give_the_same_output(llm, batch_reference, hash_algo):
    """Under either block hash (--prefix-caching-hash-algo; the session engine has the default, sha256; an
    engine sharing its weights takes xxhash)."""
    if hash_algo != llm.config.prefix_caching_hash_algo:
        llm = LLM(dtype="float32", kv_cache_memory=llm.config.kv_cache_memory, max_model_len=4096, max_num_seqs=32,
                  prefix_caching_hash_algo=hash_algo)
    long_prompt = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    llm.generate(PROMPTS[long_prompt], PARAMS, use_tqdm=False)  # caches its full prompt blocks
    before = llm.engine.stats()["prefix_cache_hits"]
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits"] > before
    assert outs[long_prompt].num_cached_tokens >= 32
    assert greedy_ids(outs) == batch_reference
    assert_no_leaked_blocks(llm)


def test_shared_system_prompt(llm):
    system = (
        "You are a careful assistant. Answer in one short sentence, use plain words, and never invent facts. "
        "If you do not know the answer, say so. "
    )
    questions = ["What is the sun?", "Name a fruit.", "What colour is the sky?", "Count to three."]
    prompts = [system + q for q in questions]
    llm.reset_prefix_cache()
    cold = [llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts if llm.reset_prefix_cache()]
    llm.generate(prompts[0], PARAMS, use_tqdm=False)
    warm = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in warm)  # the shared system prompt's full blocks
    assert greedy_ids(warm) == greedy_ids(cold)
    assert_no_leaked_blocks(llm)


def test_small_prefill_chunks(llm, batch_reference):
    chunked = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=16)
    outs = chunked.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert greedy_ids(outs) == batch_reference
    assert_no_leaked_blocks(chunked)


def test_preemption_by_recompute(llm, batch_reference):
    per_block = kv_cache_bytes_per_block(llm.engine.spec, 16, torch.float32)
    longest = max(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) + PARAMS.max_tokens
    blocks = -(-longest // 16) * 2  # room for about two long requests, far less than 16 of them
    tight = LLM(dtype="float32", kv_cache_memory=per_block * blocks, max_model_len=longest)
    outs = tight.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert greedy_ids(outs) == batch_reference
    assert_no_leaked_blocks(tight)
