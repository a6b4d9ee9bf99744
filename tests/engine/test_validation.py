"""The request rules (ferrox.engine.validation): each raises the right class naming the right field,
at the edge (nothing queued, no KV block held), and the KV-capacity boundary agrees with Rust."""

from __future__ import annotations

import pickle

import ferrox
import pytest
from ferrox import _core
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.engine.validation import RequestLimits, check_request_id, validate_request
from ferrox.errors import (
    DuplicateRequestError,
    EngineDeadError,
    EngineStartupError,
    FerroxError,
    InvalidArgumentError,
    PromptTooLongError,
    RequestError,
)
from ferrox.sampling_params import SamplingParams
from ferrox.structured.params import StructuredOutputsParams

# max_model_len > the KV cache, so that each of the two length rules can be the binding one.
LIMITS = RequestLimits(max_model_len=64, kv_capacity_tokens=48, vocab_size=100, max_logprobs=5)
WIDE = RequestLimits(max_model_len=64, kv_capacity_tokens=1000, vocab_size=100, max_logprobs=5)
OK = SamplingParams(max_tokens=4)


# ---- the rules, without a model ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "limits", "cls", "param"),
    [
        ([], OK, LIMITS, InvalidArgumentError, "prompt"),
        ([1] * 64, OK, WIDE, PromptTooLongError, "prompt"),  # == max_model_len: no room for output
        ([1] * 48, OK, LIMITS, PromptTooLongError, "prompt"),  # == kv_capacity_tokens: same
        ([1, -1], OK, LIMITS, InvalidArgumentError, "prompt"),
        ([1, 100], OK, LIMITS, InvalidArgumentError, "prompt"),
        ([1], SamplingParams(stop_token_ids=[100]), LIMITS, InvalidArgumentError, "stop_token_ids"),
        ([1], SamplingParams(allowed_token_ids=[3, 100]), LIMITS, InvalidArgumentError, "allowed_token_ids"),
        ([1], SamplingParams(logit_bias={100: 1.0}), LIMITS, InvalidArgumentError, "logit_bias"),
        ([1], SamplingParams(logprobs=6), LIMITS, InvalidArgumentError, "logprobs"),
        ([1], SamplingParams(prompt_logprobs=6), LIMITS, InvalidArgumentError, "prompt_logprobs"),
        # max_tokens omitted: output runs up to max_model_len, which leaves 64 - 10 = 54 tokens.
        ([1] * 10, SamplingParams(max_tokens=None, min_tokens=55), WIDE, InvalidArgumentError, "min_tokens"),
        ([1], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")), LIMITS,
         InvalidArgumentError, "structured_outputs"),
    ],
)
def test_rule_names_the_field(prompt, params, limits, cls, param):
    with pytest.raises(cls) as info:
        validate_request(prompt, params, limits)
    assert type(info.value) is cls and info.value.param == param
    assert str(info.value).startswith(param), info.value  # "structured_outputs.regex: ..." names the kind


def test_what_goes_into_the_message_and_prompt_param_into_param():
    with pytest.raises(PromptTooLongError, match=r"^messages: prompts\[3\] has 48 tokens.*kv_cache_memory") as info:
        validate_request([1] * 48, OK, LIMITS, what="prompts[3]", prompt_param="messages")
    assert info.value.param == "messages"
    with pytest.raises(InvalidArgumentError, match=r"^prompt: must not be empty$"):
        validate_request([], OK, LIMITS)


def test_longest_accepted_prompt():
    assert LIMITS.max_prompt_len == 47 and WIDE.max_prompt_len == 63
    validate_request([1] * 47, SamplingParams(max_tokens=None, min_tokens=17), LIMITS)
    validate_request([0, 99], SamplingParams(stop_token_ids=[99], logit_bias={99: 1.0}, logprobs=5), LIMITS)


def test_request_id_rule():
    live = {"a"}
    check_request_id("b", live.__contains__)
    with pytest.raises(DuplicateRequestError) as info:
        check_request_id("a", live.__contains__)
    assert info.value.param == "request_id" and isinstance(info.value, InvalidArgumentError)
    with pytest.raises(InvalidArgumentError) as info:
        check_request_id("", live.__contains__)
    assert info.value.param == "request_id"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": "x", "detokenize": False}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"logprob_token_ids": [3, -1]}, "logprob_token_ids"),
        ({"logprob_token_ids": list(range(129))}, "logprob_token_ids"),  # vLLM's cap, 128
    ],
)
def test_sampling_params_field_errors(kwargs, param):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and str(info.value).startswith(f"{param}:")


# ---- the exception tree ----------------------------------------------------------------------------


def test_exception_tree():
    for cls in (InvalidArgumentError, PromptTooLongError, DuplicateRequestError, _core.UnknownRequestError,
                _core.TokenizerError, RequestError, EngineDeadError, EngineStartupError):
        assert issubclass(cls, FerroxError), cls
        assert getattr(ferrox, cls.__name__) is cls  # exported from the package root
        err = cls("boom", param="max_tokens")
        assert err.param == "max_tokens" and str(err) == "boom"
        assert cls("boom").param is None
        copy = pickle.loads(pickle.dumps(err))
        assert type(copy) is cls and copy.param == "max_tokens"
    assert issubclass(PromptTooLongError, ValueError) and issubclass(RequestError, ValueError)
    assert issubclass(EngineDeadError, RuntimeError) and issubclass(EngineStartupError, RuntimeError)
    # The old import paths still give the same classes.
    from ferrox.engine.async_llm import EngineDeadError as dead
    from ferrox.engine.async_llm import RequestError as request_error
    from ferrox.engine.core_client import EngineStartupError as startup

    assert (dead, request_error, startup) == (EngineDeadError, RequestError, EngineStartupError)


