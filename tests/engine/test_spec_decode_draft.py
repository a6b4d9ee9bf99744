"""Draft-model speculation (worker/draft_model.py) through the real engine.

Self-drafting (the draft model is the target) must accept every drafted token: any draft the target
rejects would mean the draft model's twin KV cache does not mirror the target's (a missed shadow
write, a stale slot after preemption, a wrong scratch block). Output must equal plain greedy
decoding, also with a different (tiny random) draft model that the target mostly disagrees with."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.loader.source import resolve_model

from tests.helpers.tiny_models import make_tiny_llama

K = 3
PROMPTS = [{"prompt_token_ids": p} for p in ([1, 5, 9, 33, 7], list(range(3, 60)), [40, 41, 42] * 9, [7])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # tiny llama: layers * (K, V) * kv heads * head_dim * fp32 * block_size


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=1, num_layers=1)


def ids(llm: LLM, prompts=PROMPTS, sp=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def drafting(model: str, draft: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", 4 << 20)
    kw.setdefault("max_model_len", 512)
    return LLM(model=model, **kw,
               speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": K})


def ngram(model: str, **kw) -> LLM:
    return LLM(model=model, max_model_len=512, kv_cache_memory=4 << 20,
               speculative_config={"method": "ngram", "num_speculative_tokens": K}, **kw)


def assert_all_accepted_and_idle(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s["spec_num_draft_tokens"] > 0 and s["spec_num_accepted_tokens"] == s["spec_num_draft_tokens"], s
    assert s["kv_cache_usage"] == 0.0 and s["num_free_blocks"] == s["num_total_blocks"] - 1, s


def test_self_drafting_accepts_everything_with_preemption_and_stops(target):
    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    ref = ids(plain)
    # 12 blocks for 4 requests of up to 6 blocks each: some are preempted and recomputed.
    small = drafting(target, target, kv_cache_memory=12 * BLOCK_BYTES, max_model_len=128)
    assert ids(small) == ref
    assert small.engine.stats()["num_preemptions"] > 0
    assert_all_accepted_and_idle(small)
    # max_tokens inside an accepted run (K + 1 = 4 tokens per step): 6 and 9 end mid-run.
    for n in (6, 9):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        assert ids(small, sp=sp) == [r[:n] for r in ref]
    assert_all_accepted_and_idle(small)


def test_other_draft_model_output_is_exact(target, other_draft):
    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    llm = drafting(target, other_draft)
    assert ids(llm) == ids(plain)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=30, ignore_eos=True)
    assert ids(llm, PROMPTS[:1], seeded) == ids(llm, PROMPTS, seeded)[:1]
    s = llm.engine.stats()
    assert s["spec_num_drafts"] > 0 and s["kv_cache_usage"] == 0.0


def test_embedded_model_drafting_itself():
    path = resolve_model(None).path
    llm = LLM(max_model_len=512, kv_cache_memory=48 << 20,
              speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": K})
    out = llm.generate(["The capital of France is", "Count from one to ten:"],
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].text.strip().startswith("Paris")
    assert_all_accepted_and_idle(llm)


def test_draft_vocabulary_must_match(target):
    with pytest.raises(ValueError, match="speculative_config.model: the draft model's vocabulary"):
        drafting(target, resolve_model(None).path)


@pytest.mark.slow
def test_ngram_with_tensor_parallelism(target):
    """TP=2 (CPU, gloo): the driver verifies, the other rank runs the same 1 + k-token forward passes
    from the broadcast step arrays (logits_indices included), with async scheduling."""
    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    # Async scheduling: the driver also broadcasts how far each token moves back (the drafts the step
    # in flight rejected); its synchronous steps are the same forward passes without that shift.
    sharded = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20, tensor_parallel_size=2,
                  speculative_config={"method": "ngram", "num_speculative_tokens": K}, async_scheduling=True)
    try:
        assert ids(sharded) == ids(plain)
        s = sharded.engine.stats()
        assert s["spec_num_drafts"] > 0 and s["kv_cache_usage"] == 0.0, s
    finally:
        sharded.engine.shutdown()


def test_stops_inside_accepted_runs(target):
    """max_tokens, a stop string (excluded and included) and a stop token id that fall inside a step's
    accepted run end the request exactly where plain decoding does: with self-drafting every step
    accepts K + 1 tokens, with n-gram drafts on a repetitive prompt some steps do."""
    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    prompt = PROMPTS[2]
    ref = plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    ids_, text = ref.token_ids, ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cases = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 9, 14)] + [
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ids_[13]]),
    ]
    engines = [drafting(target, target), ngram(target), ngram(target, async_scheduling=True)]
    for llm in engines:
        for sp in cases:
            a = plain.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            b = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason), sp
        s = llm.engine.stats()
        assert s["spec_num_accepted_tokens"] > 0 and s["kv_cache_usage"] == 0.0, s


def test_logprobs_of_kept_drafts_match_plain_decoding(target):
    """A request with logprobs speculates too: every token it keeps from a run of drafts has its logprob,
    rank and top alternatives, equal to one-step-at-a-time decoding (float32 tiny model), also when a
    stop ends the run early; and the drafts really were accepted."""
    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    spec = drafting(target, target)
    overlapped = ngram(target, async_scheduling=True)
    for sp in (SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
               SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=0)):
        ref = plain.generate(PROMPTS, sp, use_tqdm=False)
        for a, b in zip(ref * 2, spec.generate(PROMPTS, sp, use_tqdm=False)
                        + overlapped.generate(PROMPTS, sp, use_tqdm=False), strict=True):
            x, y = a.outputs[0], b.outputs[0]
            assert y.token_ids == x.token_ids
            assert y.logprobs is not None and len(y.logprobs) == len(y.token_ids) == len(x.logprobs)
            for pa, pb in zip(x.logprobs, y.logprobs, strict=True):
                assert pa.keys() == pb.keys()
                for t in pa:
                    assert abs(pa[t].logprob - pb[t].logprob) < 1e-4 and pa[t].rank == pb[t].rank
            assert abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
    assert_all_accepted_and_idle(spec)
    s = overlapped.engine.stats()
    assert s["spec_num_accepted_tokens"] > 0 and s["kv_cache_usage"] == 0.0, s


def test_grammar_walks_the_drafts(target):
    """Constrained requests speculate too: each verified position gets its grammar's mask after the drafts
    before it, so a draft the grammar forbids is rejected and every kept token is allowed. Output equals
    constrained one-step-at-a-time decoding (also where the grammar completes inside a kept run)."""
    from ferrox.sampling_params import StructuredOutputsParams as SO

    plain = LLM(model=target, max_model_len=512, kv_cache_memory=4 << 20)
    engines = [drafting(target, target), ngram(target), ngram(target, async_scheduling=True)]
    cases = [SO(choice=["red apple", "green", "blue sky at night"]), SO(regex="[a-e ]{4,20}"),
             SO(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})]
    for llm in engines:
        for so in cases:
            sp = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=so)
            a = [o.outputs[0] for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
            b = [o.outputs[0] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
            assert [(x.token_ids, x.text, x.finish_reason) for x in b] == \
                [(x.token_ids, x.text, x.finish_reason) for x in a], so
        s = llm.engine.stats()
        assert s["kv_cache_usage"] == 0.0 and s["num_free_blocks"] == s["num_total_blocks"] - 1, s
    # Self-drafting under a permissive grammar: drafts the grammar allows are kept (not only rejected).
    permissive = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                structured_outputs=SO(regex="(.|\n){0,200}"))
    self_drafting = drafting(target, target)
    assert ids(self_drafting, sp=permissive) == ids(plain, sp=permissive)
    s = self_drafting.engine.stats()
    assert s["spec_num_accepted_tokens"] > 0 and s["kv_cache_usage"] == 0.0, s
