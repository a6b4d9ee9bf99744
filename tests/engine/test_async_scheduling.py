"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) gives
the same greedy tokens as synchronous stepping: in a batch, with EOS stops and per-request length
limits (the step computed after a stop is dropped), after preemption by recompute, with small
prefill chunks, and with every request kind in one batch (grammars, penalties, min_tokens,
logprobs, seeded n > 1, aborts mid-flight), none of which may switch the engine to synchronous
steps. Each run ends with every KV block back in the pool. On CPU it runs the real Rust core and torch model
(async is the default only on CUDA); the GPU variant checks CUDA-graph replay too."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.sampling_params import RequestOutputKind
from ferrox.structured.params import StructuredOutputsParams

from tests.engine.conftest import TEST_KV_CACHE_MEMORY
from tests.engine.prompts import PROMPTS, greedy_ids
from tests.engine.test_batch_invariance import assert_no_leaked_blocks

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# Stops on EOS where the model says it, and at several lengths: exercises requests finishing while
# the next step is already in flight.
MIXED = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 5)) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def async_llm():
    llm = LLM(dtype="float32", kv_cache_memory=TEST_KV_CACHE_MEMORY, max_model_len=4096, max_num_seqs=32, async_scheduling=True)
    assert llm.engine.async_scheduling
    return llm


@pytest.fixture(scope="module")
def sync_once(llm):
    """The synchronous engine's outputs for a batch several tests compare with, computed by the first
    test that asks and reused by the others: the same requests on the same session engine (its prefix
    cache reset first), so computing them again tests nothing."""
    done: dict[str, list] = {}

    def once(key: str, prompts: list[str], params) -> list:
        if key not in done:
            llm.reset_prefix_cache()
            done[key] = llm.generate(prompts, params, use_tqdm=False)
        return done[key]

    return once


def test_async_batch_equals_sync(llm, async_llm, sync_once):
    assert not llm.engine.async_scheduling  # CPU default: synchronous
    for name, params in (("greedy", GREEDY), ("mixed", MIXED)):
        expected = greedy_ids(sync_once(name, PROMPTS, params))
        async_llm.reset_prefix_cache()
        got = greedy_ids(async_llm.generate(PROMPTS, params, use_tqdm=False))
        assert got == expected
        assert_no_leaked_blocks(async_llm)


def test_async_steps_really_overlap(async_llm):
    """Decode steps are scheduled with the previous one in flight (input id -1 placeholders)."""
    launched, restore = _spy_launches(async_llm.engine)
    try:
        async_llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
    finally:
        restore()
    assert sum(holes for holes, _ in launched) >= 4 * (GREEDY.max_tokens - 2)
    assert all(has_prev for holes, has_prev in launched if holes)


def test_async_with_chunks_and_preemption(llm, async_llm, sync_once):
    expected = greedy_ids(sync_once("greedy", PROMPTS, GREEDY))
    chunked = LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=32, max_num_seqs=16,
                  async_scheduling=True)
    assert greedy_ids(chunked.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
    assert_no_leaked_blocks(chunked)

    per_block = kv_cache_bytes_per_block(llm.engine.spec, 16, torch.float32)
    longest = max(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) + GREEDY.max_tokens
    tight = LLM(dtype="float32", kv_cache_memory=per_block * -(-longest // 16) * 2, max_model_len=longest, async_scheduling=True)
    # The first 8 prompts (the longest among them) need 18 of the cache's 8 blocks at once: 3 preemptions
    # (all 16 prompts: 8), in half the steps.
    outs = tight.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert greedy_ids(outs) == expected[:8]
    assert_no_leaked_blocks(tight)


def _spy_launches(engine):
    """Records, per launched step, (number of -1 placeholder inputs, step in flight?)."""
    launched = []
    inner = engine.runner.launch

    def spy(so, prev=None):
        launched.append((int((so.input_ids < 0).sum()), prev is not None))
        return inner(so, prev)

    engine.runner.launch = spy
    return launched, lambda: setattr(engine.runner, "launch", inner)


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _mixed_params() -> list[SamplingParams]:
    """One of each request kind, greedy (or seeded) so sync and async must agree token for token."""
    so = StructuredOutputsParams
    return [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=PERSON)),
        SamplingParams(temperature=0, max_tokens=8, structured_outputs=so(choice=["yes", "no", "maybe"])),
        SamplingParams(temperature=0, max_tokens=16, structured_outputs=so(regex=r"[0-9]{3}-[a-z]{2,4}")),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                       frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=16, min_tokens=10),
        SamplingParams(temperature=0, max_tokens=10, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12, n=2),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={11: 5.0}, stop=["\n"]),
    ]


