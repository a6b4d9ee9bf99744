"""vLLM's bad_words on the embedded model: each word's token sequences (as written and after a space), a
one-token word never sampled, a longer word's last token banned right after the rest, against a greedy
reference that applies vLLM's rule to transformers' logits step by step."""

from __future__ import annotations

import pytest
import torch
from ferrox import SamplingParams
from ferrox.errors import InvalidArgumentError

MAX_TOKENS = 8


def _reference_sequences(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's encoding of bad words: the word without leading space, and with one when that is a
    different sequence of the same length."""
    out = []
    for w in words:
        bare = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        out.append(bare)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


def _greedy_with_bad_words(hf_model, prompt_ids: list[int], sequences: list[list[int]], n: int) -> list[int]:
    """vLLM's V1 rule: a sequence's last token is -inf when the output so far ends with the rest."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = hf_model(torch.tensor([prompt_ids + out])).logits[0, -1].clone()
            for seq in sequences:
                prefix = seq[:-1]
                if len(prefix) <= len(out) and (not prefix or out[-len(prefix):] == prefix):
                    logits[seq[-1]] = float("-inf")
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(("prompt", "words"), [
    ("Write a sentence about photosynthesis:", ["Photosynthesis"]),  # two tokens, met at the output's 3rd-4th
    ("The capital of France is", ["Paris", " answer"]),  # one-token words, one given with its space
])
def test_bad_words_match_vllms_rule_on_transformers(llm, hf_model, prompt, words):
    tokenizer = llm.get_tokenizer()
    sequences = _reference_sequences(tokenizer, words)
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (plain,) = llm.generate([prompt], free, use_tqdm=False)
    (out,) = llm.generate([prompt], free.clone(bad_words=words), use_tqdm=False)
    got = out.outputs[0].token_ids
    assert got == _greedy_with_bad_words(hf_model, out.prompt_token_ids, sequences, MAX_TOKENS)
    assert got != plain.outputs[0].token_ids  # each case's free output says one of its words
    for seq in sequences:
        assert all(got[i:i + len(seq)] != seq for i in range(len(got)))


def test_bad_words_token_bound_and_bad_entries_are_refused(llm):
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(bad_words=["ok", " "])
    assert info.value.param == "bad_words"
    with pytest.raises(InvalidArgumentError) as info:
        SamplingParams(bad_words=[f"w{i}" for i in range(129)])
    assert info.value.param == "bad_words"
    long_word = " ".join(["antidisestablishmentarianism"] * 120)  # past the 1,024 tokens of all words
    with pytest.raises(InvalidArgumentError) as info:
        llm.generate(["Hi"], SamplingParams(max_tokens=2, bad_words=[long_word]), use_tqdm=False)
    assert info.value.param == "bad_words"
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1 and not llm.engine.has_unfinished_requests()
