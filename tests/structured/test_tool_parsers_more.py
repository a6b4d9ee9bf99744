"""The mistral, qwen3_coder and pythonic tool parsers: whole-text extraction, text that is not a
call staying content, and streamed deltas (any chunking) reassembling to exactly what extract gives."""

from __future__ import annotations

import json
import random

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from ferrox.entrypoints.openai.tool_parsers.qwen3_coder import convert_parameter
from ferrox.entrypoints.openai.tools import ToolStream, needs_special_tokens, parse_tool_calls

from .test_tool_parsers import reassemble as stream

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def chunkings(text: str, seeds=(0, 1, 2)) -> list[list[int]]:
    out = [[1] * len(text), [len(text) or 1]]
    for seed in seeds:
        rng = random.Random(seed)
        out.append([rng.randint(1, 9) for _ in range(len(text) or 1)])
    return out


def check_stream_equals_extract(name: str, text: str, tools=None) -> None:
    whole = get_tool_parser(name)(tools=tools).extract(text)
    for chunks in chunkings(text):
        parser = get_tool_parser(name)(tools=tools)
        content, calls = stream(parser, text, chunks)
        assert (content.strip() or None) == whole.content, (text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert parser.tools_called == bool(whole.tool_calls)


def assert_content_only(name: str, text: str, tools=None) -> None:
    result = get_tool_parser(name)(tools=tools).extract(text)
    assert result.tool_calls == [] and result.content == (text.strip() or None), text
    check_stream_equals_extract(name, text, tools)


def test_registered_names():
    for name in ("mistral", "qwen3_coder", "pythonic", "llama4_pythonic"):
        assert name in TOOL_PARSERS
    # vLLM's qwen3_xml reads Qwen3-Coder's format too: the same calls, typed by the tools
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    (call,) = get_tool_parser("qwen3_xml")(tools=WEATHER_TOOLS).extract(text).tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    # hermes / llama3_json take the request's tools too, and ignore them
    assert get_tool_parser("hermes")(tools=WEATHER_TOOLS).extract("hi").content == "hi"


def test_default_parser_from_template():
    assert default_tool_parser("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert default_tool_parser("<tool_call>\n<function=example>\n<parameter=x>") == "qwen3_coder"
    assert default_tool_parser("<|python_tag|>") == "llama3_json"
    assert default_tool_parser("<tool_call>{{ tool_call|tojson }}</tool_call>") == "hermes"
    assert default_tool_parser(None) == "hermes"


# ---- mistral -----------------------------------------------------------------------------------

MISTRAL_ONE = '[TOOL_CALLS]get_weather{"city": "Paris", "days": 3}'
MISTRAL_TWO = (
    'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "note": "a \\"q\\" }[TOOL_CALLS]"}'
    "[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}"
)
MISTRAL_ARRAY = (
    'Checking both. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
    '{"name": "get_time", "arguments": {}}]'
)
MISTRAL_VALID = [MISTRAL_ONE, MISTRAL_TWO, MISTRAL_ARRAY, 'Done. [TOOL_CALLS][{"name": "f"}] \n', "no calls here"]


def _is_mistral_id(call_id: str) -> bool:
    return len(call_id) == 9 and call_id.isalnum() and call_id.isascii()


def test_mistral_extract_name_shape():
    parser = get_tool_parser("mistral")()
    result = parser.extract(MISTRAL_ONE)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    result = parser.extract(MISTRAL_TWO)
    assert result.content == "Let me check."
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(result.tool_calls[0].arguments) == {"city": "Paris", "note": 'a "q" }[TOOL_CALLS]'}
    assert result.tool_calls[1].arguments == "{}"
    assert all(_is_mistral_id(c.id) for c in result.tool_calls)
    assert result.tool_calls[0].id != result.tool_calls[1].id


def test_mistral_extract_array_shape():
    result = get_tool_parser("mistral")().extract(MISTRAL_ARRAY)
    assert result.content == "Checking both."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {}),
    ]
    assert all(_is_mistral_id(c.id) for c in result.tool_calls)
    # no "arguments": an empty object, as vLLM
    assert get_tool_parser("mistral")().extract('[TOOL_CALLS][{"name": "f"}]').tool_calls[0].arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]",
        "[TOOL_CALLS] I would rather not.",
        "[TOOL_CALLS]get weather{}",  # a space in the name
        '[TOOL_CALLS]get_weather{"city": "Par',  # cut short
        '[TOOL_CALLS]get_weather{"city": tru}',  # not JSON
        '[TOOL_CALLS]{"city": "Paris"}',  # no name
        "[TOOL_CALLS][1, 2]",
        "[TOOL_CALLS][]",
        '[TOOL_CALLS][{"city": "Paris"}]',  # an object that is not a call
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',  # cut short
        "Use [TOOL_CALLS] to call tools.",
        "[TOOL_CALLS]get_weather",
    ],
)
def test_mistral_not_a_call_is_content(text):
    assert_content_only("mistral", text)


