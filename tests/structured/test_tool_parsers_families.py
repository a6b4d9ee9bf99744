"""The deepseek_v3, deepseek_v31, kimi_k2, glm45 and glm47 tool parsers (and the glm45 reasoning parser): whole-text
extraction, text that is no call staying content, and streamed deltas -- cut at every character, at the
format's markers as a tokenizer would, and at random -- giving exactly what extract gives."""

from __future__ import annotations

import json
import re

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from ferrox.entrypoints.openai.tool_parsers.glm45 import convert_value
from ferrox.entrypoints.openai.tools import ToolStream, needs_special_tokens, parse_tool_calls
from ferrox.reasoning import get_reasoning_parser

from .test_tool_parsers import reassemble
from .test_tool_parsers_more import WEATHER_TOOLS, check_stream_equals_extract

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
# Every marker of the four formats: a tokenizer has each as one token, so a stream cuts around them.
MARKERS = re.compile("|".join(re.escape(m) for m in (
    DS_BEGIN, DS_END, DS_CALL, DS_CALL_END, DS_SEP, KIMI_BEGIN, KIMI_END, KIMI_CALL, KIMI_ARGS, KIMI_CALL_END,
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")))

NESTED = '{"city": "São Paulo", "opts": {"unit": "C", "hours": [1, {"h": 2}]}, "note": "a \\"q\\" } 東京"}'
NESTED_VALUE = {"city": "São Paulo", "opts": {"unit": "C", "hours": [1, {"h": 2}]}, "note": 'a "q" } 東京'}


def ds_v3_call(name: str, arguments: str) -> str:
    return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def ds_v31_call(name: str, arguments: str) -> str:
    return f"{DS_CALL}{name}{DS_SEP}{arguments}{DS_CALL_END}"


def kimi_call(name: str, arguments: str, index: int) -> str:
    return f"{KIMI_CALL}functions.{name}:{index}{KIMI_ARGS}{arguments}{KIMI_CALL_END}"


def glm_call(name: str, pairs: dict[str, str], newlines: bool = True) -> str:
    nl = "\n" if newlines else ""
    body = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in pairs.items())
    return f"<tool_call>{name}{nl}{body}</tool_call>"


# Each section format: its begin and end markers, and one call's text (name, arguments, index).
SECTIONS = {
    "deepseek_v3": (DS_BEGIN, DS_END, lambda n, a, i: ("\n" if i else "") + ds_v3_call(n, a)),
    "deepseek_v31": (DS_BEGIN, DS_END, lambda n, a, i: ds_v31_call(n, a)),
    "kimi_k2": (KIMI_BEGIN, KIMI_END, kimi_call),
}


def section(name: str, *calls: tuple[str, str]) -> str:
    begin, end, call = SECTIONS[name]
    return begin + "".join(call(n, a, i) for i, (n, a) in enumerate(calls)) + end


def token_cuts(text: str) -> list[int]:
    """Chunk sizes that cut text around each marker and every 3 characters between (a tokenizer's view)."""
    sizes, pos = [], 0
    for m in MARKERS.finditer(text):
        while pos < m.start():
            sizes.append(min(3, m.start() - pos))
            pos += sizes[-1]
        sizes.append(m.end() - m.start())
        pos = m.end()
    while pos < len(text):
        sizes.append(min(3, len(text) - pos))
        pos += sizes[-1]
    return sizes or [1]


def check_every_cut(name: str, text: str, tools=None) -> None:
    """Streaming text in two pieces cut at every character, at token-like cuts, one character at a time and
    at random gives extract's content and calls."""
    check_stream_equals_extract(name, text, tools)
    whole = get_tool_parser(name)(tools=tools).extract(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    cuts = [[i, len(text) - i] for i in range(len(text) + 1)] + [token_cuts(text)]
    for chunks in cuts:
        content, calls = reassemble(get_tool_parser(name)(tools=tools), text, [c for c in chunks if c] or [1])
        assert (content.strip() or None) == whole.content, (text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, (text, chunks)


def calls_of(name: str, text: str, tools=None) -> tuple[str | None, list[tuple[str, object]]]:
    result = get_tool_parser(name)(tools=tools).extract(text)
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


def test_registered_and_default_from_template():
    for name in ("deepseek_v3", "deepseek_v31", "kimi_k2", "glm45", "glm47"):
        assert name in TOOL_PARSERS
    # the markers each family's chat template writes when a call comes back in the conversation
    v3 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] "
          "+ '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}")
    v31 = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' "
           "+ tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}")
    kimi_t = "<|tool_calls_section_begin|>{%- for tc in message['tool_calls'] -%}<|tool_call_begin|>{{ tc['id'] }}"
    glm = "{{ '\\n<tool_call>' + tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v }}</arg_value>\n</tool_call>"
    assert default_tool_parser(v3) == "deepseek_v3"
    assert default_tool_parser(v31) == "deepseek_v31"
    assert default_tool_parser(kimi_t) == "kimi_k2"
    assert default_tool_parser(glm) == "glm45"
    # GLM-4.7's template writes a pair with no newline inside (and says so in its tools prompt): glm47
    glm47 = ("{{- '<tool_call>' + tc.name -}}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>"
             "<arg_value>{{ v }}</arg_value>{% endfor %}</tool_call>")
    assert default_tool_parser(glm47) == "glm47"
    assert default_tool_parser("output the function name and arguments within the following XML format:\n"
                               "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}"
                               "</arg_value>...</tool_call>") == "glm47"
    assert default_tool_parser("<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>"
                               "{arg-value-1}</arg_value>\n...</tool_call>") == "glm45"  # GLM-4.5 / 4.6's
    # the defaults that were there stay
    assert default_tool_parser("<tool_call>{{ tool_call|tojson }}</tool_call>") == "hermes"
    assert default_tool_parser("<tool_call>\n<function=example>\n<parameter=x>") == "qwen3_coder"
    assert default_tool_parser("{{ '[TOOL_CALLS]' }}") == "mistral" and default_tool_parser(None) == "hermes"


# ---- deepseek_v3 / deepseek_v31 / kimi_k2 ------------------------------------------------------


@pytest.mark.parametrize("name", list(SECTIONS))
def test_one_and_several_calls(name):
    def fmt(*calls):
        return section(name, *calls)

    assert calls_of(name, fmt(("get_weather", '{"city": "Paris", "days": 3}'))) == (
        None, [("get_weather", {"city": "Paris", "days": 3})])
    text = "Let me check both.\n\n" + fmt(("get_weather", '{"city": "Paris"}'), ("get_time", "{}"))
    assert calls_of(name, text) == ("Let me check both.", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    content, calls = calls_of(name, fmt(("get_weather", NESTED)))
    assert content is None and calls == [("get_weather", NESTED_VALUE)]
    # the arguments are the object's text as written
    assert get_tool_parser(name)().extract(fmt(("f", NESTED))).tool_calls[0].arguments == NESTED


def test_ids():
    calls = get_tool_parser("kimi_k2")().extract(section("kimi_k2", ("get_weather", "{}"), ("get_time", "{}"))).tool_calls
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.get_time:1"]  # as vLLM returns them
    text = KIMI_BEGIN + KIMI_CALL + " get_time:7 " + KIMI_ARGS + " {} " + KIMI_CALL_END + KIMI_END
    assert [(c.id, c.name) for c in get_tool_parser("kimi_k2")().extract(text).tool_calls] == [("get_time:7", "get_time")]
    for name in ("deepseek_v3", "deepseek_v31"):
        calls = get_tool_parser(name)().extract(section(name, ("f", "{}"), ("f", "{}"))).tool_calls
        assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


@pytest.mark.parametrize("name", list(SECTIONS))
def test_text_after_the_calls_and_a_bad_call_after_good_ones(name):
    assert calls_of(name, section(name, ("f", '{"a": 1}')) + "\nDone.") == ("Done.", [("f", {"a": 1})])
    # a bad call after a good one in the same section: the good one stands, the rest is content
    begin, end, call = SECTIONS[name]
    bad = call("g", '{"a": tru}', 0)
    text = begin + call("f", '{"a": 1}', 0) + bad + end
    content, calls = calls_of(name, text)
    assert calls == [("f", {"a": 1})] and content == bad + end
    check_every_cut(name, text)


@pytest.mark.parametrize("name", list(SECTIONS))
def test_valid_replies_stream_like_extract(name):
    def fmt(*calls):
        return section(name, *calls)

    for text in (
        fmt(("get_weather", '{"city": "Paris", "days": 3}')),
        "Checking.\n" + fmt(("get_weather", NESTED), ("get_time", "{}")) + "\n  \n",
        fmt(("f", "{}")) + " then " + fmt(("g", '{"x": [1, 2]}')),  # two sections, text between
        "No calls here, only text with a stray <｜ and <| in it.",
    ):
        check_every_cut(name, text)


def _malformed(name: str) -> list[str]:
    def fmt(*calls):
        return section(name, *calls)

    begin, end, _ = SECTIONS[name]
    call = fmt(("get_weather", '{"city": "Paris"}'))
    shared = [
        begin,
        begin + end,
        begin + " I would rather not." + end,
        fmt(("get_weather", '{"city": "Par')),  # not JSON
        fmt(("get_weather", '["Paris"]')),  # not an object
        fmt(("get weather", "{}")),  # a space in the name
        fmt(("", "{}")),
        call[: call.index('"Paris"')],  # cut short inside the call
        call[: -len(end) - 2],  # cut short inside the end marker
        "Use " + begin + " to call tools.",
    ]
    if name == "deepseek_v3":
        shared += [
            DS_BEGIN + f"{DS_CALL}function{DS_SEP}f\n{{}}{DS_CALL_END}" + DS_END,  # no ```json fence
            DS_BEGIN + ds_v31_call("f", "{}") + DS_END,  # V3.1's shape
        ]
    elif name == "deepseek_v31":
        shared.append(section("deepseek_v3", ("f", "{}")))  # V3's shape: "function" then no object
    else:
        shared += [
            KIMI_BEGIN + f"{KIMI_CALL}functions.f{KIMI_ARGS}{{}}{KIMI_CALL_END}" + KIMI_END,  # no :IDX
            KIMI_BEGIN + f"{KIMI_CALL}functions.f:1{{}}{KIMI_CALL_END}" + KIMI_END,  # no argument marker
        ]
    return shared


@pytest.mark.parametrize("name", list(SECTIONS))
def test_malformed_calls_are_content(name):
    for text in _malformed(name):
        result = get_tool_parser(name)().extract(text)
        assert result.tool_calls == [] and result.content == (text.strip() or None), text
        check_every_cut(name, text)


def test_stream_sends_each_call_whole_once_closed():
    parser = get_tool_parser("deepseek_v31")()
    assert parser.feed("Hi <｜tool▁calls").content == "Hi "  # a marker's first characters wait
    assert not parser.feed("▁begin｜>" + DS_CALL + "get_weather" + DS_SEP + '{"city": ')
    d = parser.feed('"Paris"}' + DS_CALL_END)
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [(0, "get_weather", '{"city": "Paris"}')]
    assert d.tool_calls[0].id.startswith("call_") and parser.tools_called
    d = parser.feed("\n" + ds_v31_call("get_time", "{}") + DS_END + "\n")
    assert [(t.index, t.name) for t in d.tool_calls] == [(1, "get_time")] and not d.content
    assert not parser.finish()


# ---- glm45 -------------------------------------------------------------------------------------

TYPED = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "zip": {"type": "string"}, "maybe": {"type": ["string", "null"]},
}}}}]


