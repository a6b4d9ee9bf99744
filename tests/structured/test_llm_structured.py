"""Constrained decoding end to end: ferrox.LLM on the embedded SmolLM2 (CPU), sampled at
temperature 1, every output checked against its constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from ferrox import SamplingParams
from ferrox import StructuredOutputsParams as P

from .schemas import SCHEMAS
from .test_manager import CASES

# Samples per constraint at temperature 1: 11 schemas x 6 is 66 outputs of the JSON test, each
# validated (the batch's decode steps are compute-bound on the 2-core CI box: 8 samples took ~64 s
# there, 12 half as long again).
SAMPLES = 6


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_json_schemas_sampled_at_temperature_1_validate(llm):
    names = list(SCHEMAS)
    prompts = [
        chat(f"Reply with a JSON value for '{name}' matching this schema: {json.dumps(SCHEMAS[name])}")
        for name in names
    ]
    params = [
        SamplingParams(
            temperature=1.0, n=SAMPLES, seed=i, max_tokens=96, structured_outputs=P(json=SCHEMAS[name])
        )
        for i, name in enumerate(names)
    ]
    outs = llm.chat(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        assert len(out.outputs) == SAMPLES
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (name, sample.text)
            jsonschema.validate(json.loads(sample.text), SCHEMAS[name])
        assert len({s.text for s in out.outputs}) > 1  # temperature 1 really samples


def test_regex_choice_lark_grammar_every_output_matches(llm):
    prompts = {
        "regex": "Write a code like 123-abc.",
        "choice": "Answer yes or no: is the sky blue?",
        "lark": "Write a setting like a=1.",
        "gbnf": "Write ab followed by a digit and x or y.",
    }
    names = list(CASES)
    params = [
        SamplingParams(temperature=1.0, n=SAMPLES, seed=7, max_tokens=32, structured_outputs=CASES[name][0])
        for name in names
    ]
    outs = llm.chat([chat(prompts[name]) for name in names], params, use_tqdm=False)
    for name, out in zip(names, outs, strict=True):
        for sample in out.outputs:
            assert sample.finish_reason == "stop" and re.fullmatch(CASES[name][1], sample.text), (
                name,
                sample.text,
            )


def test_json_object_gives_an_object(llm):
    out = llm.chat(
        chat("Describe a cat as JSON."),
        SamplingParams(temperature=0, max_tokens=64, structured_outputs=P(json_object=True)),
        use_tqdm=False,
    )[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an unbounded object may run out of tokens; what is there is still an object prefix
        assert out.text.startswith("{")


def test_unconstrained_requests_unchanged_by_constrained_neighbours(llm):
    free_prompts = [chat("What is the capital of France? Answer in English."), chat("Name three colors.")]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.chat(free_prompts, greedy, use_tqdm=False)
    constrained = [
        SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=P(json=SCHEMAS["person"])),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs=P(choice=["Paris", "Lyon"])),
    ]
    mixed = llm.chat(
        [free_prompts[0], chat("A person as JSON"), free_prompts[1], chat("Capital of France?")],
        [greedy, constrained[0], greedy, constrained[1]],
        use_tqdm=False,
    )
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert "Paris" in alone[0].outputs[0].text and mixed[3].outputs[0].text in ("Paris", "Lyon")


def test_completed_grammar_stops_even_with_ignore_eos(llm):
    out = llm.generate(
        "My PIN is",
        SamplingParams(temperature=0, ignore_eos=True, max_tokens=30, structured_outputs=P(regex="[0-9]{4}")),
        use_tqdm=False,
    )[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", out.text) and out.finish_reason == "stop"
    assert len(out.token_ids) <= 4


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (P(json={"type": "objekt"}), "structured_outputs.json"),
        (P(regex="(unclosed"), "structured_outputs.regex"),
        (P(grammar="start: item+\nitem: UNDEFINED"), "structured_outputs.grammar"),
    ],
)
def test_bad_constraint_is_a_value_error_and_engine_goes_on(llm, params, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=params), use_tqdm=False)
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