def test_mistral_text_after_calls_is_content():
    text = '[TOOL_CALLS]f{"a": 1} and then some words'
    result = get_tool_parser("mistral")().extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": 1}')]
    assert result.content == "and then some words"
    check_stream_equals_extract("mistral", text)
    # a bad call after a good one: the good one stands, the rest is content
    text = '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]oops'
    result = get_tool_parser("mistral")().extract(text)
    assert [c.name for c in result.tool_calls] == ["f"] and result.content == "[TOOL_CALLS]oops"
    check_stream_equals_extract("mistral", text)


@pytest.mark.parametrize("text", MISTRAL_VALID)
def test_mistral_stream_reassembles_to_extract(text):
    check_stream_equals_extract("mistral", text)


def test_mistral_needs_special_tokens_kept():
    request = _chat_request(WEATHER_TOOLS)
    assert needs_special_tokens(request, "mistral")
    assert needs_special_tokens(request, None, template="{{ '[TOOL_CALLS]' }}")
    assert not needs_special_tokens(request, "hermes") and not needs_special_tokens(request, "qwen3_coder")
    forced = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": WEATHER_TOOLS, "tool_choice": "required"}
    )
    assert not needs_special_tokens(forced, "mistral")  # "required" is read with Hermes


def test_mistral_stream_ids_and_held_marker():
    parser = get_tool_parser("mistral")()
    assert parser.feed("Hi [TOOL_").content == "Hi "
    assert not parser.feed("CALLS]get_weather{")  # waits for the object
    d = parser.feed('"city": "Paris"}')
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert _is_mistral_id(d.tool_calls[0].id)
    assert not parser.finish() and parser.tools_called


# ---- qwen3_coder -------------------------------------------------------------------------------

QWEN_ONE = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
QWEN_TWO = (
    "I'll check both.\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n"
    "<parameter=days>\n12\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
# A value holding the format's own tags (code that writes tool calls) and several lines.
QWEN_CODE = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n<parameter=content>\n"
    "s = '</parameter>'\nt = '<tool_call>'\n\n</parameter>\n</function>\n</tool_call>\nWritten."
)
QWEN_VALID = [QWEN_ONE, QWEN_TWO, QWEN_CODE, "Just text, no <tool call>.", QWEN_ONE + "\n  \n" + QWEN_ONE]


def test_qwen3_coder_extract_one_and_two():
    parser = get_tool_parser("qwen3_coder")(tools=WEATHER_TOOLS)
    result = parser.extract(QWEN_ONE)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    assert result.tool_calls[0].id.startswith("call_")
    result = parser.extract(QWEN_TWO)
    assert result.content == "I'll check both."
    assert [(c.name, c.arguments) for c in result.tool_calls] == [
        ("get_weather", '{"city": "São Paulo", "days": 12}'),
        ("get_time", "{}"),
    ]


def test_qwen3_coder_value_may_hold_tags():
    result = get_tool_parser("qwen3_coder")().extract(QWEN_CODE)
    assert result.content == "Written."
    assert json.loads(result.tool_calls[0].arguments) == {
        "path": "x.py",
        "content": "s = '</parameter>'\nt = '<tool_call>'\n",
    }


def test_qwen3_coder_cut_short_after_header_is_a_call():
    # as vLLM: once the function header is complete it is a call; the value being written runs to the end
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    result = get_tool_parser("qwen3_coder")(tools=WEATHER_TOOLS).extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Par"}')]
    check_stream_equals_extract("qwen3_coder", text, WEATHER_TOOLS)
    # a missing </parameter> ends at </function>
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</function>\n</tool_call>"
    result = get_tool_parser("qwen3_coder")(tools=WEATHER_TOOLS).extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"days": 4}')]
    check_stream_equals_extract("qwen3_coder", text, WEATHER_TOOLS)


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>",
        "<tool_call>\n",
        "<tool_call>\n<function=get_wea",  # cut short in the header
        "<tool_call>\nnot xml\n</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',  # Hermes JSON: not this format
        "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",  # a space in the name
        "<tool_call>\n<function={{ tool.name }}>\n</function>\n</tool_call>",  # an unrendered template
        "<tool_call>\n<function=>\n</function>\n</tool_call>",
        "Say <tool_call> and then stop.",
    ],
)
def test_qwen3_coder_not_a_call_is_content(text):
    assert_content_only("qwen3_coder", text, WEATHER_TOOLS)


