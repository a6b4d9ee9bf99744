"""Speculative decoding through the real engine (real core, real rejection sampler) on the embedded
SmolLM2: greedy output is identical token for token with and without n-gram speculation (copy-heavy
prompts, where drafts are accepted, and random ones, where they mostly are not); requests that may
not speculate (penalties) share steps with ones that do, and requests with logprobs speculate; n > 1; a seeded sampled request is
reproducible; preemption and abort with drafts in flight leak no KV block; and the configuration
errors. Each runs with synchronous steps and with async scheduling (the `spec` fixture). Stops inside accepted runs are tested on a float32 tiny model (test_spec_decode_draft.py).

The engines run the embedded model dequantized to float32: the quantized default's decode steps
run the Rust decoder with int8 activations while a verify step's 1 + k rows take the model's own
layers, so the two can part by a whole int8 rounding step (kernels/cpu_quant.py); what is tested
here is speculation, not that kernel. "Identical" then allows one thing: float32 GEMMs of a one-row
and a (1 + k)-row step sum in different orders, so their logits may differ in the last bits, and
`assert_same` accepts a divergence only at a near-tie: the plain engine, given the common prefix,
must score both tokens within TIE_TOLERANCE of each other; the tokens before it must be identical.

One plain engine and an n-gram engine per step pipeline for the module (the weights are shared)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from ferrox import LLM, SamplingParams
from ferrox.engine.protocol import EngineCoreRequest

KV = 64 << 20
MAX_LEN = 1024
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
CODE = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"
COPY = [
    [{"role": "user", "content": "Repeat this text exactly:\n" + CODE}],
    [{"role": "user", "content": "Rename add to plus in this code and print it all:\n" + CODE}],
    [{"role": "user", "content": "Repeat: the cat sat on the mat, the cat sat on the mat, the cat sat"}],
]


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", kv_cache_memory=KV, max_model_len=MAX_LEN)


@pytest.fixture(scope="module", params=["sync", "async"])
def spec(request):
    """Both step pipelines: synchronous steps, and async scheduling, where the core schedules the next
    step as if the drafts in flight were all accepted and the runner shifts it back on the device."""
    return LLM(dtype="float32", kv_cache_memory=KV, max_model_len=MAX_LEN, speculative_config=SPEC,
               async_scheduling=request.param == "async")


@pytest.fixture(scope="module")
def plain_once():
    """A test's plain-engine reference, computed under the first `spec` pipeline and reused under the
    second: the same greedy requests on the same plain engine, so computing them again tests nothing."""
    done: dict[str, list] = {}

    def once(key: str, run: Callable[[], list]) -> list:
        if key not in done:
            done[key] = run()
        return done[key]

    return once


# float32 sums in another order: logits of |x| < 32 move by well under 1e-3 between step shapes.
TIE_TOLERANCE = 1e-2


def assert_same(plain: LLM, prompt_ids: list[int], ref: list[int], out: list[int]) -> None:
    """out == ref, or they part at a near-tie of the top two logits (see the module docs)."""
    if out == ref:
        return
    j = next((i for i, (a, b) in enumerate(zip(ref, out, strict=False)) if a != b), None)
    assert j is not None, f"same tokens, different lengths: {len(out)} vs {len(ref)}"
    scored = plain.generate({"prompt_token_ids": prompt_ids + ref[:j]},
                            SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)
    top = scored[0].outputs[0].logprobs[0]
    assert ref[j] in top and out[j] in top, (j, ref[j], out[j], top)
    assert top[ref[j]].logprob - top[out[j]].logprob <= TIE_TOLERANCE, (j, top)


def assert_all_same(plain: LLM, ref_outs, outs) -> None:
    for a, b in zip(ref_outs, outs, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert_same(plain, list(a.prompt_token_ids), x.token_ids, y.token_ids)


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s["spec_num_drafts"], s["spec_num_draft_tokens"], s["spec_num_accepted_tokens"]


def assert_idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["kv_cache_usage"] == 0.0 and s["num_free_blocks"] == s["num_total_blocks"] - 1, s


def test_greedy_copy_prompts_identical_and_drafts_accepted(plain, plain_once, spec):
    sp = SamplingParams(temperature=0.0, max_tokens=48)
    before = spec_counts(spec)
    ref = plain_once("copy", lambda: plain.chat(COPY, sp, use_tqdm=False))
    assert_all_same(plain, ref, spec.chat(COPY, sp, use_tqdm=False))
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec_counts(spec), before, strict=True))
    assert drafts > 0 and accepted > draft_tokens // 4, (drafts, draft_tokens, accepted)
    per_pos = spec.engine.stats()["spec_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and per_pos[0] >= per_pos[-1] > 0
    assert_idle(spec)


def test_greedy_random_prompts_identical(plain, plain_once, spec):
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(n)]} for n in (5, 30, 70)]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = plain_once("random", lambda: plain.generate(prompts, sp, use_tqdm=False))
    out = spec.generate(prompts, sp, use_tqdm=False)
    assert_all_same(plain, ref, out)


def test_non_speculating_requests_share_steps(plain, plain_once, spec):
    """Requests with penalties decode one token a step beside speculating ones, unchanged; a request
    with logprobs (the top-N, or named logprob_token_ids) speculates and reports a logprob for every
    token it keeps."""
    params = [SamplingParams(temperature=0.0, max_tokens=32),
              SamplingParams(temperature=0.0, max_tokens=32, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=32, logprob_token_ids=[17, 0, 4000])]
    ref = plain_once("mixed", lambda: plain.chat([COPY[0]] * 4, params, use_tqdm=False))
    out = spec.chat([COPY[0]] * 4, params, use_tqdm=False)
    assert_all_same(plain, ref, out)
    for i in (1, 3):
        if out[i].outputs[0].token_ids != ref[i].outputs[0].token_ids:
            continue  # parted at a tie (checked above): the logprobs after it are of other tokens
        lp_a, lp_b = ref[i].outputs[0].logprobs, out[i].outputs[0].logprobs
        assert lp_a is not None and lp_b is not None and len(lp_b) == len(lp_a)
        for step_a, step_b in zip(lp_a, lp_b, strict=True):
            assert step_a.keys() == step_b.keys()
            if i == 3:
                assert {17, 0, 4000} <= step_b.keys()
            # Kept drafts' logprobs come from the (1 + k)-row pass, whose float32 sums may part from the
            # one-row pass's in the last bits (exact equality on one kernel: test_spec_decode_draft.py).
            assert all(abs(step_a[t].logprob - step_b[t].logprob) <= TIE_TOLERANCE for t in step_a), (step_a, step_b)


def test_n_greater_than_one(plain, plain_once, spec):
    sp = SamplingParams(temperature=0.0, max_tokens=24, n=2)
    ref = plain_once("n2", lambda: plain.chat(COPY[2], sp, use_tqdm=False))
    out = spec.chat(COPY[2], sp, use_tqdm=False)
    assert_all_same(plain, ref, out)
    assert out[0].outputs[0].token_ids == out[0].outputs[1].token_ids


def test_seeded_sampling_is_reproducible(spec):
    """The same seeded request twice gives the same tokens (its own generator draws the acceptance
    uniforms and the final race). The prefix cache is reset so both runs compute the same shapes: the
    logits move in their last bits with the step's shape. Alone vs batched is checked on a tiny float32
    model (test_spec_decode_draft.py)."""
    seeded = SamplingParams(temperature=0.7, top_p=0.95, seed=1234, max_tokens=40)
    runs = []
    for _ in range(2):
        spec.reset_prefix_cache()
        runs.append(spec.chat(COPY[0], seeded, use_tqdm=False)[0].outputs[0].token_ids)
    assert runs[0] == runs[1]
    other = spec.chat(COPY[0], SamplingParams(temperature=0.7, top_p=0.95, seed=99, max_tokens=40), use_tqdm=False)
    assert other[0].outputs[0].token_ids != runs[0]
    assert_idle(spec)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_with_drafts_is_exact_and_leaks_nothing(plain, plain_once, async_scheduling):
    """A cache of 14 blocks for 4 requests growing to ~6 blocks each: some are preempted (their drafts
    dropped, recomputed later; with async scheduling also while a step with drafts is in flight) and
    the output is still plain greedy's."""
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [COPY[i % 3] for i in range(4)]
    ref = plain_once("preemption", lambda: plain.chat(prompts, sp, use_tqdm=False))
    block_bytes = 30 * 2 * 3 * 64 * 4 * 16  # layers * (K, V) * kv heads * head_dim * fp32 * block_size
    small = LLM(dtype="float32", kv_cache_memory=14 * block_bytes, max_model_len=192, speculative_config=SPEC,
                async_scheduling=async_scheduling)
    out = small.chat(prompts, sp, use_tqdm=False)
    assert_all_same(plain, ref, out)
    stats = small.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats
    assert_idle(small)


