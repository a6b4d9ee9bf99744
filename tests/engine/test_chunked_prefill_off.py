"""enable_chunked_prefill off (vLLM's --no-enable-chunked-prefill): a prompt longer than the default step
budget runs in one step, which grows the budget to max_model_len; the tokens are the chunked engine's;
an explicit budget below max_model_len is refused by name."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams

from tests.engine.conftest import TEST_KV_CACHE_MEMORY
from tests.helpers.tiny_models import make_tiny_llama


def steps_to_finish(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, list[int]]:
    calls = 0
    step = llm.engine.step

    def counted():
        nonlocal calls
        calls += 1
        return step()

    llm.engine.step = counted  # type: ignore[method-assign]
    try:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        del llm.engine.step
    return calls, list(out.outputs[0].token_ids)


def test_whole_prompts_in_one_step(tmp_path):
    # A tiny random Llama: the point is the step count and equal tokens past the default budget, which a
    # 2,500-token prompt through the embedded model showed at ~10x the time.
    folder = make_tiny_llama(str(tmp_path), hidden_size=128, num_layers=2, max_position_embeddings=4096)
    common = dict(model=folder, dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=3000,
                  max_num_seqs=32)
    chunked = LLM(**common)
    whole = LLM(**common, enable_chunked_prefill=False)
    assert whole.engine.config.enable_chunked_prefill is False
    prompt = [(i * 37) % 380 + 3 for i in range(2500)]  # over the CPU default budget (2048)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    chunked_steps, chunked_ids = steps_to_finish(chunked, prompt, params)
    whole_steps, whole_ids = steps_to_finish(whole, prompt, params)
    assert (chunked_steps, whole_steps) == (4, 3)  # two prefill chunks + 2 decodes; one prefill + 2
    assert whole_ids == chunked_ids
    with pytest.raises(ValueError, match="max_num_batched_tokens: 1024 is less than max_model_len \\(3000\\)"):
        LLM(**common, max_num_batched_tokens=1024, enable_chunked_prefill=False)