def _check_constraints(outs) -> None:
    person = json.loads(outs[1].outputs[0].text)
    jsonschema.validate(person, PERSON)
    assert outs[2].outputs[0].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[3].outputs[0].text)
    assert len(outs[5].outputs[0].token_ids) >= 10


@pytest.mark.timeout(300)
def test_grammar_requests_finish_with_async_scheduling(async_llm):
    """The bug this pipeline fixed: a request waiting for its grammar was never released by the
    overlapped step path, so it hung forever."""
    out = async_llm.generate(["Is the sky blue? Answer:"],
                             SamplingParams(temperature=0, max_tokens=5,
                                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                             use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")
    assert_no_leaked_blocks(async_llm)


@pytest.mark.timeout(600)
def test_mixed_request_kinds_overlap_and_equal_sync(async_llm, sync_once):
    """Free, JSON schema, choice, regex, penalties, min_tokens, logprobs, seeded n > 1, logit_bias and
    stop strings in one batch: every request finishes, constraints hold, tokens (and logprobs) equal
    the synchronous engine's, and the engine keeps overlapping steps the whole time."""
    params = _mixed_params()
    prompts = PROMPTS[: len(params)]
    expected = sync_once("request-kinds", prompts, params)
    async_llm.reset_prefix_cache()
    launched, restore = _spy_launches(async_llm.engine)
    try:
        got = async_llm.generate(prompts, params, use_tqdm=False)
    finally:
        restore()
    _check_constraints(got)
    for e, g in zip(expected, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs], g.prompt
    lp_e, lp_g = expected[6].outputs[0].logprobs, got[6].outputs[0].logprobs
    assert [sorted(d) for d in lp_g] == [sorted(d) for d in lp_e]
    for de, dg in zip(lp_e, lp_g, strict=True):
        for tok, v in de.items():
            assert abs(dg[tok].logprob - v.logprob) < 1e-4
    # Every decode step after the first overlapped its predecessor: no request kind switched the
    # engine to synchronous steps.
    decode_steps = [has_prev for holes, has_prev in launched if holes]
    assert len(decode_steps) >= 8 and all(decode_steps)
    assert sum(1 for _, has_prev in launched if not has_prev) <= 2
    assert_no_leaked_blocks(async_llm)


@pytest.mark.timeout(600)
def test_aborts_mid_flight_leave_the_rest_unchanged(async_llm, sync_once):
    """Abort a third of a mixed batch while steps are in flight; the others give the synchronous
    engine's tokens and every block comes back."""
    params = _mixed_params()
    prompts = PROMPTS[: len(params)]
    expected = sync_once("request-kinds", prompts, params)
    engine = async_llm.engine
    processor = async_llm.output_processor
    async_llm.reset_prefix_cache()
    ids = []
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        rid = f"abort-test-{i}"
        ids.append(rid)
        ids_ = async_llm.get_tokenizer().encode(prompt)
        req = EngineCoreRequest(rid, ids_, sp.clone(output_kind=RequestOutputKind.FINAL_ONLY))
        for r in processor.add_request(req, prompt):
            engine.add_request(r)
    doomed = ids[1::3]
    finals = {}
    steps = 0
    while engine.has_unfinished_requests() or processor.has_unfinished_requests():
        for ro in processor.process_outputs(engine.step()):
            if ro.finished:
                finals[ro.request_id] = ro
        steps += 1
        if steps == 3:
            engine_ids = processor.abort_requests(doomed)
            engine.abort_requests(engine_ids)
        if steps > 2000:
            raise AssertionError("engine did not finish")
    for i, rid in enumerate(ids):
        if rid in doomed:
            continue
        assert [c.token_ids for c in finals[rid].outputs] == [c.token_ids for c in expected[i].outputs]
    assert_no_leaked_blocks(async_llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_async_equals_sync_with_cuda_graphs(tmp_path):
    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(str(tmp_path), hidden_size=128, num_layers=2)
    prompts = ["hello world", "the cat sat on", "one two three", "a b c d e f g", "tiny model says"] * 4
    params = [SamplingParams(temperature=0, max_tokens=5 + 7 * (i % 4), ignore_eos=i % 2 == 0)
              for i in range(len(prompts))]
    runs = []
    for use_async in (False, True):
        gpu = LLM(model, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20,
                  async_scheduling=use_async)
        runs.append(greedy_ids(gpu.generate(prompts, params, use_tqdm=False)))
        assert_no_leaked_blocks(gpu)
    assert runs[1] == runs[0]


@pytest.mark.timeout(600)
def test_penalties_and_min_tokens_next_to_a_grammar_row_equal_sync(llm, async_llm):
    """A grammar row defers its step's sampling until the previous token reached the host; the
    penalty and min_tokens rows sampled then must still count that token (it is handed to the core
    only afterwards). Strong penalties make a missed count change the greedy tokens."""
    so = StructuredOutputsParams
    params = [
        SamplingParams(temperature=0, max_tokens=40, structured_outputs=so(json=PERSON)),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=1.5, presence_penalty=1.0),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(temperature=0, max_tokens=24, min_tokens=20, stop_token_ids=[13, 198]),
    ]
    prompts = ["Describe a person as JSON:", "1, 1, 1, 1, 1,", "the the the the", "A short list:"]
    llm.reset_prefix_cache()
    expected = greedy_ids(llm.generate(prompts, params, use_tqdm=False))
    async_llm.reset_prefix_cache()
    assert greedy_ids(async_llm.generate(prompts, params, use_tqdm=False)) == expected
    assert_no_leaked_blocks(async_llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.timeout(600)
def test_gpu_grammar_rows_behind_a_mask_gate(tmp_path):
    """On CUDA under async scheduling a constrained step is sampled behind a mask gate: the device,
    not the host, waits for the grammar mask (worker/mask_gate.py). Every request kind then gives the
    synchronous engine's tokens (float32, a tiny random Llama: the GPU machine has no embedded
    model), and a fill that fails ends only the constrained requests of its step, with an error,
    instead of hanging the device."""
    from tests.helpers.tiny_models import make_tiny_llama

    model = make_tiny_llama(str(tmp_path), hidden_size=128, num_layers=2)
    kw = dict(device="cuda", dtype="float32", max_num_seqs=16, kv_cache_memory=64 << 20)
    params = _mixed_params()
    prompts = PROMPTS[: len(params)]
    sync = LLM(model, **kw, async_scheduling=False)
    expected = sync.generate(prompts, params, use_tqdm=False)
    expected3 = sync.generate(prompts[:3], params[:3], use_tqdm=False)  # (batch shapes differ on a GPU)
    gpu = LLM(model, **kw)
    assert gpu.engine.async_scheduling
    got = gpu.generate(prompts, params, use_tqdm=False)
    gate = gpu.engine.runner._mask_gate
    assert gate is not None and gate._seq >= 8  # the grammar rows' steps went through the gate
    for e, g in zip(expected, got, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs], g.prompt
    assert any(option.startswith(got[2].outputs[0].text) for option in ("yes", "no", "maybe"))
    assert_no_leaked_blocks(gpu)

    structured = gpu.engine.structured
    real_fill = structured.fill_rows
    calls = []

    def failing_fill(matchers, out):
        calls.append(len(matchers))
        if len(calls) == 2:
            raise RuntimeError("injected fill failure")
        real_fill(matchers, out)

    structured.fill_rows = failing_fill
    try:
        outs = gpu.generate(prompts[:3], params[:3], use_tqdm=False)
    finally:
        structured.fill_rows = real_fill
    assert outs[0].outputs[0].token_ids == expected3[0].outputs[0].token_ids  # the free row is untouched
    failed = [o for o in outs[1:] if o.outputs[0].finish_reason == "error"]
    assert failed and all("injected fill failure" in (o.error or "") for o in failed)
    assert_no_leaked_blocks(gpu)
    # And the engine goes on.
    again = gpu.generate(prompts[:3], params[:3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [e.outputs[0].token_ids for e in expected3]
