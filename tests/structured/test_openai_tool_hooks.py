"""The server's tool hooks (entrypoints/openai/tools.py) on parsed requests, without a server."""

from __future__ import annotations

import json

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tools import ToolStream, parse_tool_calls, prepare_messages, tool_constraint

TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}},
    },
    {"type": "function", "function": {"name": "g"}},
]
HERMES = 'ok <tool_call>\n{"name": "f", "arguments": {"x": 12}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'


def request(tool_choice, tools=TOOLS):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": tool_choice}
    )


def streamed(req, text: str, size: int) -> tuple[str, list[tuple[str, str]], bool]:
    stream = ToolStream(req)
    content, calls = "", {}
    for i in range(0, len(text), size):
        delta = stream.step(text[i : i + size], i + size >= len(text)) or {}
        content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"]["arguments"]
    return content, [tuple(calls[i]) for i in sorted(calls)], stream.tools_called


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("size", [1, 5, 1000])
def test_hermes_modes_stream_equals_whole(tool_choice, size):
    req = request(tool_choice)
    content, calls = parse_tool_calls(HERMES, req)
    assert content == "ok"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 12}),
        ("g", {}),
    ]
    s_content, s_calls, called = streamed(req, HERMES, size)
    assert called and s_content.strip() == content
    assert s_calls == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_named_output_is_the_arguments(size):
    req = request({"type": "function", "function": {"name": "f"}})
    assert tool_constraint(req).json == TOOLS[0]["function"]["parameters"]
    content, calls = parse_tool_calls('{"x": 3}', req)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 3}'}
    assert streamed(req, '{"x": 3}', size) == ("", [("f", '{"x": 3}')], True)


def test_none_and_plain_text_stay_content():
    assert parse_tool_calls(HERMES, request("none")) == (HERMES, None)
    assert streamed(request("none"), HERMES, 7) == (HERMES, [], False)
    assert parse_tool_calls("Just text.", request("auto")) == ("Just text.", None)
    assert streamed(request("auto"), "Just text.", 3) == ("Just text.", [], False)


def test_prepare_messages_only_for_templates_without_tools():
    messages = [{"role": "user", "content": "hi"}]
    assert prepare_messages(messages, TOOLS, "{% for t in tools %}{% endfor %}") == (messages, TOOLS)
    rewritten, tools = prepare_messages(messages, TOOLS, "{{ messages }}")
    assert tools is None and rewritten[0]["role"] == "system" and "<tools>" in rewritten[0]["content"]
    assert prepare_messages(messages, None, "{{ messages }}") == (messages, None)


def test_bad_tool_schema_is_a_value_error_naming_tools():
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    with pytest.raises(ValueError, match="^tools: .*Invalid type"):
        tool_constraint(request("required", bad))