def test_glm45_one_and_several_calls():
    one = glm_call("get_weather", {"city": "Paris", "days": "3"})
    assert calls_of("glm45", one, WEATHER_TOOLS) == (None, [("get_weather", {"city": "Paris", "days": 3})])
    two = "I'll check both.\n" + one + "\n" + glm_call("get_time", {})
    assert calls_of("glm45", two, WEATHER_TOOLS) == (
        "I'll check both.", [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})])
    # GLM-4.7's template writes no newlines
    assert calls_of("glm45", glm_call("get_weather", {"city": "Oslo"}, newlines=False), WEATHER_TOOLS) == (
        None, [("get_weather", {"city": "Oslo"})])
    result = get_tool_parser("glm45")(tools=WEATHER_TOOLS).extract(one)
    assert result.tool_calls[0].arguments == '{"city": "Paris", "days": 3}' and result.tool_calls[0].id.startswith("call_")


def test_glm45_values_typed_by_the_schema():
    text = glm_call("f", {"s": "42", "n": "42", "x": "2.5", "b": "true", "o": json.dumps(NESTED_VALUE, ensure_ascii=False),
                          "a": "[1, 2]", "zip": "02134", "maybe": "null", "free": "{'k': True}", "word": "hello",
                          "esc": '{\\"a\\": 1}'})
    _, [(_, args)] = calls_of("glm45", text, TYPED)
    assert args == {"s": "42", "n": 42, "x": 2.5, "b": True, "o": NESTED_VALUE, "a": [1, 2], "zip": "02134",
                    "maybe": "null", "free": {"k": True}, "word": "hello", "esc": {"a": 1}}
    arguments = get_tool_parser("glm45")(tools=TYPED).extract(text).tool_calls[0].arguments
    assert "São Paulo" in arguments and "東京" in arguments  # ensure_ascii=False
    # without tools every value is read (vLLM: a parameter it cannot type is deserialized)
    _, [(_, args)] = calls_of("glm45", glm_call("f", {"s": "42", "t": " two words \n"}))
    assert args == {"s": 42, "t": "two words"}
    assert convert_value("{1, 2}", None) == {1, 2}  # a set: the arguments keep its text
    assert get_tool_parser("glm45")().extract(glm_call("f", {"a": "{1, 2}", "n": "NaN"})).tool_calls[0].arguments == \
        '{"a": "{1, 2}", "n": "NaN"}'
    check_every_cut("glm45", text, TYPED)