# ---- at the edge of the offline engine ---------------------------------------------------------------


def _assert_clean(llm) -> None:
    """Nothing queued and every usable KV block free."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1, stats


GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompt", "params", "cls", "param"),
    [
        ({"prompt_token_ids": []}, GREEDY, InvalidArgumentError, "prompt"),
        ({"prompt_token_ids": [1] * 9000}, GREEDY, PromptTooLongError, "prompt"),  # > max_model_len 4096
        ({"prompt_token_ids": [1, 49152]}, GREEDY, InvalidArgumentError, "prompt"),
        ({"prompt_token_ids": [1, -3]}, GREEDY, InvalidArgumentError, "prompt"),
        ({"prompt_token_ids": ["a"]}, GREEDY, InvalidArgumentError, "prompt_token_ids"),
        ("Hi", GREEDY.clone(stop_token_ids=[49152]), InvalidArgumentError, "stop_token_ids"),
        ("Hi", GREEDY.clone(logit_bias={10**6: 1.0}), InvalidArgumentError, "logit_bias"),
        ("Hi", GREEDY.clone(logprobs=21), InvalidArgumentError, "logprobs"),
        ("Hi", GREEDY.clone(logprob_token_ids=[5, 49152]), InvalidArgumentError, "logprob_token_ids"),
        ("Hi", GREEDY.clone(prompt_logprobs=21), InvalidArgumentError, "prompt_logprobs"),
        ("Hi", SamplingParams(max_tokens=None, min_tokens=9000), InvalidArgumentError, "min_tokens"),
        ("Hi", GREEDY.clone(structured_outputs=StructuredOutputsParams(json="{not json")), InvalidArgumentError,
         "structured_outputs"),
    ],
)
def test_offline_rule_refuses_before_queueing(llm, prompt, params, cls, param):
    # The bad prompt comes second: the good first one must not be left queued either.
    with pytest.raises(cls) as info:
        llm.generate(["Hello", prompt], params if prompt != "Hi" else [GREEDY, params], use_tqdm=False)
    assert type(info.value) is cls and info.value.param == param, info.value
    _assert_clean(llm)


def test_engine_still_answers_after_refusals(llm):
    for bad in ({"prompt_token_ids": []}, {"prompt_token_ids": [1] * 9000}):
        with pytest.raises(InvalidArgumentError):
            llm.generate([bad], GREEDY, use_tqdm=False)
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2 and out.outputs[0].finish_reason == "length"
    _assert_clean(llm)


def test_live_duplicate_request_id_is_refused(llm):
    engine = llm.engine
    ids = llm.get_tokenizer().encode("Hello")
    constrained = GREEDY.clone(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    engine.add_request(EngineCoreRequest("dup", ids, constrained))
    try:
        for params in (GREEDY, constrained):  # refused before its grammar is submitted, too
            with pytest.raises(DuplicateRequestError) as info:
                engine.add_request(EngineCoreRequest("dup", ids, params))
            assert info.value.param == "request_id"
        assert engine.scheduler.num_unfinished_requests() == 1
    finally:
        engine.abort_requests(["dup"])
    _assert_clean(llm)
    engine.add_request(EngineCoreRequest("dup", ids, GREEDY))  # a finished id may be reused
    engine.abort_requests(["dup"])
    _assert_clean(llm)


def test_kv_capacity_boundary_agrees_with_rust(kv_bound_llm, monkeypatch):
    """A prompt of exactly kv_capacity_tokens tokens leaves no room for output: Python refuses it
    before the scheduler sees it, and the Rust scheduler, given the same length, refuses it too."""
    llm = kv_bound_llm
    engine = llm.engine
    kv = engine.kv_capacity_tokens
    assert kv < engine.max_model_len, "the KV cache must be the binding limit for this test"

    calls: list[int] = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def add_request(self, request_id, prompt, **kw):
            calls.append(len(prompt))
            return self.inner.add_request(request_id, prompt, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(engine, "scheduler", Spy(engine.scheduler))
    with pytest.raises(PromptTooLongError) as info:
        llm.generate([{"prompt_token_ids": [1] * kv}], GREEDY, use_tqdm=False)
    assert info.value.param == "prompt" and f"holds {kv}" in str(info.value)
    with pytest.raises(PromptTooLongError):
        engine.add_request(EngineCoreRequest("edge", [1] * kv, GREEDY))
    assert calls == [], "the scheduler was reached"
    monkeypatch.undo()
    _assert_clean(llm)

    # The Rust half: a scheduler of the same shape draws the line at the same length.
    sched = _core.Scheduler(num_blocks=engine.num_kv_blocks, block_size=engine.block_size,
                            max_model_len=engine.max_model_len)
    with pytest.raises(PromptTooLongError):
        sched.add_request("edge", [1] * kv, max_tokens=1, detokenize=False)
    assert not sched.has_unfinished_requests()
    sched.add_request("edge", [1] * (kv - 1), max_tokens=1, detokenize=False)
    limits = RequestLimits(max_model_len=engine.max_model_len, kv_capacity_tokens=kv,
                           vocab_size=engine.vocab_size, max_logprobs=engine.config.max_logprobs)
    assert limits.max_prompt_len == kv - 1
