"""thinking_token_budget in the engine core (offline LLM, real Rust core, tiny random Qwen3 with Qwen's
`<think>` / `</think>` tokens): once a request has thought N tokens its next token is `</think>`,
with and without async scheduling; what it sampled before is what it samples without a budget; a
grammar starts after the forced `</think>`; other requests in the batch are untouched.

A logit bias of -100 on `</think>` keeps a random model thinking: only the budget can close it."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.structured.params import StructuredOutputsParams
from ferrox.structured.thinking_budget import ThinkingBudget

from tests.helpers.tiny_models import make_tiny_qwen3

START, END = 384, 385  # <think>, </think> in the tiny tokenizer with qwen_tokens
THINKING = [5, 6, 7, 8, 9, START]  # a prompt that opens the thinking (DeepSeek-R1's template does)
PLAIN = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_qwen3(tmp_path_factory.mktemp("budget") / "model", qwen_tokens=True)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(folder, request):
    return LLM(folder, reasoning_parser="deepseek_r1", async_scheduling=request.param, max_model_len=256,
               kv_cache_memory=16 << 20)


def sampling(seed: int, budget: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=14, temperature=1.0, seed=seed, logit_bias={END: -100.0},
                          thinking_token_budget=budget, ignore_eos=kw.pop("ignore_eos", True), **kw)


def ids(out) -> list[int]:
    return list(out.outputs[0].token_ids)


def test_budget_forces_the_end_of_thinking(llm):
    seeds = range(6)
    free = llm.generate([{"prompt_token_ids": THINKING}] * len(seeds), [sampling(s, None) for s in seeds],
                        use_tqdm=False)
    assert all(END not in ids(o) for o in free)  # the bias keeps them thinking
    for budget in (0, 1, 5):
        got = llm.generate([{"prompt_token_ids": THINKING}] * len(seeds), [sampling(s, budget) for s in seeds],
                           use_tqdm=False)
        for seed, f, g in zip(seeds, free, got, strict=True):
            assert ids(g)[:budget] == ids(f)[:budget], (budget, seed)  # sampled as without a budget
            assert ids(g)[budget] == END, (budget, seed, ids(g))
            assert len(ids(g)) == 14  # and the answer goes on after it (ignore_eos)


def test_prompt_tokens_after_think_count(llm):
    # Two tokens already thought in the prompt: a budget of 3 leaves one.
    out = llm.generate([{"prompt_token_ids": THINKING + [11, 12]}], [sampling(0, 3)], use_tqdm=False)[0]
    assert ids(out)[1] == END, ids(out)


def test_the_count_starts_at_the_models_own_think(llm):
    # The prompt does not open the thinking: nothing is cut until the model writes `<think>` (Qwen3).
    seeds = range(8)
    start_bias = {END: -100.0, START: 2.5}
    free = llm.generate([{"prompt_token_ids": PLAIN}] * len(seeds),
                        [SamplingParams(max_tokens=14, temperature=1.0, seed=s, logit_bias=start_bias, ignore_eos=True)
                         for s in seeds],
                        use_tqdm=False)
    got = llm.generate([{"prompt_token_ids": PLAIN}] * len(seeds),
                       [SamplingParams(max_tokens=14, temperature=1.0, seed=s, logit_bias=start_bias, ignore_eos=True,
                                       thinking_token_budget=2) for s in seeds], use_tqdm=False)
    checked = 0
    for f, g in zip(free, got, strict=True):
        f_ids, g_ids = ids(f), ids(g)
        # The count restarts at every `<think>`: the first run of two thinking tokens is cut after it.
        cut, run = None, -1
        for k, token in enumerate(f_ids[:-1]):
            run = 0 if token == START else run + 1 if run >= 0 else run
            if run == 2:
                cut = k + 1
                break
        if cut is None:
            assert g_ids == f_ids  # never thought two tokens in a row: never cut
            continue
        assert g_ids[:cut] == f_ids[:cut]
        assert g_ids[cut] == END, (f_ids, g_ids)
        checked += 1
    assert checked, "no seed writes <think> early"


def test_grammar_starts_after_the_forced_end(llm):
    choice = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate([{"prompt_token_ids": THINKING}] * 4,
                        [sampling(s, 3, structured_outputs=choice, ignore_eos=False) for s in range(4)], use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    for out in outs:
        got = ids(out)
        assert got[3] == END, got
        assert tokenizer.decode(got[4:], skip_special_tokens=True) in ("yes", "no")
        assert out.outputs[0].finish_reason == "stop"


def test_other_requests_in_the_batch_are_untouched(llm):
    alone = llm.generate([{"prompt_token_ids": PLAIN}], [sampling(7, None)], use_tqdm=False)[0]
    mixed = llm.generate([{"prompt_token_ids": THINKING}, {"prompt_token_ids": PLAIN}, {"prompt_token_ids": THINKING}],
                         [sampling(1, 0), sampling(7, None), sampling(2, 4)], use_tqdm=False)
    assert ids(mixed[0])[0] == END and ids(mixed[2])[4] == END
    assert ids(mixed[1]) == ids(alone)


def test_refused_without_a_reasoning_parser_and_with_bad_values(folder, llm):
    plain = LLM(folder, max_model_len=256, kv_cache_memory=16 << 20)
    with pytest.raises(InvalidArgumentError, match="thinking_token_budget: needs a reasoning parser") as e:
        plain.generate([{"prompt_token_ids": THINKING}], [sampling(0, 4)], use_tqdm=False)
    assert e.value.param == "thinking_token_budget"
    with pytest.raises(InvalidArgumentError, match="thinking_token_budget: allowed_token_ids must include"):
        llm.generate([{"prompt_token_ids": THINKING}], [sampling(0, 4, allowed_token_ids=[5, 6])], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="thinking_token_budget: must be >= 0"):
        SamplingParams(thinking_token_budget=-2)
    assert SamplingParams(thinking_token_budget=-1).thinking_token_budget is None  # vLLM's "no budget"


def test_budget_state_rules():
    b = ThinkingBudget(2, START, END, [1, START, 9])  # one token thought in the prompt
    assert b.thinking and b.count == 1 and b.forced_token() is None and b.may_force_within(1)
    b.accept(20)
    assert b.forced_token() == END
    b.accept(END)
    assert not b.thinking and b.forced_token() is None and not b.may_force_within(1)
    closed = ThinkingBudget(0, START, END, [START, 3, END, 4])  # the prompt closed it
    assert not closed.thinking and closed.may_force_within(1)  # the pending token may be <think>
    closed.accept(START)
    assert closed.forced_token() == END


def test_budget_beside_speculative_drafts(folder):
    """A budgeted request takes no drafts; beside one that does (n-gram drafts on a repetitive prompt),
    the forced row lands in the step's per-position mask and the drafting request decodes as without."""
    spec = LLM(folder, reasoning_parser="deepseek_r1", max_model_len=256, kv_cache_memory=16 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                   "prompt_lookup_min": 1})
    repeat = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = spec.generate([{"prompt_token_ids": repeat}], [greedy], use_tqdm=False)[0]
    for budget in range(2, 8):  # the forced step falls on steps with and without drafts beside it
        outs = spec.generate([{"prompt_token_ids": THINKING}, {"prompt_token_ids": repeat}],
                             [sampling(0, budget), greedy], use_tqdm=False)
        assert ids(outs[0])[budget] == END
        assert ids(outs[1]) == ids(want)