@pytest.mark.parametrize("text", [
    "<tool_call>",
    "<tool_call>get_weather",  # cut short: no </tool_call>
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par",
    "<tool_call>\n</tool_call>",  # no name
    "<tool_call>get weather\n</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>',  # Hermes JSON: not this format
    "<tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call>",  # no <arg_value>
    "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>",  # no key
    "<tool_call>get_weather\nstray words\n</tool_call>",
    "Say <tool_call> and then stop.",
])
def test_glm45_malformed_calls_are_content(text):
    result = get_tool_parser("glm45")(tools=WEATHER_TOOLS).extract(text)
    assert result.tool_calls == [] and result.content == (text.strip() or None), text
    check_every_cut("glm45", text, WEATHER_TOOLS)


def test_glm45_streams_like_extract():
    one = glm_call("get_weather", {"city": "São Paulo", "days": "12"})
    for text in (one, "Sure.\n\n" + one + "\n" + glm_call("get_time", {}) + "\n", one + "bad <tool_call>x y</tool_call> tail",
                 glm_call("f", {"note": 'a "q" </arg_key> 東京'}, newlines=False), "plain <tool text"):
        check_every_cut("glm45", text, WEATHER_TOOLS)
    content, calls = calls_of("glm45", one + "bad <tool_call>x y</tool_call> tail", WEATHER_TOOLS)
    assert calls == [("get_weather", {"city": "São Paulo", "days": 12})]
    assert content == "bad <tool_call>x y</tool_call> tail"