@pytest.mark.parametrize("text", QWEN_VALID)
def test_qwen3_coder_stream_reassembles_to_extract(text):
    check_stream_equals_extract("qwen3_coder", text, WEATHER_TOOLS)


def test_qwen3_coder_stream_sends_name_then_parameters():
    parser = get_tool_parser("qwen3_coder")(tools=WEATHER_TOOLS)
    assert parser.feed("Ok <tool").content == "Ok "
    d = parser.feed("_call>\n<function=get_weather>\n<parameter=city>\nPar")
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("get_weather", "{")]
    d = parser.feed("is\n</parameter>\n<parameter=days>\n2\n</parameter>\n")
    assert [(t.name, t.arguments) for t in d.tool_calls] == [(None, '"city": "Paris"')]
    d = parser.feed("</function>\n</tool_call>")
    assert [(t.name, t.arguments) for t in d.tool_calls] == [(None, ', "days": 2}')]
    assert not parser.finish() and parser.tools_called


TYPED_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer"},
                    "x": {"type": "number"},
                    "whole": {"type": "number"},
                    "b": {"type": "boolean"},
                    "o": {"type": "object"},
                    "a": {"type": "array"},
                    "zip": {"type": "string"},
                    "maybe": {"type": ["integer", "null"]},
                    "opt": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                    "free": {},
                },
            },
        },
    }
]


def _qwen_call(params: dict[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


def test_qwen3_coder_converts_values_per_schema():
    text = _qwen_call(
        {
            "n": "42",
            "x": "2.5",
            "whole": "3.0",
            "b": "True",
            "o": '{"k": [1, "v"]}',
            "a": "[1, 2]",
            "zip": "02134",
            "maybe": "null",
            "opt": "None",
            "free": "7",
            "undeclared": "hello",
        }
    )
    result = get_tool_parser("qwen3_coder")(tools=TYPED_TOOLS).extract(text)
    args = result.tool_calls[0].arguments
    assert json.loads(args) == {
        "n": 42,
        "x": 2.5,
        "whole": 3,
        "b": True,
        "o": {"k": [1, "v"]},
        "a": [1, 2],
        "zip": "02134",
        "maybe": None,
        "opt": None,
        "free": 7,
        "undeclared": "hello",
    }
    assert args == json.dumps(json.loads(args), ensure_ascii=False)  # the text json.dumps gives
    check_stream_equals_extract("qwen3_coder", text, TYPED_TOOLS)


def test_qwen3_coder_values_that_do_not_convert_stay_text():
    text = _qwen_call({"n": "many", "b": "yes", "o": "{'k': (1, 2)}", "a": "not a list", "x": "nan"})
    args = json.loads(get_tool_parser("qwen3_coder")(tools=TYPED_TOOLS).extract(text).tool_calls[0].arguments)
    # a Python literal is read for object/array; the rest keeps its text
    assert args == {"n": "many", "b": "yes", "o": {"k": [1, 2]}, "a": "not a list", "x": "nan"}
    # without tools (or for an unknown function) values read as JSON when they parse
    args = json.loads(get_tool_parser("qwen3_coder")().extract(text).tool_calls[0].arguments)
    assert args["n"] == "many" and args["x"] == "nan"
    assert convert_parameter("3", None) == 3 and convert_parameter("3", {"type": "string"}) == "3"
    assert convert_parameter("3", {"enum": ["3", "4"]}) == "3" and convert_parameter("3", {"enum": [3, 4]}) == 3
    assert convert_parameter("{1, 2}", {"type": "array"}) == {1, 2}  # not JSON: the arguments keep the text
    text = _qwen_call({"a": "{1, 2}"})
    assert get_tool_parser("qwen3_coder")(tools=TYPED_TOOLS).extract(text).tool_calls[0].arguments == '{"a": "{1, 2}"}'


def test_qwen3_coder_repeated_key_keeps_first():
    text = _qwen_call({"n": "1"}).replace("</function>", "<parameter=n>\n2\n</parameter>\n</function>")
    result = get_tool_parser("qwen3_coder")(tools=TYPED_TOOLS).extract(text)
    assert result.tool_calls[0].arguments == '{"n": 1}'
    check_stream_equals_extract("qwen3_coder", text, TYPED_TOOLS)


def _chat_request(tools):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "auto"}
    )


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_qwen3_coder_through_the_tool_hooks(size):
    req = _chat_request(WEATHER_TOOLS)
    content, calls = parse_tool_calls(QWEN_TWO, req, "qwen3_coder")
    assert content == "I'll check both."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "São Paulo", "days": 12}'),  # "days" an integer: the request's tools arrived
        ("get_time", "{}"),
    ]
    stream_ = ToolStream(req, "qwen3_coder")
    s_content, s_calls = "", {}
    for i in range(0, len(QWEN_TWO), size):
        delta = stream_.step(QWEN_TWO[i : i + size], i + size >= len(QWEN_TWO)) or {}
        s_content += delta.get("content", "")
        for tc in delta.get("tool_calls", []):
            entry = s_calls.setdefault(tc["index"], ["", ""])
            entry[0] += tc["function"].get("name", "")
            entry[1] += tc["function"]["arguments"]
    assert stream_.tools_called and s_content.strip() == content
    assert [tuple(s_calls[i]) for i in sorted(s_calls)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in calls
    ]


