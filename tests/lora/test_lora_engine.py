"""Multi-LoRA through the whole engine (offline LLM, real Rust core): each request gets the tokens
transformers + peft (the adapter merged into the weights) give it alone, in mixed batches, with
fewer adapter slots than adapters, with adapters loaded and unloaded between and during runs."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import FerroxError
from ferrox.lora.request import LoRARequest

from tests.helpers.tiny_models import EOS_TOKEN_ID
from tests.lora.adapters import merged_greedy, two_adapters
from tests.models.conftest import cut_at_eos

PROMPTS = [[1, 17, 42, 99, 7, 300, 12], [1, 250, 3, 3, 81], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [1, 77, 78]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base_dir, base, adapters = two_adapters(tmp_path_factory)
    return base_dir, adapters, merged_greedy(base, adapters, PROMPTS, MAX_TOKENS, EOS_TOKEN_ID)


def _greedy(llm, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID]) for o in outs]


def test_mixed_batch_matches_peft_merged(setup):
    base_dir, adapters, refs = setup
    # max_loras=1: the two adapters never share a step (the scheduler holds one back), and the slot is
    # swapped between them; results must not depend on it.
    for max_loras in (2, 1):
        llm = LLM(base_dir, enable_lora=True, max_loras=max_loras, max_lora_rank=8, max_num_seqs=8,
                  kv_cache_memory=16 << 20)
        names = ["base", "a1", "a2", "a1", "a2", "base", "a2", "a1"]
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
        got = _greedy(llm, prompts, [adapters.get(n) for n in names])
        want = [refs[n][i % len(PROMPTS)] for i, n in enumerate(names)]
        assert got == want, f"max_loras={max_loras}"
        # Prefix caching keys blocks by adapter: the same prompt under another adapter is not served
        # the first one's K/V (a second round hits the cache and must give the same tokens).
        assert _greedy(llm, prompts, [adapters.get(n) for n in names]) == want


def test_adapters_load_and_unload_between_and_during_runs(setup):
    base_dir, adapters, refs = setup
    llm = LLM(base_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1, kv_cache_memory=16 << 20)
    assert llm.add_lora(adapters["a1"]) and llm.list_loras() == {1}
    # max_cpu_loras=1: a2 arrives with its path and evicts a1 from the CPU cache; a1 comes back from disk.
    assert _greedy(llm, PROMPTS[:2], adapters["a2"]) == refs["a2"][:2]
    assert _greedy(llm, PROMPTS[:2], adapters["a1"]) == refs["a1"][:2]
    # Unload while a request with the adapter is queued: it finishes with the adapter, then it is gone.
    engine = llm.engine
    from ferrox.engine.protocol import EngineCoreRequest

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    engine.add_request(EngineCoreRequest("inflight", PROMPTS[0], params, lora_int_id=1, lora_name="a1",
                                         lora_path=adapters["a1"].lora_path))
    tokens: list[int] = []

    def step() -> None:
        tokens.extend(t for row in engine.step().rows() if row.request_id == "inflight" for t in row.new_token_ids)

    step()
    assert llm.remove_lora(1)
    assert 1 not in llm.list_loras()
    while engine.has_unfinished_requests():
        step()
    assert cut_at_eos(tokens, [EOS_TOKEN_ID]) == refs["a1"][0]
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1, "blocks leaked"
    assert not llm.remove_lora(1), "already gone"


def test_bad_lora_requests_are_refused_by_name(setup, tmp_path):
    base_dir, adapters, _ = setup
    plain = LLM(base_dir, kv_cache_memory=16 << 20)
    with pytest.raises(FerroxError, match="lora_request"):
        plain.generate([{"prompt_token_ids": PROMPTS[0]}], lora_request=adapters["a1"], use_tqdm=False)
    llm = LLM(base_dir, enable_lora=True, max_lora_rank=4, kv_cache_memory=16 << 20)
    with pytest.raises(FerroxError, match="max_lora_rank"):  # a1 has rank 8
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], lora_request=adapters["a1"], use_tqdm=False)
    with pytest.raises(FerroxError, match="adapter_config.json"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], lora_request=LoRARequest("x", 9, str(tmp_path)),
                     use_tqdm=False)
    with pytest.raises(FerroxError, match="lora_request"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, lora_request=[adapters["a2"]], use_tqdm=False)
    # Nothing was left behind: the engine still serves both kinds of request.
    assert _greedy(llm, PROMPTS[:1], adapters["a2"])[0] == setup[2]["a2"][0]
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_speculative_decoding_with_adapters_matches_peft_merged(setup):
    """LoRA with speculation, n-gram drafts and a draft model's (which runs the base weights): the drafts are
    checked by the adapted model, so every request still gets exactly its merged model's greedy tokens,
    while drafts were proposed and some accepted (verify steps of several tokens per request went through
    the adapters). On CUDA the verify steps replay graphs whose padded rows the LoRA token slots follow
    (tests/lora/test_lora_spec_gpu.py)."""
    base_dir, adapters, refs = setup
    names = ["a1", "base", "a2", "a1", "a2", "base", "a2", "a1"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    for spec in ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
                 {"method": "draft_model", "model": base_dir, "num_speculative_tokens": 2}):
        llm = LLM(base_dir, enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
                  kv_cache_memory=16 << 20, speculative_config=spec)
        assert _greedy(llm, prompts, [adapters.get(n) for n in names]) == [
            refs[n][i % len(PROMPTS)] for i, n in enumerate(names)], spec["method"]
        stats = llm.engine.stats()
        assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