# ---- glm47 ---------------------------------------------------------------------------------------

def glm47_call(name: str, pairs: dict[str, str], blank: str = "") -> str:
    """GLM-4.7's call: no newlines; `blank` between each key and its value (GLM-4.7 may write a literal \\n)."""
    return f"<tool_call>{name}" + "".join(
        f"<arg_key>{k}</arg_key>{blank}<arg_value>{v}</arg_value>" for k, v in pairs.items()) + "</tool_call>"


def test_glm47_several_typed_arguments_and_literal_newlines():
    pairs = {"s": "42", "n": "42", "x": "2.5", "b": "true", "o": json.dumps(NESTED_VALUE, ensure_ascii=False),
             "a": "[1, 2]", "zip": "02134", "maybe": "null", "word": "hello"}
    want = {"s": "42", "n": 42, "x": 2.5, "b": True, "o": NESTED_VALUE, "a": [1, 2], "zip": "02134",
            "maybe": "null", "word": "hello"}
    for blank in ("", "\\n", "\n", " \\n\\n "):
        text = glm47_call("f", pairs, blank)
        assert calls_of("glm47", text, TYPED) == (None, [("f", want)]), blank
    check_every_cut("glm47", "Sure.\n" + glm47_call("f", pairs, "\\n"), TYPED)
    # a literal \n after the name and between pairs; a call with no arguments is its name alone
    text = ("<tool_call>get_weather\\n<arg_key>city</arg_key>\\n<arg_value>Oslo</arg_value>\\n<arg_key>days"
            "</arg_key><arg_value>3</arg_value>\\n</tool_call><tool_call>get_time</tool_call>")
    assert calls_of("glm47", text, WEATHER_TOOLS) == (None, [("get_weather", {"city": "Oslo", "days": 3}),
                                                             ("get_time", {})])
    check_every_cut("glm47", text, WEATHER_TOOLS)
    # a value keeps a literal \n of its own (it is the value's text)
    assert calls_of("glm47", glm47_call("f", {"s": "a\\nb"}), TYPED) == (None, [("f", {"s": "a\\nb"})])
    # GLM-4.5's format reads as well; glm45 keeps vLLM's glm45 rule: a literal \n is no blank there
    assert calls_of("glm47", glm_call("get_weather", {"city": "Paris"}), WEATHER_TOOLS)[1] == [
        ("get_weather", {"city": "Paris"})]
    literal = glm47_call("get_weather", {"city": "Paris"}, "\\n")
    assert calls_of("glm45", literal, WEATHER_TOOLS) == (literal, [])