# ---- pythonic ----------------------------------------------------------------------------------

PY_ONE = '[get_weather(city="Paris", days=3)]'
PY_TWO = "[get_weather(city='São Paulo', days=3, opts={\"unit\": 'C', 'hours': [1, 2]}), get_time()]"
PY_LLAMA4 = '<|python_start|>[get_weather(city="Paris", note="""a ) ] "quote"\nline""")]<|python_end|>'
PY_VALID = [PY_ONE, PY_TWO, PY_LLAMA4, "  [f(a=-1.5, b=None, c=True, d=(1, 2)),\n g(), ]\n", "The answer is 42."]


def test_pythonic_extract_one_and_two():
    parser = get_tool_parser("pythonic")()
    result = parser.extract(PY_ONE)
    assert result.content is None
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    result = parser.extract(PY_TWO)
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "São Paulo", "days": 3, "opts": {"unit": "C", "hours": [1, 2]}}),
        ("get_time", {}),
    ]
    assert "São" in result.tool_calls[0].arguments  # ensure_ascii=False
    assert all(c.id.startswith("call_") for c in result.tool_calls)
    result = parser.extract(PY_LLAMA4)
    assert json.loads(result.tool_calls[0].arguments) == {"city": "Paris", "note": 'a ) ] "quote"\nline'}


@pytest.mark.parametrize(
    "text",
    [
        "Sure: [get_weather(city='Paris')]",  # text before the list
        "[get_weather(city='Paris')] and more",  # text after it
        "[get_weather(city='Par",  # cut short
        "[get_weather(city='Paris'), get_ti",
        "[get_weather('Paris')]",  # positional
        "[get_weather(city=lookup())]",  # not a literal
        "[get_weather(**kw)]",
        "[a.b(x=1)]",
        "[f(x={1, 2})]",  # a set has no JSON
        "[f(x=float('nan'))]",
        "[1, 2, 3]",
        "[]",
        "[f(x=1)",
        "[[f(x=1)]]",
        "get_weather(city='Paris')",
        "",
    ],
)
def test_pythonic_not_a_call_list_is_content(text):
    assert_content_only("pythonic", text)


@pytest.mark.parametrize("text", PY_VALID)
def test_pythonic_stream_reassembles_to_extract(text):
    check_stream_equals_extract("pythonic", text)


def test_pythonic_stream_plain_text_is_not_held():
    parser = get_tool_parser("pythonic")()
    assert parser.feed("  [").content is None  # may be a call list
    assert parser.feed("1] see").content == "  [1] see"  # cannot be one: out it goes
    assert parser.feed(" below").content == " below"
    assert not parser.finish() and not parser.tools_called


def test_messages_and_responses_routes_read_calls_with_the_servers_parser():
    """/v1/messages and /v1/responses read tool calls (whole and streamed) with --tool-call-parser, as
    chat does, not only with the parser the chat template implies."""
    from ferrox.entrypoints.tool_use import BlockStream, ToolRequest, split_reply

    req = ToolRequest(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                      tool_choice="auto")
    text = '{"name": "f", "parameters": {"a": 1}}'
    assert [b.kind for b in split_reply(text, req, None)] == ["text"]  # no template: Hermes reads no call
    blocks = split_reply(text, req, None, "llama3_json")
    assert [(b.kind, b.name, json.loads(b.arguments)) for b in blocks] == [("tool_call", "f", {"a": 1})]
    stream = BlockStream(req, None, "llama3_json")
    for piece in (text[:7], text[7:20], text[20:]):
        stream.step(piece, False)
    stream.step("", True)
    assert [(b.kind, b.name, json.loads(b.arguments)) for b in stream.blocks] == [("tool_call", "f", {"a": 1})]
