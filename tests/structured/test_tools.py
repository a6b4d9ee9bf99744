"""tools + tool_choice -> constraints; required/named outputs read back by the Hermes parser."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
from ferrox.entrypoints.openai.tool_parsers import get_tool_parser
from ferrox.structured.backend import validate_params
from ferrox.structured.manager import StructuredOutputManager
from ferrox.structured.tools import messages_for_plain_template, tool_choice_constraint, tools_system_prompt

from .conftest import SMOLLM2_EOS, SMOLLM2_VOCAB
from .walk import random_walk

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, ADD, NO_ARGS]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}


@pytest.fixture(scope="module")
def manager(tokenizer_json):
    m = StructuredOutputManager(tokenizer_json, SMOLLM2_VOCAB, [SMOLLM2_EOS])
    yield m
    m.shutdown()


def walk(manager, constraint, n, seed, max_steps=200):
    ids = [f"t{seed}-{i}" for i in range(n)]
    for request_id in ids:
        manager.submit(request_id, constraint.structured_outputs)
    deadline = time.monotonic() + 30
    ready: list[str] = []
    while len(ready) < n:
        assert time.monotonic() < deadline and not manager.take_failures()
        manager.wait_for_pending(0.1)
        ready += manager.poll_ready()
    results = random_walk(manager, ids, SMOLLM2_EOS, seed=seed, max_steps=max_steps)
    manager.free(ids)
    return [(manager.tokenizer.decode_str(tokens), finished) for tokens, finished in results.values()]


def test_required_outputs_parse_as_hermes_calls_and_validate(manager):
    constraint = tool_choice_constraint(TOOLS, "required", parallel_tool_calls=False)
    assert constraint.mode == "required"
    validate_params(constraint.structured_outputs)
    names = set()
    for text, finished in walk(manager, constraint, 12, seed=3):
        assert finished, text
        result = get_tool_parser("hermes")().extract(text)
        assert len(result.tool_calls) == 1 and result.content is None, text
        call = result.tool_calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        names.add(call.name)
    assert len(names) >= 2  # any of the tools may be chosen


def test_required_parallel_allows_several_calls(manager):
    constraint = tool_choice_constraint(TOOLS, "required")
    for text, _finished in walk(manager, constraint, 4, seed=4, max_steps=120):
        calls = get_tool_parser("hermes")().extract(text).tool_calls
        assert calls, text  # the first call always completes well within the step budget
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_named_output_is_the_arguments_object(manager):
    constraint = tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "get_weather"}})
    assert constraint.mode == "named" and constraint.function_name == "get_weather"
    for text, finished in walk(manager, constraint, 8, seed=5):
        assert finished
        jsonschema.validate(json.loads(text), SCHEMAS["get_weather"])


def test_auto_and_none_are_unconstrained():
    assert tool_choice_constraint(TOOLS, "auto").structured_outputs is None
    assert tool_choice_constraint(TOOLS, None).mode == "auto"
    assert tool_choice_constraint(TOOLS, "none").structured_outputs is None
    assert tool_choice_constraint(None, None).mode == "none"


@pytest.mark.parametrize(
    ("tools", "tool_choice", "field"),
    [
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        (None, "required", "tool_choice"),
        ([{"type": "function", "function": {}}], "auto", r"tools\[0\].function.name"),
        ([WEATHER, WEATHER], "auto", r"tools\[1\].function.name: duplicate"),
        ([{"type": "retrieval"}], "auto", r"tools\[0\].type"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "auto", "parameters"),
    ],
)
def test_bad_tools_and_tool_choice(tools, tool_choice, field):
    with pytest.raises(ValueError, match=field):
        tool_choice_constraint(tools, tool_choice)


def test_named_function_with_invalid_schema_is_a_value_error():
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    constraint = tool_choice_constraint([bad], {"type": "function", "function": {"name": "f"}})
    with pytest.raises(ValueError, match="Invalid type"):
        validate_params(constraint.structured_outputs)


def test_messages_for_plain_template_round_trip():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    out = messages_for_plain_template(messages, TOOLS)
    assert (
        out[0]["role"] == "system" and "<tools>" in out[0]["content"] and "get_weather" in out[0]["content"]
    )
    assert all(isinstance(m["content"], str) for m in out)
    # The assistant's earlier call renders in the same format the parser reads back.
    calls = get_tool_parser("hermes")().extract(out[2]["content"]).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    assert out[3] == {"role": "tool", "content": "<tool_response>\n21 C\n</tool_response>"}
    assert "now" in tools_system_prompt(TOOLS)


def test_required_and_named_close_objects_alike(manager):
    """Parameters that list properties and say nothing of others take no others, under tool_choice
    required as under a named tool (and a response_format): the same rule for every constraint."""
    open_tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        constraint = tool_choice_constraint([open_tool], choice, parallel_tool_calls=False)
        for text, finished in walk(manager, constraint, 6, seed=11):
            assert finished, text
            if choice == "required":
                calls = get_tool_parser("hermes")().extract(text).tool_calls
                assert len(calls) == 1, text
                text = calls[0].arguments
            assert set(json.loads(text)) == {"a"}, (choice, text)