@pytest.mark.parametrize("text", [
    "<tool_call>get_weather<arg_key>city</arg_key>\\t<arg_value>Paris</arg_value></tool_call>",  # \t is no blank
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>\\</tool_call>",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Par",  # cut short
    "<tool_call>\\n</tool_call>",  # no name
    "<tool_call>get weather</tool_call>",
    "<tool_call>get_weather<arg_value>Paris</arg_value></tool_call>",  # no key
])
def test_glm47_malformed_calls_are_content(text):
    result = get_tool_parser("glm47")(tools=WEATHER_TOOLS).extract(text)
    assert result.tool_calls == [] and result.content == (text.strip() or None), text
    check_every_cut("glm47", text, WEATHER_TOOLS)


# ---- through the serving layer's hooks -----------------------------------------------------------


def _request(tool_choice, tools=WEATHER_TOOLS):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": tool_choice})


REPLIES = {
    **{name: "Checking. " + section(name, ("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}"))
       for name in SECTIONS},
    "glm45": "Checking. " + glm_call("get_weather", {"city": "Paris", "days": "2"}) + glm_call("get_time", {}),
    "glm47": "Checking. " + glm47_call("get_weather", {"city": "Paris", "days": "2"}, "\\n") + "<tool_call>get_time</tool_call>",
}


