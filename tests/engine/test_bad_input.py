"""Bad input fails with an InvalidArgumentError (a ValueError) whose `param` names the field, and
never disturbs other requests. Each rule on its own: tests/engine/test_validation.py."""

from __future__ import annotations

import ferrox
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.engine.protocol import EngineCoreRequest

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_empty_prompt_list(llm):
    assert llm.generate([], GREEDY) == []  # as vLLM: nothing to do is not an error


def test_prompt_too_long_names_the_index_and_queues_nothing(llm):
    too_long = {"prompt_token_ids": [1] * llm.engine.max_model_len}
    with pytest.raises(ferrox.PromptTooLongError, match=r"prompts\[1\].*max_model_len") as info:
        llm.generate(["Hello", too_long], GREEDY, use_tqdm=False)
    assert info.value.param == "prompt"
    assert isinstance(ferrox._core.PromptTooLongError("x"), ValueError)
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ({"prompt_token_ids": []}, GREEDY, "prompt"),
        ({"prompt_token_ids": [10**7]}, GREEDY, "prompt"),
        ({"prompt_token_ids": ["a"]}, GREEDY, "prompt_token_ids"),
        ({"token_ids": [1]}, GREEDY, "prompts"),
        ("Hello", SamplingParams(logprobs=50), "logprobs"),
        ("Hello", SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        (3.5, GREEDY, "prompts"),
    ],
)
def test_bad_request_fields(llm, prompt, params, field):
    with pytest.raises(ferrox.InvalidArgumentError, match=field) as info:
        llm.generate([prompt], params, use_tqdm=False)
    assert info.value.param == field


def test_bad_chat_messages(llm):
    with pytest.raises(ferrox.InvalidArgumentError) as info:
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    assert info.value.param == "messages"


def test_bad_sampling_params_and_engine_args():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=-1)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="float8")
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_bad_request_mid_flight_leaves_others_untouched(llm):
    engine = llm.engine
    expected = [o.outputs[0].token_ids for o in llm.generate(["Hello", "The sky is"], GREEDY, use_tqdm=False)]
    engine.add_request(EngineCoreRequest("ok-a", llm.get_tokenizer().encode("Hello"), GREEDY))
    engine.add_request(EngineCoreRequest("ok-b", llm.get_tokenizer().encode("The sky is"), GREEDY))
    tokens: dict[str, list[int]] = {"ok-a": [], "ok-b": []}
    for out in engine.step().rows():
        tokens[out.request_id].extend(out.new_token_ids)
    with pytest.raises(ferrox.InvalidArgumentError, match="prompt") as info:
        engine.add_request(EngineCoreRequest("bad", [], GREEDY))
    assert info.value.param == "prompt"
    while engine.has_unfinished_requests():
        for out in engine.step().rows():
            tokens[out.request_id].extend(out.new_token_ids)
    assert [tokens["ok-a"], tokens["ok-b"]] == expected


def test_sampling_failure_fails_only_that_request(llm, monkeypatch):
    """A request whose sampling raises (here: a logit_bias token id past the vocabulary, slipped past
    validation) finishes with finish_reason 'error'; its batch-mates finish normally."""
    expected = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(SamplingParams, "check_vocab", lambda self, vocab_size: None)
    broken = GREEDY.clone(logit_bias={10**7: 1.0})
    good, bad = llm.generate(["Hello", "The sky is"], [GREEDY, broken], use_tqdm=False)
    assert good.outputs[0].token_ids == expected and good.outputs[0].finish_reason == "length"
    assert bad.outputs[0].finish_reason == "error" and bad.error and "sampling failed" in bad.error
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_prompt_larger_than_the_whole_kv_cache(llm, monkeypatch):
    per_block = kv_cache_bytes_per_block(llm.engine.spec, 16, torch.float32)
    # Start-up refuses a cache smaller than max_model_len (model_setup.check_kv_capacity); past that
    # check, the request rule that names kv_cache_memory is what stands.
    monkeypatch.setattr("ferrox.worker.model_setup.check_kv_capacity", lambda *args, **kwargs: None)
    tiny = LLM(kv_cache_memory=3 * per_block)  # 48 tokens
    assert tiny.engine.kv_capacity_tokens == 48
    with pytest.raises(ferrox.PromptTooLongError, match=r"prompts\[1\].*kv_cache_memory"):
        tiny.generate(["hi", {"prompt_token_ids": [5] * 60}], GREEDY, use_tqdm=False)
    # The boundary: a prompt of exactly the cache's 48 tokens leaves no room for output.
    with pytest.raises(ferrox.PromptTooLongError, match="holds 48") as info:
        tiny.generate([{"prompt_token_ids": [5] * 48}], GREEDY, use_tqdm=False)
    assert info.value.param == "prompt"
    out = tiny.generate(["hi"], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 47  # capped by the cache
