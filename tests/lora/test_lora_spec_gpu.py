"""LoRA with speculative decoding on a CUDA GPU (skipped without one): adapters and n-gram drafts in one
batch give each request the greedy tokens of the same engine without speculation, with CUDA graphs (a
verify step replays a graph whose padded rows the LoRA token slots follow: lora/slots.py relayout, and
the test checks such steps ran) and eagerly, and also with a draft model (the draft runs the base
weights; the adapted target decides)."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# Copy-heavy prompts, so prompt lookup finds matches.
PROMPTS = [[1, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 9, 4, 9, 9, 4, 9, 9], [1, 30, 31, 32, 33, 30, 31, 32, 33],
           [1, 2, 3, 2, 3, 2, 3, 2]]
NAMES = ["a1", "base", "a2", "a1", "a2", "base", "a2", "a1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.lora.adapters import two_adapters

    base_dir, _, adapters = two_adapters(tmp_path_factory, hidden_size=128, alphas=(32, 16), rslora=False)
    return base_dir, adapters


def _tokens(llm: LLM, adapters) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(NAMES))]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=[adapters.get(n) for n in NAMES])
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("eager", [False, True])
def test_adapters_with_speculation_keep_greedy_output(setup, eager):
    base_dir, adapters = setup
    common = dict(device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=8, kv_cache_memory=64 << 20,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
    plain = _tokens(LLM(base_dir, **common), adapters)
    assert plain[0] != plain[1]  # (the adapters change the answer)
    ngram = LLM(base_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                              "prompt_lookup_max": 3}, **common)
    assert _tokens(ngram, adapters) == plain
    assert ngram.engine.stats()["spec_num_accepted_tokens"] > 0
    if not eager:
        graphs = ngram.engine.runner.graph_runner
        assert graphs.verify_graphs and graphs._rows is not None  # a verify step replayed a graph
    draft = LLM(base_dir, speculative_config={"method": "draft_model", "model": base_dir,
                                              "num_speculative_tokens": 3}, **common)
    assert _tokens(draft, adapters) == plain
    assert draft.engine.stats()["spec_num_draft_tokens"] > 0
