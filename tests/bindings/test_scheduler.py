"""The Rust scheduler through its Python bindings: the step contract, chunked prefill,
preemption, stop conditions, detokenized streaming and bad input."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox._core import (
    DuplicateRequestError,
    FerroxError,
    InvalidArgumentError,
    PromptTooLongError,
    Scheduler,
    TokenizerError,
    UnknownRequestError,
)

from .driver import check_arrays, rows, run_step, run_to_completion

EOS = 0  # "<|endoftext|>" is the first special token of the test tokenizer


def make(**kw) -> Scheduler:
    args = dict(num_blocks=256, max_model_len=512, block_size=16, eos_token_ids=[EOS])
    args.update(kw)
    return Scheduler(**args)


def test_step_contract_arrays_are_numpy_and_torch_wraps_them_without_copy():
    torch = pytest.importorskip("torch")
    s = make()
    s.add_request("a", list(range(1, 40)), max_tokens=4, detokenize=False)
    s.add_request("b", np.arange(1, 9, dtype=np.int32), max_tokens=4, detokenize=False)
    out = s.schedule()
    assert out.req_ids == ["a", "b"] and out.new_req_ids == ["a", "b"]
    check_arrays(out, 16)
    for arr in (out.input_ids, out.positions, out.slot_mapping, out.seq_lens, out.block_table):
        assert arr.flags.c_contiguous
        assert torch.from_numpy(arr).data_ptr() == arr.ctypes.data
    assert out.sample_mask.dtype == np.bool_ and out.sample_mask.all()
    assert out.input_ids is out.input_ids  # one array per step, not rebuilt per access


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_running():
    s = make(max_num_batched_tokens=64)
    s.add_request("short", [5, 6, 7], max_tokens=20, detokenize=False, ignore_eos=True)
    run_step(s)
    s.add_request("long", list(range(1, 151)), max_tokens=2, detokenize=False, ignore_eos=True)
    chunks = []
    for _ in range(3):
        out, res = run_step(s)
        assert out.req_ids == ["short", "long"]
        assert out.num_scheduled_tokens[0] == 1 and out.num_tokens <= 64
        chunks.append((int(out.num_scheduled_tokens[1]), bool(out.sample_mask[1])))
        assert [o.request_id for o in res] == (["short", "long"] if out.sample_mask[1] else ["short"])
    assert chunks == [(63, False), (63, False), (24, True)]
    assert s.stats().num_prompt_tokens == 153


def test_preemption_and_resume_keep_generated_tokens():
    def run(num_blocks):
        s = make(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=256)
        for i in range(4):
            s.add_request(f"r{i}", list(range(1 + i, 13 + i)), max_tokens=24, detokenize=False, ignore_eos=True)
        tokens, _, final, steps = run_to_completion(s, block_size=4)
        assert s.stats().num_free_blocks == num_blocks - 1
        return tokens, final, steps, s.stats()

    ref_tokens, _, _, ref_stats = run(256)
    assert ref_stats.num_preemptions == 0
    tokens, final, steps, stats = run(16)  # 15 blocks of 4 tokens: 4 requests need up to 36 blocks
    assert stats.num_preemptions > 0
    assert any(o.preempted_req_ids for o in steps) and any(o.resumed_req_ids for o in steps)
    assert tokens == ref_tokens, "output unchanged by preemption"
    assert all(o.finish_reason == "length" and o.num_output_tokens == 24 for o in final.values())


def test_prefix_reuse_across_requests_counts_cached_tokens():
    s = make()
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks
    s.add_request("first", prompt, max_tokens=1, detokenize=False)
    _, _, final, _ = run_to_completion(s)
    assert final["first"].num_cached_tokens == 0
    s.add_request("second", prompt + [7, 8], max_tokens=1, detokenize=False)
    out, res = run_step(s)
    assert int(out.num_computed_tokens[0]) == 48
    assert res[0].num_cached_tokens == 48
    st = s.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (102, 48)


def test_eos_ignore_eos_stop_token_ids_and_min_tokens():
    s = make()
    s.add_request("eos", [1, 2, 3], max_tokens=10, detokenize=False)
    s.add_request("ignore", [1, 2, 3], max_tokens=3, ignore_eos=True, detokenize=False)
    s.add_request("stop_id", [1, 2, 3], max_tokens=10, stop_token_ids=[99], detokenize=False)
    s.add_request("min", [1, 2, 3], max_tokens=10, min_tokens=2, detokenize=False)
    plan = {"eos": [EOS], "ignore": [EOS, EOS, EOS], "stop_id": [5, 99], "min": [EOS, EOS]}
    tokens, _, final, _ = run_to_completion(s, lambda rid, pos: plan[rid][min(pos - 3, len(plan[rid]) - 1)])
    assert (final["eos"].finish_reason, final["eos"].stop_reason, tokens["eos"]) == ("stop", None, [EOS])
    assert (final["ignore"].finish_reason, tokens["ignore"]) == ("length", [EOS] * 3)
    assert (final["stop_id"].finish_reason, final["stop_id"].stop_reason) == ("stop", 99)
    assert (final["min"].finish_reason, final["min"].num_output_tokens) == ("stop", 2)


def _text_fn(tok, texts: dict[str, str]):
    """Token function that 'generates' the encoding of a given text per request, then EOS."""
    enc = {rid: tok.encode(t).ids for rid, t in texts.items()}
    start: dict[str, int] = {}

    def fn(rid: str, pos: int) -> int:
        start.setdefault(rid, pos)
        i = pos - start[rid]
        return enc[rid][i] if i < len(enc[rid]) else EOS

    return fn


def test_streamed_multibyte_text_through_the_scheduler(byte_level_tokenizer, tokenizer_json):
    texts = {
        "emoji": "🦀🚀 emoji 👍🏽 family 👨‍👩‍👧",
        "cjk": "日本語 中文字符 東京 한국어 café",
        "ascii": "hello world, the answer is 42.",
    }
    s = make(tokenizer_json=tokenizer_json)
    for rid in texts:
        s.add_request(rid, [1, 2, 3], max_tokens=100)
    deltas: dict[str, list[str]] = {rid: [] for rid in texts}
    fn = _text_fn(byte_level_tokenizer, texts)
    while s.has_unfinished_requests():
        _, res = run_step(s, fn)
        for o in res:
            deltas[o.request_id].append(o.text_delta)
            assert "\ufffd" not in o.text_delta
    for rid, t in texts.items():
        ids = byte_level_tokenizer.encode(t).ids
        assert "".join(deltas[rid]) == byte_level_tokenizer.decode(ids) == t


def test_stop_strings_spanning_tokens_and_include_stop_str(byte_level_tokenizer, tokenizer_json):
    text = "hello world, the answer is 42. and then more words"
    s = make(tokenizer_json=tokenizer_json)
    s.add_request("trim", [1, 2], max_tokens=100, stop=["answer is", "never"])
    s.add_request("keep", [1, 2], max_tokens=100, stop=["answer is"], include_stop_str_in_output=True)
    s.add_request("late", [1, 2], max_tokens=100, stop=["hello"], min_tokens=3)
    fn = _text_fn(byte_level_tokenizer, {"trim": text, "keep": text, "late": "hello hello world hello again"})
    tokens, out_text, final, _ = run_to_completion(s, fn)
    assert out_text["trim"] == "hello world, the "
    assert (final["trim"].finish_reason, final["trim"].stop_reason) == ("stop", "answer is")
    assert out_text["keep"] == "hello world, the answer is"
    # min_tokens suppresses stop strings: the first "hello"s are emitted, a later one stops.
    assert final["late"].stop_reason == "hello" and out_text["late"].startswith("hello")
    assert final["late"].num_output_tokens >= 3


def test_stop_string_spanning_the_min_tokens_boundary(byte_level_tokenizer, tokenizer_json):
    """Stop strings are honoured from the min_tokens-th output token on, matched over the whole
    output: one that begins before the boundary and completes after it stops the request and
    is trimmed; one completed entirely before the boundary never fires later."""
    text = "the answer is 42. and the answer is 43."
    stop = "answer is"
    ids = byte_level_tokenizer.encode(text).ids
    prefix_lens = [len(byte_level_tokenizer.decode(ids[:k])) for k in range(len(ids) + 1)]
    begin = text.index(stop)
    # k tokens end strictly inside the first "answer is"; the (k+1)-th completes it or more of it.
    k = next(k for k, n in enumerate(prefix_lens) if begin < n < begin + len(stop))
    done = next(k for k, n in enumerate(prefix_lens) if n >= begin + len(stop))  # completes it
    s = make(tokenizer_json=tokenizer_json)
    s.add_request("span", [1, 2], max_tokens=100, stop=[stop], min_tokens=k + 1)
    s.add_request("before", [1, 2], max_tokens=100, stop=[stop], min_tokens=done + 1)
    s.add_request("free", [1, 2], max_tokens=100, stop=[stop])
    fn = _text_fn(byte_level_tokenizer, dict.fromkeys(("span", "before", "free"), text))
    deltas: dict[str, list[str]] = {}
    final = {}
    while s.has_unfinished_requests():
        _, res = run_step(s, fn)
        for o in res:
            deltas.setdefault(o.request_id, []).append(o.text_delta)
            if o.finished:
                final[o.request_id] = o
    joined = {rid: "".join(d) for rid, d in deltas.items()}
    # Spanning the boundary: caught exactly as without min_tokens, and "answer" never streamed.
    assert joined["span"] == joined["free"] == "the "
    assert (final["span"].finish_reason, final["span"].stop_reason) == ("stop", stop)
    assert final["span"].num_output_tokens == final["free"].num_output_tokens == done
    # Completed before the boundary: ignored; the second occurrence stops the request.
    assert joined["before"] == text[: text.index(stop, begin + 1)]
    assert final["before"].stop_reason == stop


def test_held_text_is_released_when_finishing_for_length(byte_level_tokenizer, tokenizer_json):
    s = make(tokenizer_json=tokenizer_json)
    ids = byte_level_tokenizer.encode("the answer").ids
    s.add_request("a", [1], max_tokens=len(ids), stop=["answer is"])
    _, out_text, final, _ = run_to_completion(s, lambda rid, pos: ids[pos - 1])
    assert final["a"].finish_reason == "length"
    assert out_text["a"] == "the answer"


def test_skip_special_tokens_in_scheduler(byte_level_tokenizer, tokenizer_json):
    ids = byte_level_tokenizer.encode("<|im_start|>hi<|im_end|>").ids
    s = make(tokenizer_json=tokenizer_json)
    s.add_request("skip", [1], max_tokens=len(ids))
    s.add_request("keep", [1], max_tokens=len(ids), skip_special_tokens=False)
    _, out_text, _, _ = run_to_completion(s, lambda rid, pos: ids[pos - 1])
    assert out_text == {"skip": "hi", "keep": "<|im_start|>hi<|im_end|>"}


def test_priority_policy_admits_the_most_important_first():
    s = make(policy="priority", max_num_seqs=1)
    s.add_request("low", [1, 2], max_tokens=1, priority=10, detokenize=False)
    s.add_request("high", [1, 2], max_tokens=1, priority=-5, detokenize=False)
    s.add_request("mid", [1, 2], max_tokens=1, priority=0, detokenize=False)
    order = [run_step(s)[0].req_ids for _ in range(3)]
    assert order == [["high"], ["mid"], ["low"]]


def test_abort_frees_blocks_and_reports_once():
    s = make()
    s.add_request("a", list(range(1, 60)), max_tokens=10, detokenize=False)
    s.add_request("b", list(range(1, 60)), max_tokens=10, detokenize=False)
    out = s.schedule()
    res = rows(s.abort_requests(["a", "not-there"]))
    assert [(o.request_id, o.finish_reason, o.finished, o.new_token_ids, o.text_delta) for o in res] == [
        ("a", "abort", True, [], "")
    ]
    assert len(s.abort_requests(["a"])) == 0
    with pytest.raises(UnknownRequestError):
        s.request_block_ids("a")
    res = rows(s.update_from_output(np.full(out.num_reqs, 7, dtype=np.int64)))
    assert [o.request_id for o in res] == ["b"]
    assert s.schedule().finished_req_ids == ["a"]
    s.abort_requests(["b"])
    assert s.stats().num_free_blocks == 255 and not s.has_unfinished_requests()


def test_grammar_wait_and_force_stop():
    s = make()
    s.add_request("g", [1, 2], max_tokens=10, wait_for_grammar=True, detokenize=False)
    s.add_request("x", [1, 2], max_tokens=10, detokenize=False)
    out, _ = run_step(s)
    assert out.req_ids == ["x"] and s.num_unfinished_requests() == 2
    s.grammar_ready(["g", "unknown"])
    out = s.schedule()
    assert out.req_ids == ["x", "g"]
    res = rows(s.update_from_output(np.array([7, 8], dtype=np.int64), np.array([False, True])))
    assert [(o.request_id, o.finish_reason) for o in res] == [("x", None), ("g", "stop")]


def test_bad_input_raises_typed_errors_and_leaves_the_scheduler_usable(tokenizer_json):
    s = make(num_blocks=9, block_size=4)  # 32 tokens of KV
    s.add_request("a", [1, 2, 3], max_tokens=5, detokenize=False)
    with pytest.raises(DuplicateRequestError, match="already live"):
        s.add_request("a", [1], max_tokens=1)
    with pytest.raises(ValueError):  # InvalidArgumentError is also a ValueError
        s.add_request("e", [], max_tokens=1)
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        s.add_request("e", [1], max_tokens=0)
    with pytest.raises(InvalidArgumentError, match=r"prompt_token_ids\[1\]"):
        s.add_request("e", [1, -4], max_tokens=1)
    with pytest.raises(InvalidArgumentError, match="min_tokens"):
        s.add_request("e", [1], max_tokens=2, min_tokens=3)
    with pytest.raises(PromptTooLongError, match="KV cache"):
        s.add_request("e", list(range(40)), max_tokens=1)
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        make().add_request("e", list(range(600)), max_tokens=1)
    with pytest.raises(InvalidArgumentError, match="stop"):
        s.add_request("e", [1], max_tokens=1, stop=["x"])  # no tokenizer
    with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
        s.add_request("e", np.zeros((2, 2), dtype=np.int64), max_tokens=1)
    with pytest.raises(KeyError):  # UnknownRequestError is also a KeyError
        s.request_block_ids("nope")
    out = s.schedule()
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        s.update_from_output(np.zeros(3, dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="sampled_token_ids"):
        s.update_from_output(np.zeros(out.num_reqs, dtype=np.float32))
    with pytest.raises(InvalidArgumentError, match="force_stop"):
        s.update_from_output(np.zeros(out.num_reqs, dtype=np.int64), np.zeros(5, dtype=np.bool_))
    # Still consistent: the step completes and the request finishes normally.
    assert len(s.update_from_output(np.array([7], dtype=np.int64))) == 1
    tokens, _, final, _ = run_to_completion(s, block_size=4)
    assert final["a"].num_output_tokens == 5 and s.stats().num_free_blocks == 8


def test_errors_carry_the_offending_param():
    s = make(num_blocks=9, block_size=4)
    s.add_request("a", [1, 2, 3], max_tokens=5, detokenize=False)
    cases = [
        (lambda: s.add_request("a", [1], max_tokens=1), DuplicateRequestError, "request_id"),
        (lambda: s.add_request("e", [1], max_tokens=0), InvalidArgumentError, "max_tokens"),
        (lambda: s.add_request("e", [1, -4], max_tokens=1), InvalidArgumentError, "prompt_token_ids"),
        (lambda: s.add_request("e", list(range(40)), max_tokens=1), PromptTooLongError, "prompt_token_ids"),
        (lambda: s.add_request("e", [1], max_tokens=1, stop=["x"]), InvalidArgumentError, "stop"),
        (lambda: s.request_block_ids("nope"), UnknownRequestError, "request_id"),
        (lambda: make(policy="lifo"), InvalidArgumentError, "policy"),
        (lambda: make(eos_token_ids=[-1]), InvalidArgumentError, "eos_token_ids"),
        (lambda: make(tokenizer_json="{}"), TokenizerError, None),
    ]
    for call, cls, param in cases:
        with pytest.raises(cls) as info:
            call()
        assert info.value.param == param, (cls, str(info.value))
    # The message is unchanged: it still starts with the field as written (index included).
    with pytest.raises(InvalidArgumentError, match=r"^prompt_token_ids\[1\]: "):
        s.add_request("e", [1, -4], max_tokens=1)
    # An unknown id is still a KeyError whose str() is the message, not its repr.
    with pytest.raises(KeyError) as key_info:
        s.request_block_ids("nope")
    assert str(key_info.value).startswith('unknown request id "nope"')


def test_python_code_can_raise_the_tree_with_a_param():
    e = InvalidArgumentError("max_tokens: must be >= 1", param="max_tokens")
    assert str(e) == "max_tokens: must be >= 1" and e.param == "max_tokens"
    assert isinstance(e, FerroxError) and isinstance(e, ValueError)
    p = PromptTooLongError("too long", param="prompt_token_ids")
    assert p.param == "prompt_token_ids" and isinstance(p, InvalidArgumentError)
    assert FerroxError("x").param is None and FerroxError().param is None
    with pytest.raises(TypeError):
        FerroxError("x", "positional param")  # param is keyword-only
    u = UnknownRequestError("unknown request id 'z'", param="request_id")
    assert str(u) == "unknown request id 'z'" and isinstance(u, KeyError)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_blocks=-1), "num_blocks"),
        (dict(num_blocks=1), "num_blocks"),
        (dict(block_size=0), "block_size"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(max_num_seqs=-3), "max_num_seqs"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(policy="lifo"), "policy"),
        (dict(eos_token_ids=[-1]), "eos_token_ids"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=field):
        make(**kwargs)


def test_bad_tokenizer_json():
    with pytest.raises(TokenizerError):
        make(tokenizer_json="{}")
    with pytest.raises(FerroxError):
        make(tokenizer_json="not json")


def test_sentencepiece_style_tokenizer_keeps_the_leading_space_after_the_prompt(metaspace_tokenizer):
    """Metaspace decoders strip the space of a sequence's first token; generated text continues
    the prompt, so it must stream as the full decode minus the prompt's decode."""
    js = metaspace_tokenizer.to_str()
    full = metaspace_tokenizer.encode("the capital of france is paris").ids
    cut = len(metaspace_tokenizer.encode("the capital of").ids)
    s = make(tokenizer_json=js)
    s.add_request("a", full[:cut], max_tokens=len(full) - cut)
    _, out_text, _, _ = run_to_completion(s, lambda rid, pos: full[pos])
    expected = metaspace_tokenizer.decode(full)[len(metaspace_tokenizer.decode(full[:cut])) :]
    assert out_text["a"] == expected and expected.startswith(" ")
