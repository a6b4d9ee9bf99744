"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) gives
the same greedy tokens as synchronous stepping: in a batch, with EOS stops and per-request length
limits (the step computed after a stop is dropped), after preemption by recompute, with small
prefill chunks, and when a request that needs synchronous steps (penalties) joins mid-run. Each
run ends with every KV block back in the pool. On CPU it runs the real Rust core and torch model
(async is the default only on CUDA); the GPU variant checks CUDA-graph replay too."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block

from tests.engine.conftest import TEST_KV_CACHE_MEMORY
from tests.engine.prompts import PROMPTS, greedy_ids
from tests.engine.test_batch_invariance import assert_no_leaked_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Stops on EOS where the model says it, and at several lengths: exercises requests finishing while
# the next step is already in flight.
MIXED = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 5)) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def async_llm():
    llm = LLM(kv_cache_memory=TEST_KV_CACHE_MEMORY, max_num_seqs=32, async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


def test_async_batch_equals_sync(llm, async_llm):
    assert not llm.engine.async_scheduling  # CPU default: synchronous
    for params in (GREEDY, MIXED):
        llm.reset_prefix_cache()
        expected = greedy_ids(llm.generate(PROMPTS, params, use_tqdm=False))
        async_llm.reset_prefix_cache()
        got = greedy_ids(async_llm.generate(PROMPTS, params, use_tqdm=False))
        assert got == expected
        assert_no_leaked_blocks(async_llm)


def test_async_steps_really_overlap(async_llm):
    """Decode steps are scheduled with the previous one in flight (input id -1 placeholders)."""
    engine = async_llm.engine
    launched = []
    inner = engine.runner.launch

    def spy(so, bitmask=None, prev=None):
        launched.append((int((so.input_ids < 0).sum()), prev is not None))
        return inner(so, bitmask, prev)

    engine.runner.launch = spy
    try:
        async_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    finally:
        engine.runner.launch = inner
    assert sum(holes for holes, _ in launched) >= 4 * (GREEDY.max_tokens - 2)
    assert all(has_prev for holes, has_prev in launched if holes)


def test_async_with_chunks_and_preemption(llm, async_llm):
    llm.reset_prefix_cache()
    expected = greedy_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    chunked = LLM(kv_cache_memory=64 << 20, max_num_batched_tokens=32, max_num_seqs=16, async_scheduling=True)
    assert greedy_ids(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert_no_leaked_blocks(chunked)

    per_block = kv_cache_bytes_per_block(llm.engine.spec, 16, torch.float32)
    longest = max(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) + GREEDY.max_tokens
    tight = LLM(kv_cache_memory=per_block * -(-longest // 16) * 2, async_scheduling=True)
    outs = tight.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert greedy_ids(outs) == expected
    assert_no_leaked_blocks(tight)


def test_sync_only_request_switches_to_sync_steps(llm, async_llm):
    """A request with a repetition penalty reads its previous tokens on the host: while it is live
    the engine steps synchronously, and everyone's output is unchanged."""
    params = [GREEDY] * 7 + [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3)]
    llm.reset_prefix_cache()
    expected = greedy_ids(llm.generate(PROMPTS[:8], params, use_tqdm=False))
    async_llm.reset_prefix_cache()
    assert greedy_ids(async_llm.generate(PROMPTS[:8], params, use_tqdm=False)) == expected
    # The runner hears of finished requests at the next schedule(): one more run clears the flag.
    async_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert not async_llm.engine.runner.needs_sync_steps
    assert_no_leaked_blocks(async_llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_async_equals_sync_with_cuda_graphs(tmp_path):
    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(str(tmp_path), hidden_size=128, num_layers=2)
    prompts = ["hello world", "the cat sat on", "one two three", "a b c d e f g", "tiny model says"] * 4
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * (i % 4), ignore_eos=i % 2 == 0)
              for i in range(len(prompts))]
    runs = []
    for use_async in (False, True):
        gpu = LLM(model, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20,
                  async_scheduling=use_async)
        runs.append(greedy_ids(gpu.generate(prompts, params, use_tqdm=False)))
        assert_no_leaked_blocks(gpu)
    assert runs[1] == runs[0]