@pytest.mark.parametrize("name", list(REPLIES))
def test_through_the_tool_hooks(name):
    req = _request("auto")
    content, calls = parse_tool_calls(REPLIES[name], req, name)
    assert content == "Checking."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    for size in (1, 4, 1000):
        stream = ToolStream(req, name)
        s_content, s_calls = "", {}
        text = REPLIES[name]
        for i in range(0, len(text), size):
            delta = stream.step(text[i : i + size], i + size >= len(text)) or {}
            s_content += delta.get("content", "")
            for tc in delta.get("tool_calls", []):
                entry = s_calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc["function"].get("name", "")
                entry[1] += tc["function"]["arguments"]
        assert stream.tools_called and s_content.strip() == content
        assert [tuple(s_calls[i]) for i in sorted(s_calls)] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]
    # the markers are kept in the reply's text where the tokenizer may count them special
    assert needs_special_tokens(req, name) == (name not in ("glm45", "glm47"))
    # the parser follows the chat template when none is named
    template = {"deepseek_v3": "'<｜tool▁calls▁begin｜>' '```json'", "deepseek_v31": "'<｜tool▁calls▁begin｜>'",
                "kimi_k2": "<|tool_calls_section_begin|>", "glm45": "<tool_call>{{ n }}<arg_key>",
                "glm47": "<tool_call>{{ n }}<arg_key>{{ k }}</arg_key><arg_value>"}[name]
    by_template = parse_tool_calls(REPLIES[name], req, None, template=template)
    assert by_template[0] == content and [c["function"] for c in by_template[1] or []] == [c["function"] for c in calls]


@pytest.mark.parametrize("name", list(REPLIES))
def test_named_and_required_tool_choice_as_for_every_parser(name):
    """A named tool_choice constrains the reply to that function's arguments object and a required one to
    ferrox's Hermes <tool_call> blocks, whatever --tool-call-parser says (as for the other parsers); the
    family's own format is read under "auto" only, and nothing needs special tokens then."""
    named = _request({"type": "function", "function": {"name": "get_weather"}})
    content, calls = parse_tool_calls('{"city": "Oslo"}', named, name)
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Oslo"}')]
    required = _request("required")
    hermes = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(hermes, required, name)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_time", "{}")]
    assert not needs_special_tokens(required, name) and not needs_special_tokens(named, name)
    assert parse_tool_calls(REPLIES[name], _request("none"), name) == (REPLIES[name], None)


# ---- the glm45 reasoning parser ------------------------------------------------------------------

GLM_VOCAB = {"<think>": 10, "</think>": 11, "<|assistant|>": 12}


def test_glm45_reasoning_reads_as_qwen3_with_the_turn_boundary():
    glm = get_reasoning_parser("glm45", GLM_VOCAB.get)
    assert glm.split("<think>weigh it</think>Yes.") == ("weigh it", "Yes.")
    assert glm.split("\n<think>cut short") == ("cut short", None)
    assert not glm.thinks({"enable_thinking": False}) and glm.thinks({}) and glm.thinks(None)
    assert glm.split("the answer", thinking=False) == (None, "the answer")
    # an earlier assistant turn's empty think block does not close this turn's thinking
    assert not glm.prompt_ends_reasoning([5, 12, 10, 11, 7, 6, 12])
    assert glm.prompt_ends_reasoning([5, 12, 10, 11, 7, 6, 12, 10, 11])  # enable_thinking false: closed
    qwen = get_reasoning_parser("qwen3", GLM_VOCAB.get)
    assert qwen.prompt_ends_reasoning([5, 12, 10, 11, 7, 6, 12])  # qwen3 has no such boundary
    # a tokenizer without <|assistant|> still serves (the prompt is read back to its last tag)
    assert get_reasoning_parser("glm45", {"<think>": 1, "</think>": 2}.get).prompt_ends_reasoning([1, 2])
    with pytest.raises(ValueError, match="glm45"):
        get_reasoning_parser("glm45", {}.get)
