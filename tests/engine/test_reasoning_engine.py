"""The engine core's side of --reasoning-parser (offline LLM, real Rust core, tiny random Qwen3): a
structured output's grammar starts at the sampled `</think>`, with and without async scheduling
(the GPU's default, where the next step is scheduled before this step's token is known), with
seeded sampling giving a thinking of several tokens; a tokenizer without the tags is refused."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.structured.params import StructuredOutputsParams

from tests.helpers.tiny_models import make_tiny_qwen3

END = 385  # </think> in the tiny tokenizer with qwen_tokens
PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("reasoner") / "model", qwen_tokens=True)


def params(seed: int, structured: bool) -> SamplingParams:
    return SamplingParams(max_tokens=12, temperature=1.0, seed=seed, logit_bias={END: 3.0},
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no"]) if structured else None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grammar_starts_at_the_end_of_thinking(folder, async_scheduling):
    llm = LLM(folder, reasoning_parser="deepseek_r1", async_scheduling=async_scheduling, max_model_len=256,
              kv_cache_memory=16 << 20)
    seeds = range(60)
    free = llm.generate([{"prompt_token_ids": PROMPT}] * len(seeds), [params(s, False) for s in seeds],
                        use_tqdm=False)
    thinkers = [(s, list(o.outputs[0].token_ids)) for s, o in zip(seeds, free, strict=True)
                if END in o.outputs[0].token_ids[2:8]]  # room left for the answer
    assert thinkers, "no seed thinks for 2+ tokens"
    constrained = llm.generate([{"prompt_token_ids": PROMPT}] * len(thinkers),
                               [params(s, True) for s, _ in thinkers], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for (seed, ids), out in zip(thinkers, constrained, strict=True):
        k = ids.index(END)
        got = list(out.outputs[0].token_ids)
        assert got[:k + 1] == ids[:k + 1], seed  # the thinking is sampled as without a grammar
        answer = tokenizer.decode(got[k + 1:], skip_special_tokens=True)
        assert answer in ("yes", "no"), (seed, answer)
        assert out.outputs[0].finish_reason == "stop"
    # Without a reasoning parser the grammar holds from the first token: no `</think>` at all.
    plain = LLM(folder, async_scheduling=async_scheduling, max_model_len=256, kv_cache_memory=16 << 20)
    for out in plain.generate([{"prompt_token_ids": PROMPT}] * 3, [params(s, True) for s, _ in thinkers[:3]],
                              use_tqdm=False):
        assert out.outputs[0].text in ("yes", "no")


def test_a_tokenizer_without_the_tags_is_refused(tmp_path):
    folder = make_tiny_qwen3(tmp_path / "model")
    with pytest.raises(ValueError, match="reasoning_parser: 'qwen3' needs <think> and </think> as single tokens"):
        LLM(folder, reasoning_parser="qwen3", max_model_len=256, kv_cache_memory=16 << 20)


def test_enable_in_reasoning_constrains_the_thinking_too(folder):
    """structured_outputs_config's enable_in_reasoning (vLLM's): the grammar holds from the first token, so a
    model that would think first answers at once; its reasoning_parser key is --reasoning-parser."""
    llm = LLM(folder, structured_outputs_config={"backend": "guidance", "reasoning_parser": "deepseek_r1",
                                                 "enable_in_reasoning": True},
              max_model_len=256, kv_cache_memory=16 << 20)
    assert llm.config.reasoning_parser == "deepseek_r1"
    for out in llm.generate([{"prompt_token_ids": PROMPT}] * 4, [params(s, True) for s in range(4)], use_tqdm=False):
        assert END not in out.outputs[0].token_ids and out.outputs[0].text in ("yes", "no")
