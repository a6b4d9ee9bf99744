"""Speculative decoding on a CUDA GPU (skipped without one): greedy output with n-gram and
draft-model speculation equals greedy output without it (n-gram with async scheduling and with
synchronous steps, the default), with CUDA graphs (verify steps replay
graphs of their own shape, and so do the draft model's proposal steps and shadow pass) and eagerly,
and a self-drafting target accepts every draft."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Copy-heavy prompts, so prompt lookup finds matches.
PROMPTS = ["one two three one two three one two three", "a b c d a b c d a b c d", "the cat sat on the mat the cat",
           "hello world hello world hello"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")), hidden_size=128, num_layers=2)


def _tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("eager", [False, True])
def test_speculation_keeps_greedy_output(tiny_llama, eager):
    common = dict(device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=8, kv_cache_memory=64 << 20)
    plain = _tokens(LLM(tiny_llama, **common))
    ngram_config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    # Async scheduling: the next step is placed as if every draft in flight were accepted and shifted
    # back on the device. Synchronous steps (the default with speculation) for comparison.
    ngram = LLM(tiny_llama, speculative_config=ngram_config, async_scheduling=True, **common)
    assert _tokens(ngram) == plain
    ngram_sync = LLM(tiny_llama, speculative_config=ngram_config, **common)
    assert not ngram_sync.engine.async_scheduling
    assert _tokens(ngram_sync) == plain
    assert ngram_sync.engine.stats()["spec_num_accepted_tokens"] > 0
    draft = LLM(tiny_llama, speculative_config={"method": "draft_model", "model": tiny_llama,
                                                "num_speculative_tokens": 4}, **common)
    assert _tokens(draft) == plain
    s = draft.engine.stats()
    assert s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"] > 0  # the target drafting for itself
    assert ngram.engine.stats()["spec_num_drafts"] > 0
    if not eager:  # verify steps replayed graphs of their own shape (worker/cuda_graphs.py)
        graphs = ngram.engine.runner.graph_runner
        assert graphs.verify_len == 4 and graphs.verify_graphs and graphs._rows is not None
