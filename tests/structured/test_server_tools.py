"""Structured output and tool calling through the OpenAI client against a real `ferrox serve`."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from tests.server.server_proc import ServerProcess

from .schemas import SCHEMAS

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER_PARAMS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time", "parameters": TIME_PARAMS},
    },
]
SCHEMA_OF = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it in Tokyo?"}]


@pytest.fixture(scope="module")
def client():
    server = ServerProcess("--served-model-name", "smol")
    try:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        server.stop()


def check_calls(message) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMA_OF[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_required_tool_calls_always_parse_and_validate(client):
    resp = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        temperature=1.0,
        seed=11,
        n=6,
        max_tokens=120,
        parallel_tool_calls=False,
    )
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(check_calls(choice.message)) == 1


def test_named_tool_call_uses_that_function(client):
    resp = client.chat.completions.create(
        model="smol",
        messages=ASK,
        tools=TOOLS,
        temperature=1.0,
        seed=5,
        n=6,
        max_tokens=80,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert [name for name, _ in check_calls(choice.message)] == ["get_time"]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client, tool_choice):
    # One call: with parallel calls allowed the embedded model may keep calling until max_tokens.
    kwargs = dict(
        model="smol", messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=120,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
    assert finish == "tool_calls" and whole.finish_reason == "tool_calls"
    streamed = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"] and c["id"].startswith("call_") for c in calls.values())
    check_calls(whole.message)


def test_tool_results_go_back_to_the_template(client):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "Sunny, 24 degrees celsius"},
    ]
    resp = client.chat.completions.create(
        model="smol", messages=messages, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_format_json_schema_chat_and_completions(client):
    schema = SCHEMAS["person"]
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "A person as JSON"}],
        temperature=1.0,
        seed=2,
        n=4,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
    )
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    comp = client.completions.create(
        model="smol",
        prompt="Person record:",
        temperature=1.0,
        seed=3,
        n=4,
        max_tokens=64,
        extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
        },
    )
    for choice in comp.choices:
        jsonschema.validate(json.loads(choice.text), schema)
    obj = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "A cat as JSON"}],
        temperature=0,
        max_tokens=48,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.startswith("{")


def test_vllm_extra_fields(client):
    def ask(**extra):
        return client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Answer"}],
            temperature=1.0,
            seed=4,
            n=3,
            max_tokens=24,
            extra_body=extra,
        ).choices

    for choice in ask(structured_outputs={"regex": "[0-9]{2}-[a-z]{3}"}):
        assert re.fullmatch("[0-9]{2}-[a-z]{3}", choice.message.content)
    for choice in ask(guided_choice=["alpha", "beta"]):
        assert choice.message.content in ("alpha", "beta")
    for choice in ask(guided_regex="(yes|no)!"):
        assert choice.message.content in ("yes!", "no!")
    for choice in ask(guided_grammar='start: "x" NUM\nNUM: /[0-9]{1,3}/'):
        assert re.fullmatch("x[0-9]{1,3}", choice.message.content)
    for choice in ask(guided_json=SCHEMAS["enum"]):
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS["enum"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objekt"}},
                }
            },
            "Invalid type",
        ),
        ({"extra_body": {"guided_grammar": "start: ( 'a'"}}, "grammar"),
        ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "regex"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_input_is_a_400_with_a_clear_message(client, fields, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **fields
        )
    assert info.value.status_code == 400 and message in str(info.value), str(info.value)