def test_abort_with_drafts_in_flight_frees_blocks(spec):
    core = spec.engine
    prompt = spec.get_tokenizer().encode("Repeat exactly: one two three four one two three four one two")
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    before = spec_counts(spec)
    for i in range(3):
        core.add_request(EngineCoreRequest(f"abort-{i}", list(prompt), sp))
    for _ in range(6):
        core.step()
    assert spec_counts(spec)[0] > before[0], "no step carried drafts before the abort"
    result = core.abort_requests([f"abort-{i}" for i in range(3)])
    assert sorted(result.req_ids) == [f"abort-{i}" for i in range(3)]
    assert not core.has_unfinished_requests()
    assert_idle(spec)


def test_draft_model_with_async_scheduling_fails_at_start():
    """A draft model proposes from the verified tokens: it runs synchronous steps, and asking for
    async scheduling with it is refused by name (n-gram drafts overlap: the `spec` fixture)."""
    from ferrox.loader.source import resolve_model

    draft = {"method": "draft_model", "model": resolve_model(None).path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="async_scheduling.*draft_model"):
        LLM(kv_cache_memory=KV, max_model_len=MAX_LEN, speculative_config=draft, async_scheduling=True)


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
])
def test_bad_speculative_config_names_the_key(config, message):
    with pytest.raises(ValueError, match=f"speculative_config.*{message}"):
        LLM(speculative_config=config)
