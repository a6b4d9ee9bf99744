"""Sampling features through the whole engine on the embedded model."""

from __future__ import annotations

from ferrox import SamplingParams

PROMPT = "Once upon a time"


def test_seeded_sampling_reproduces_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    (alone,) = llm.generate(PROMPT, seeded, use_tqdm=False)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 16, 9)]
    batch = llm.generate(["Hi", "The sky is", PROMPT, "Numbers:"], [others[0], others[1], seeded, others[2]],
                         use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone.outputs[0].token_ids
    other_seed = llm.generate(PROMPT, seeded.clone(seed=99), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_n_samples(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 12 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    (again,) = llm.generate(PROMPT, params, use_tqdm=False)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_stop_strings(llm):
    base = SamplingParams(temperature=0, max_tokens=16)
    full = llm.generate("1, 2, 3, 4,", base, use_tqdm=False)[0].outputs[0]
    assert full.text.startswith(" 5, 6, 7")
    cut = llm.generate("1, 2, 3, 4,", base.clone(stop=[" 7"]), use_tqdm=False)[0].outputs[0]
    assert cut.text == " 5, 6," and cut.finish_reason == "stop" and cut.stop_reason == " 7"
    kept = llm.generate("1, 2, 3, 4,", base.clone(stop=[" 7"], include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == " 5, 6, 7"


def test_stop_string_spanning_the_min_tokens_boundary(llm):
    """A stop string that begins in text generated before min_tokens and is completed by a later
    token stops the request, trimmed, as it would without min_tokens."""
    base = SamplingParams(temperature=0, max_tokens=16)
    full = llm.generate("1, 2, 3, 4,", base, use_tqdm=False)[0].outputs[0]
    stop = " 6, 7"
    begin = full.text.index(stop)
    tok = llm.get_tokenizer()
    prefix_lens = [len(tok.decode(full.token_ids[:k])) for k in range(len(full.token_ids) + 1)]
    inside = next(k for k, n in enumerate(prefix_lens) if begin < n < begin + len(stop))
    cut = llm.generate("1, 2, 3, 4,", base.clone(stop=[stop], min_tokens=inside + 1), use_tqdm=False)[0].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (full.text[:begin], "stop", stop)


def test_min_tokens_and_stop_token_ids(llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    short = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 20
    long = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) >= 20
    second = short.token_ids[1]
    stopped = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[second]), use_tqdm=False)
    out = stopped[0].outputs[0]
    assert out.token_ids == short.token_ids[:2] and out.stop_reason == second


def test_allowed_token_ids_and_logit_bias(llm):
    allowed = [330, 331, 332, 333]
    out = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=0, max_tokens=10, allowed_token_ids=allowed,
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    forced = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5, logit_bias={42: 100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [42] * 5


def test_repetition_penalties_reduce_repeats(llm):
    prompt = "I'm a coach. I'm a coach. I'm a coach."
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    penalized = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5, frequency_penalty=1.0),
        use_tqdm=False,
    )
    a, b = plain[0].outputs[0].token_ids, penalized[0].outputs[0].token_ids
    assert a != b
    assert len(set(b)) > len(set(a))


def test_detokenize_off(llm):
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, detokenize=False), use_tqdm=False)
    assert out[0].outputs[0].text == "" and len(out[0].outputs[0].token_ids) == 4


def test_n_samples_share_the_prompt_blocks(llm):
    """The n samples enter the core together; the first one's allocation registers the prompt's
    full blocks in the prefix cache, so each sibling, scheduled after it in the same step, hits
    every block it can (all full blocks short of the last prompt token): the prompt is computed
    once."""
    prompt = "Write a long story about a dragon who learns to cook. " * 4  # several full KV blocks
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    assert llm.reset_prefix_cache()
    before = llm.engine.stats()
    (out,) = llm.generate(prompt, params, use_tqdm=False)
    after = llm.engine.stats()
    block_size = llm.engine.block_size
    hit_len = (len(out.prompt_token_ids) - 1) // block_size * block_size
    assert hit_len >= 2 * block_size
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 3 * hit_len
    assert out.num_cached_tokens == hit_len
    assert len(out.outputs) == 4 and len({tuple(o.token_ids) for o in out.outputs}) > 1
