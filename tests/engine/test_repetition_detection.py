"""vLLM's `repetition_detection` on the real engine (the embedded model, greedy) and the Rust core's stop
check: a request whose output ends in a pattern repeated min_count times stops there, finish_reason
"repetition", stop_reason "repetition_detected", its text whole; the rule is checked against a Python
transcription of vLLM's (the output of an unconstrained run, the first length at which it fires)."""

from __future__ import annotations

import pytest
from ferrox import SamplingParams
from ferrox.errors import InvalidArgumentError
from ferrox.sampling_params import RepetitionDetectionParams

# The embedded model's greedy loops: 4 tokens ("The cat sat."), 6 ("1, 2, ": two numbers), 1 (" ha").
LOOPING = ["The cat sat. The cat sat. The cat sat.", "1, 2, 1, 2, 1, 2, 1, 2,", "ha ha ha ha ha ha ha ha"]


def fires(output: list[int], lo: int, hi: int, count: int) -> bool:
    """vLLM's check_sequence_repetition: sizes lo..hi from the smallest, giving up at the first size whose
    repeats do not fit; the last `size` tokens equal each of the count - 1 windows before them."""
    for size in range(max(lo, 1), hi + 1):
        if size * count > len(output):
            return False
        tail = output[-size:]
        if all(output[len(output) - size * (k + 1):len(output) - size * k] == tail for k in range(1, count)):
            return True
    return False


@pytest.mark.parametrize("lo, hi, count, prompts", [(1, 4, 3, [0, 2]), (2, 6, 2, [0, 1, 2]), (3, 4, 3, [0, 2])])
def test_a_looping_output_stops_where_the_rule_first_fires(llm, lo, hi, count, prompts):
    looping = [LOOPING[i] for i in prompts]
    free = llm.generate(looping, SamplingParams(temperature=0, max_tokens=40))
    rule = RepetitionDetectionParams(min_pattern_size=lo, max_pattern_size=hi, min_count=count)
    stopped = llm.generate(looping, SamplingParams(temperature=0, max_tokens=40, repetition_detection=rule))
    for prompt, a, b in zip(looping, free, stopped, strict=True):
        tokens = list(a.outputs[0].token_ids)
        first = next((n for n in range(1, len(tokens) + 1) if fires(tokens[:n], lo, hi, count)), None)
        assert first is not None, (prompt, tokens)  # these prompts loop: the rule must fire within 40 tokens
        out = b.outputs[0]
        assert list(out.token_ids) == tokens[:first]
        assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
        # The text is the whole of those tokens' (nothing held back), as a run cut there by max_tokens gives it.
        cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=first))[0].outputs[0]
        assert out.text == cut.text


def test_min_tokens_defers_the_check_and_off_means_off(llm):
    prompt = LOOPING[2]
    tokens = list(llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0].token_ids)
    rule = {"max_pattern_size": 2, "min_count": 3}
    first = next(n for n in range(1, 31) if fires(tokens[:n], 1, 2, 3))
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 5,
                                                 repetition_detection=rule))[0].outputs[0]
    assert len(late.token_ids) == first + 5 and late.finish_reason == "repetition"
    off = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, repetition_detection={
        "max_pattern_size": 0}))[0].outputs[0]
    assert (len(off.token_ids), off.finish_reason) == (30, "length")


@pytest.mark.parametrize("rule, what", [
    ({"max_pattern_size": 4, "min_count": 1}, "min_count must be >= 2"),
    ({"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2}, "min_pattern_size <= max_pattern_size"),
    ({"max_pattern_size": -1}, "must be >= 0"),
    ({"max_pattern_size": 2, "min_count": 2, "window": 8}, "unknown field"),
    ({"max_pattern_size": "4", "min_count": 2}, "must be an integer"),
])
def test_bad_rules_are_refused_naming_the_field(rule, what):
    with pytest.raises(InvalidArgumentError, match=what) as info:
        SamplingParams(repetition_detection=rule)
    assert info.value.param == "repetition_detection"
