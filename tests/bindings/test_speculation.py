"""Speculative decoding through the bindings, driving the real Scheduler: n-gram drafts made in the
core and drafts handed in by a "draft model", variable accepted runs in update_from_output, and the
exactness that matters: with a greedy verifier, output (tokens, text, finish and stop reasons) is
identical to decoding without speculation, whatever stops inside an accepted run, with preemption
in a small cache, and nothing leaks.

The "model" is a deterministic function of the whole sequence that mostly copies its prompt (what
prompt lookup is for) and sometimes does not, so drafts are accepted, partly accepted and rejected."""

from __future__ import annotations

import numpy as np
import pytest
from ferrox._core import InvalidArgumentError, Scheduler

from .driver import Row, check_arrays, rows

EOS = 0  # "<|endoftext|>"
VOCAB = 2000  # byte_level_tokenizer's size
K = 4
TEXT = ("the model token cache block prefix schedule request stream answer question hello world paris "
        "capital france rust python engine batch decode prefill chunk budget stop string")


def model_next(seq: list[int], prompt_len: int) -> int:
    """Greedy 'argmax' of the fake model: copy the prompt cyclically, except every 7th output token,
    which is a function of the previous one (then the copy resumes from a shifted place)."""
    n_out = len(seq) - prompt_len
    if n_out % 7 == 6:
        return 3 + (seq[-1] * 13 + n_out) % (VOCAB - 3)
    return seq[(n_out // 7 + n_out) % prompt_len]


def make(tokenizer_json: str | None = None, k: int = 0, method: str = "ngram", **kw) -> Scheduler:
    args = dict(num_blocks=256, max_model_len=512, block_size=4, eos_token_ids=[EOS], tokenizer_json=tokenizer_json,
                num_speculative_tokens=k, speculative_method=method, prompt_lookup_min=1, prompt_lookup_max=3)
    args.update(kw)
    return Scheduler(**args)


def run(s: Scheduler, prompts: dict[str, list[int]], *, self_draft: bool = False, one_token_api: bool = False,
        **req_kw) -> tuple[dict[str, list[int]], dict[str, str], dict[str, Row], int]:
    """Adds the requests and steps until idle with a greedy verifier. self_draft: the model proposes
    its own next k tokens as drafts (every one is accepted). Returns tokens, text, final rows, steps."""
    slots = {s.add_request(rid, p, **req_kw): rid for rid, p in prompts.items()}
    seqs = {rid: list(p) for rid, p in prompts.items()}
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    text = dict.fromkeys(prompts, "")
    final: dict[str, Row] = {}
    steps = 0
    while s.has_unfinished_requests():
        steps += 1
        assert steps < 2000
        kw = {}
        if self_draft:
            live = [slot for slot, rid in slots.items() if rid not in final]
            drafts = []
            for slot in live:
                seq, plen = list(seqs[slots[slot]]), len(prompts[slots[slot]])
                for _ in range(K):
                    seq.append(model_next(seq, plen))
                drafts.append(seq[-K:])
            kw = dict(draft_slots=np.array(live, dtype=np.int32),
                      draft_token_ids=np.array([t for d in drafts for t in d], dtype=np.int64),
                      draft_offsets=np.arange(0, K * len(live) + 1, K, dtype=np.int32)[: len(live) + 1])
        out = s.schedule(**kw)
        check_arrays(out, s.block_size)
        qsl, nd = out.query_start_loc, out.num_draft_tokens
        flat, counts = [], []
        for r, rid in enumerate(out.req_ids):
            if not out.sample_mask[r]:
                flat.append(7)
                counts.append(1)
                continue
            hi, d = int(qsl[r + 1]), int(nd[r])
            drafts = out.input_ids[hi - d : hi].tolist()
            seq, plen = list(seqs[rid]), len(prompts[rid])
            run_ = []
            for j in range(d + 1):
                target = model_next(seq, plen)
                run_.append(target)
                if j == d or drafts[j] != target:
                    break  # the correction at the first mismatch, or the bonus token
                seq.append(target)
            if one_token_api:
                run_ = run_[:1]
            flat.extend(run_)
            counts.append(len(run_))
        if one_token_api:
            res = s.update_from_output(np.array(flat, dtype=np.int64))
        else:
            res = s.update_from_output(np.array(flat, dtype=np.int64), num_sampled_tokens=np.array(counts, dtype=np.int32))
        for o in rows(res):
            assert o.request_id not in final, "output after finish"
            tokens[o.request_id] += o.new_token_ids
            seqs[o.request_id] += o.new_token_ids
            text[o.request_id] += o.text_delta
            assert o.num_output_tokens == len(tokens[o.request_id])
            if o.finished:
                final[o.request_id] = o
    assert s.stats().num_free_blocks == s.num_blocks - 1, "blocks leaked"
    return tokens, text, final, steps


@pytest.fixture(scope="module")
def prompts(byte_level_tokenizer) -> dict[str, list[int]]:
    ids = byte_level_tokenizer.encode(TEXT).ids
    return {"copy": ids, "short": ids[:9], "shifted": ids[5:] + ids[:5]}


def summary(final: dict[str, Row]) -> dict[str, tuple]:
    return {rid: (o.finish_reason, o.stop_reason, o.num_output_tokens) for rid, o in final.items()}


def test_ngram_speculation_is_token_for_token_identical_to_plain_greedy(tokenizer_json, prompts):
    ref = run(make(tokenizer_json), prompts, max_tokens=60)
    s = make(tokenizer_json, k=K)
    spec = run(s, prompts, max_tokens=60)
    assert spec[0] == ref[0] and spec[1] == ref[1] and summary(spec[2]) == summary(ref[2])
    st = s.stats()
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert len(st.num_accepted_tokens_per_pos) == K and sum(st.num_accepted_tokens_per_pos) == st.num_accepted_tokens
    assert st.num_generation_tokens == sum(len(t) for t in ref[0].values())
    assert spec[3] < ref[3], "fewer steps with accepted drafts"


def test_self_drafting_accepts_every_draft(tokenizer_json, prompts):
    ref = run(make(tokenizer_json), prompts, max_tokens=50)
    s = make(tokenizer_json, k=K, method="draft_model")
    spec = run(s, prompts, self_draft=True, max_tokens=50)
    assert spec[0] == ref[0] and spec[1] == ref[1] and summary(spec[2]) == summary(ref[2])
    st = s.stats()
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert st.num_accepted_tokens_per_pos[0] == st.num_drafts


@pytest.mark.parametrize("self_draft", [False, True])
def test_stop_string_eos_and_stop_token_inside_an_accepted_run(tokenizer_json, prompts, self_draft):
    method = "draft_model" if self_draft else "ngram"
    free = run(make(tokenizer_json), prompts, max_tokens=80)
    # A stop string from the middle of each output, a stop token id from later in it; EOS in a prompt.
    stop = [free[1]["copy"][40:45], free[1]["shifted"][60:64]]
    stop_ids = [free[0]["short"][30]]
    with_eos = dict(prompts, eos=prompts["copy"][:4] + [EOS] + prompts["copy"][4:20])
    ref = run(make(tokenizer_json), with_eos, max_tokens=80, stop=stop, stop_token_ids=stop_ids)
    s = make(tokenizer_json, k=K, method=method)
    spec = run(s, with_eos, self_draft=self_draft, max_tokens=80, stop=stop, stop_token_ids=stop_ids)
    assert spec[0] == ref[0] and spec[1] == ref[1] and summary(spec[2]) == summary(ref[2])
    reasons = {o.finish_reason for o in ref[2].values()}
    assert reasons == {"stop"}, summary(ref[2])
    assert any(isinstance(o.stop_reason, str) for o in ref[2].values())
    assert ref[2]["eos"].stop_reason is None  # EOS
    assert s.stats().num_accepted_tokens > 0


def test_preemption_in_a_small_cache_changes_nothing(tokenizer_json, prompts):
    many = {f"{rid}{i}": p for i in range(3) for rid, p in prompts.items()}
    ref = run(make(tokenizer_json), many, max_tokens=40, ignore_eos=True)
    s = make(tokenizer_json, k=K, num_blocks=40)
    spec = run(s, many, max_tokens=40, ignore_eos=True)
    assert s.stats().num_preemptions > 0
    assert spec[0] == ref[0] and spec[1] == ref[1]


def test_one_token_per_request_still_works_with_drafts_scheduled(prompts):
    ref = run(make(), prompts, max_tokens=30)
    s = make(k=K)
    spec = run(s, prompts, one_token_api=True, max_tokens=30)
    assert spec[0] == ref[0]
    st = s.stats()
    assert st.num_drafts > 0 and st.num_accepted_tokens == 0


def test_drafts_can_be_disabled_per_request_and_are_off_by_default(prompts):
    s = make()
    assert s.num_speculative_tokens == 0 and s.stats().num_accepted_tokens_per_pos == []
    s = make(k=K)
    s.add_request("g", prompts["copy"], max_tokens=20, allow_drafts=False)
    s.add_request("x", prompts["copy"], max_tokens=20)
    s.schedule()
    s.update_from_output(np.array([prompts["copy"][0]] * 2))
    out = s.schedule()
    assert out.req_ids == ["g", "x"] and out.num_draft_tokens.tolist()[0] == 0 and out.num_draft_tokens[1] > 0


def test_bad_speculation_input_is_rejected(prompts):
    for kw, field in [(dict(num_speculative_tokens=-1), "num_speculative_tokens"),
                      (dict(num_speculative_tokens=2, speculative_method="medusa"), "speculative_method"),
                      (dict(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup_max")]:
        with pytest.raises(InvalidArgumentError) as e:
            Scheduler(num_blocks=8, max_model_len=64, **kw)
        assert e.value.param == field
    s = make(k=2, method="draft_model")
    slot = s.add_request("a", prompts["short"], max_tokens=20)
    s.schedule()
    s.update_from_output(np.array([5]))
    with pytest.raises(InvalidArgumentError, match="all or none"):
        s.schedule(draft_slots=[slot], draft_token_ids=[5, 6])
    with pytest.raises(InvalidArgumentError) as e:
        s.schedule(draft_slots=[slot], draft_token_ids=[5, 6], draft_offsets=[0, 3])
    assert e.value.param == "draft_offsets"
    out = s.schedule(draft_slots=[slot], draft_token_ids=[5, 6], draft_offsets=[0, 2])
    assert out.draft_token_ids.tolist() == [5, 6] and out.num_tokens == 3
    with pytest.raises(InvalidArgumentError) as e:
        s.update_from_output(np.array([5, 6, 7, 8]), num_sampled_tokens=np.array([4], dtype=np.int32))
    assert e.value.param == "num_sampled_tokens"
    with pytest.raises(InvalidArgumentError, match="must be its drafts"):
        s.update_from_output(np.array([6, 7]), num_sampled_tokens=np.array([2], dtype=np.int32))
    res = rows(s.update_from_output(np.array([5, 6, 9]), num_sampled_tokens=np.array([3], dtype=np.int32)))
    assert res[0].new_token_ids == [5, 6, 9]
    assert s.stats().num_accepted_tokens_per_pos == [1, 1]
