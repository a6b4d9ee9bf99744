"""The columnar step result (rust/py/step_outputs.rs): one StepOutputs per update_from_output /
abort_requests, request slots, and the columns an engine reads without touching request ids."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox import _core
from ferrox._core import FINISH_REASONS, Scheduler, StepOutputs

from .driver import rows, run_step

EOS = 0


def make(**kw) -> Scheduler:
    args = dict(num_blocks=256, max_model_len=512, block_size=16, eos_token_ids=[EOS])
    args.update(kw)
    return Scheduler(**args)


def test_the_per_request_output_class_is_gone():
    assert not hasattr(_core, "RequestOutput")
    assert FINISH_REASONS == (None, "stop", "length", "abort", "error", "repetition")


def test_slots_are_stable_while_live_and_reused_after_finish():
    s = make()
    a = s.add_request("a", [1, 2, 3], max_tokens=1, detokenize=False)
    b = s.add_request("b", [1, 2, 3], max_tokens=3, detokenize=False)
    assert isinstance(a, int) and a != b
    out = s.schedule()
    assert out.req_slots.tolist() == [a, b] and out.req_ids == ["a", "b"]
    res = s.update_from_output(np.array([5, 6], dtype=np.int64))
    assert res.slots.tolist() == [a, b]
    assert [FINISH_REASONS[f] for f in res.finish_reasons] == ["length", None]
    c = s.add_request("c", [4, 5], max_tokens=2, detokenize=False)
    assert c == a, "a finished request's slot goes to a later request"
    out = s.schedule()
    assert dict(zip(out.req_ids, out.req_slots.tolist(), strict=True)) == {"b": b, "c": c}
    # Preempted and waiting requests keep their slot too.
    s2 = make(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    slots = {rid: s2.add_request(rid, list(range(1, 7)), max_tokens=8, detokenize=False, ignore_eos=True)
             for rid in ("p", "q")}
    seen: dict[str, set[int]] = {"p": set(), "q": set()}
    preempted = False
    while s2.has_unfinished_requests():
        out, res = run_step(s2, block_size=4)
        preempted |= bool(out.preempted_req_ids)
        for rid, slot in zip(out.req_ids, out.req_slots.tolist(), strict=True):
            seen[rid].add(slot)
        for o in res:
            seen[o.request_id].add(o.slot)
    assert preempted and seen == {"p": {slots["p"]}, "q": {slots["q"]}}


def test_columns_name_tokens_text_and_finishes_by_row(byte_level_tokenizer, tokenizer_json):
    s = make(tokenizer_json=tokenizer_json)
    emoji = byte_level_tokenizer.encode("🦀 café 日本語").ids
    word = byte_level_tokenizer.encode("hello").ids[0]
    word_text = byte_level_tokenizer.decode([word])
    s.add_request("stop_id", [1, 2], max_tokens=10, stop_token_ids=[99])
    s.add_request("stop_str", [1, 2], max_tokens=10, stop=[word_text])
    s.add_request("eos", [1, 2], max_tokens=10)
    s.add_request("text", [1, 2], max_tokens=len(emoji), ignore_eos=True)
    out = s.schedule()
    first = {"stop_id": 99, "stop_str": word, "eos": EOS, "text": emoji[0]}
    res = s.update_from_output(np.array([first[r] for r in out.req_ids], dtype=np.int64))
    assert isinstance(res, StepOutputs) and len(res) == 4
    by_row = {rid: i for i, rid in enumerate(res.req_ids)}
    assert [FINISH_REASONS[f] for f in res.finish_reasons] == ["stop", "stop", "stop", None]
    assert res.stop_reasons == {by_row["stop_id"]: 99, by_row["stop_str"]: word_text}
    assert res.token_ids.tolist() == [first[r] for r in res.req_ids]
    assert res.token_offsets.tolist() == [0, 1, 2, 3, 4]
    # The rest of the multi-byte text streams whole characters; offsets count characters.
    i = by_row["text"]
    text = res.text[res.text_offsets[i] : res.text_offsets[i + 1]]
    for tok in emoji[1:]:
        assert s.schedule().req_ids == ["text"]
        res = s.update_from_output(np.array([tok], dtype=np.int64))
        assert res.text_offsets.tolist() == [0, len(res.text)]
        text += res.text
    r0 = rows(res)[0]
    assert r0.finish_reason == "length" and r0.num_output_tokens == len(emoji)
    assert text == "🦀 café 日本語"


def test_text_offsets_are_characters_across_rows(byte_level_tokenizer, tokenizer_json):
    texts = {"a": "日本語 wörld", "b": "plain ascii", "c": "🦀🚀"}
    enc = {rid: byte_level_tokenizer.encode(t).ids for rid, t in texts.items()}
    s = make(tokenizer_json=tokenizer_json)
    for rid, ids in enc.items():
        s.add_request(rid, [1], max_tokens=len(ids), ignore_eos=True)
    got = dict.fromkeys(texts, "")
    step = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = [enc[r][step] for r in out.req_ids]
        res = s.update_from_output(np.array(sampled, dtype=np.int64))
        off = res.text_offsets
        for i, rid in enumerate(res.req_ids):
            got[rid] += res.text[off[i] : off[i + 1]]
        step += 1
    assert got == texts


def test_abort_returns_the_same_columns():
    s = make()
    slot = s.add_request("a", [1, 2, 3], max_tokens=5, detokenize=False)
    s.add_request("w", [1, 2, 3], max_tokens=5, detokenize=False, wait_for_grammar=True)
    assert s.schedule().req_ids == ["a"]
    s.update_from_output(np.array([7], dtype=np.int64))
    res = s.abort_requests(["a", "nope", "w"])
    assert isinstance(res, StepOutputs) and res.req_ids == ["a", "w"]
    assert res.slots[0] == slot and res.finish_reasons.tolist() == [3, 3]
    assert res.token_ids.size == 0 and res.token_offsets.tolist() == [0, 0, 0]
    assert res.text == "" and res.text_offsets.tolist() == [0, 0, 0] and res.stop_reasons == {}
    assert res.num_output_tokens.tolist() == [1, 0] and res.num_prompt_tokens.tolist() == [3, 3]


def test_an_empty_result_has_empty_columns():
    s = make()
    res = s.update_from_output(np.zeros(0, dtype=np.int64))
    assert len(res) == 0 and res.req_ids == [] and res.text == ""
    assert res.slots.shape == (0,) and res.token_offsets.tolist() == [0] and res.text_offsets.tolist() == [0]
    assert "StepOutputs(rows=0" in repr(res)


def test_repr_shows_rows():
    s = make()
    s.add_request("a", [1, 2], max_tokens=1, detokenize=False)
    s.schedule()
    r = repr(s.update_from_output(np.array([42], dtype=np.int64)))
    assert r.startswith("StepOutputs(rows=1, tokens=1, finished=1") and "'a'" in r.replace('"', "'")
    assert "[42]" in r and "length" in r


def test_lazy_id_lists_are_built_once():
    s = make()
    s.add_request("a", [1, 2], max_tokens=3, detokenize=False)
    out = s.schedule()
    assert out.req_ids is out.req_ids and out.req_ids == ["a"]
    res = s.update_from_output(np.array([5], dtype=np.int64))
    assert res.req_ids is res.req_ids and res.req_ids == ["a"]


def test_sampled_ids_must_fit_int32():
    s = make()
    s.add_request("a", [1, 2], max_tokens=3, detokenize=False)
    s.schedule()
    with pytest.raises(_core.InvalidArgumentError, match=r"sampled_token_ids\[0\]") as info:
        s.update_from_output(np.array([2**31], dtype=np.int64))
    assert info.value.param == "sampled_token_ids"
    assert len(s.update_from_output(np.array([2**31 - 1], dtype=np.int64))) == 1


def test_repetition_detection_finishes_a_looping_request_in_the_core():
    """The core's stop check (vLLM's repetition_detection as (min_pattern, max_pattern, min_count)): a
    request whose output comes to end in a 2-token pattern three times finishes there with code
    "repetition" and stop reason "repetition_detected"; its neighbour without the rule keeps going; a
    rule vLLM refuses is an InvalidArgumentError naming the field, and max_pattern 0 is off."""
    s = make()
    s.add_request("loop", [1, 2, 3], max_tokens=20, detokenize=False, repetition_detection=(1, 2, 3))
    s.add_request("free", [1, 2, 3], max_tokens=20, detokenize=False)
    s.add_request("off", [1, 2, 3], max_tokens=20, detokenize=False, repetition_detection=(0, 0, 0))
    finished: dict[str, tuple[str | None, int | str | None, int]] = {}
    for step, tok in enumerate([7, 8, 9, 8, 9, 8, 9, 8]):
        out = s.schedule()
        res = s.update_from_output(np.array([tok] * len(out.req_ids), dtype=np.int64))
        for i, rid in enumerate(res.req_ids):
            if res.finish_reasons[i]:
                finished[rid] = (FINISH_REASONS[res.finish_reasons[i]], res.stop_reasons.get(i), step)
    # outputs 7 8 9 8 9 8 9: [8, 9] three times ends the output at the seventh token (step 6)
    assert finished == {"loop": ("repetition", "repetition_detected", 6)}
    with pytest.raises(_core.InvalidArgumentError, match="min_count must be >= 2") as info:
        s.add_request("bad", [1, 2], max_tokens=4, detokenize=False, repetition_detection=(1, 3, 1))
    assert info.value.param == "repetition_detection"
    with pytest.raises(_core.InvalidArgumentError, match="min_pattern_size <= max_pattern_size"):
        s.add_request("bad2", [1, 2], max_tokens=4, detokenize=False, repetition_detection=(4, 3, 2))
