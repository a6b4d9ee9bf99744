"""Gemma 4's `gemma4` tool parser (vLLM's name): FunctionGemma's call syntax with Gemma 4's special tokens
(`<|tool_call>`, `<tool_call|>`, `<|"|>`), values typed by how they are written as vLLM's parser types them, text
that is no call staying content, and streamed deltas -- cut at every character, around the format's tokens as a
tokenizer would, and at random -- giving exactly what extract gives; then through the chat route's tool hooks and
the template that picks the parser."""

from __future__ import annotations

import json
import random
import re

from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from ferrox.entrypoints.openai.tool_parsers.gemma4 import bare_value
from ferrox.entrypoints.openai.tools import ToolStream, needs_special_tokens, parse_tool_calls

from .test_tool_parsers import reassemble

NAME = "gemma4"
BEGIN, END, Q = "<|tool_call>", "<tool_call|>", '<|"|>'
TOKENS = re.compile(r'<\|tool_call>|<tool_call\|>|<\|"\|>|<\|tool_response>')
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
# The tool-call part of vLLM's examples/tool_chat_template_gemma4.jinja (an assistant turn's calls written back).
TEMPLATE = ("{%- for tool_call in message['tool_calls'] -%}{%- set function = tool_call['function'] -%}"
            "{{- '<|tool_call>call:' + function['name'] + '{' -}}{{- format_arguments(function['arguments']) -}}"
            "{{- '}<tool_call|>' -}}{%- endfor -%}")


def call(name: str, body: str) -> str:
    return f"{BEGIN}call:{name}{{{body}}}{END}"


def s(text: str) -> str:
    return Q + text + Q


WEATHER = call("get_weather", f"city:{s('São Paulo, BR')},days:3,units:{{temp:{s('C')},wind:None}},"
                              f"alerts:true,hours:[1,2.5,{s('x')},[{s('y')}]],scale:-1.5,small:1e-05,"
                              f"zip:{s('01000')},n:{s('42')}")
WEATHER_ARGS = {"city": "São Paulo, BR", "days": 3, "units": {"temp": "C", "wind": None}, "alerts": True,
                "hours": [1, 2.5, "x", ["y"]], "scale": -1.5, "small": 1e-05, "zip": "01000", "n": "42"}
REPLY = "Let me look that up.\n" + WEATHER + call("get_time", "")


def token_cuts(text: str, seed: int) -> list[int]:
    """Chunk sizes that keep each special token whole and cut the text between at random (a tokenizer's view)."""
    rng, sizes, pos = random.Random(seed), [], 0
    for m in TOKENS.finditer(text):
        while pos < m.start():
            sizes.append(min(rng.randint(1, 4), m.start() - pos))
            pos += sizes[-1]
        sizes.append(m.end() - m.start())
        pos = m.end()
    while pos < len(text):
        sizes.append(min(rng.randint(1, 4), len(text) - pos))
        pos += sizes[-1]
    return sizes or [1]


def check_every_cut(text: str, tools=TOOLS) -> None:
    """Streaming text cut in two at every character, one character at a time, at token-like cuts and at random
    gives extract's content and calls (each call's id and name first, then its arguments' pieces)."""
    whole = get_tool_parser(NAME)(tools=tools).extract(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    cuts = [[i, len(text) - i] for i in range(len(text) + 1)] + [[1] * len(text)]
    cuts += [token_cuts(text, seed) for seed in range(3)]
    cuts += [[random.Random(seed).randint(1, 12) for _ in range(len(text))] for seed in range(3)]
    for chunks in cuts:
        parser = get_tool_parser(NAME)(tools=tools)
        content, calls = reassemble(parser, text, [c for c in chunks if c] or [1], id_prefix="call_")
        assert (content.strip() or None) == whole.content, (text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, (text, chunks)
        assert parser.tools_called == bool(expected)


def calls_of(text: str, tools=TOOLS) -> tuple[str | None, list[tuple[str, object]]]:
    result = get_tool_parser(NAME)(tools=tools).extract(text)
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


# ---- names and the template's default ----------------------------------------------------------------------

def test_registered_keeps_special_tokens_and_is_picked_by_the_template():
    assert NAME in TOOL_PARSERS and get_tool_parser(NAME).needs_special_tokens
    assert default_tool_parser(TEMPLATE) == NAME
    # FunctionGemma's markers still pick its own parser; Granite's <|tool_call|> is not Gemma 4's <|tool_call>
    assert default_tool_parser("{{ '<start_function_call>call:' }}") == "functiongemma"
    assert default_tool_parser("{{ '<|tool_call|>' }}[") == "granite"


# ---- whole replies -----------------------------------------------------------------------------------------

def test_several_calls_typed_as_written_and_text_before():
    result = get_tool_parser(NAME)(tools=TOOLS).extract(REPLY)
    assert result.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", WEATHER_ARGS), ("get_time", {})]
    # json.dumps of the values, keys in the order written, non-ASCII as is
    assert result.tool_calls[0].arguments == json.dumps(WEATHER_ARGS, ensure_ascii=False)
    assert result.tool_calls[1].arguments == "{}"
    ids = [c.id for c in result.tool_calls]
    assert all(i.startswith("call_") for i in ids) and ids[0] != ids[1]
    check_every_cut(REPLY)


def test_quoted_strings_stay_strings_with_their_text_verbatim():
    code = 'def f(x):\n    return {"a": [x, 1]}, "b:c\\n" + \'<p>\''
    obj = '{"k": 1}'
    text = call("write", f"path:{s(' a.py ')},code:{s(code)},{s('odd key')}:{s('')},json:{s(obj)},"
                         f"flag:{s('true')},nested:" + "{deep:{list:[{k:" + s("v,}]") + "},[]]}},empty:{}")
    assert calls_of(text)[1] == [("write", {"path": " a.py ", "code": code, "odd key": "", "json": '{"k": 1}',
                                            "flag": "true", "nested": {"deep": {"list": [{"k": "v,}]"}, []]}},
                                            "empty": {}})]
    check_every_cut(text)
    # the tools' schema plays no part (vLLM's gemma4 types by syntax): `days` stays the string written
    assert calls_of(call("get_weather", f"days:{s('5')},zip:75001"))[1] == [
        ("get_weather", {"days": "5", "zip": 75001})]


def test_bare_values_as_vllm_types_them():
    assert [bare_value(t) for t in ("true", "false", "null", "None", "NIL", "42", "-7", "2.50", "1.", "1e-05")] == [
        True, False, None, None, None, 42, -7, 2.5, 1.0, 1e-05]
    # other bare text is a string, and so are floats JSON cannot write
    assert [bare_value(t) for t in ("True", "10:30", "nan", "inf", "1e999", "0x1f", "Paris")] == [
        "True", "10:30", "nan", "inf", "1e999", "0x1f", "Paris"]
    assert calls_of(call("f", "when:10:30,x:NaN,y:[true,false,null,3]"))[1] == [
        ("f", {"when": "10:30", "x": "NaN", "y": [True, False, None, 3]})]


def test_text_between_and_after_calls_stays_content():
    text = "First. " + call("get_time", "") + " Then. " + call("get_weather", f"city:{s('Oslo')}") + "\nDone."
    assert calls_of(text) == ("First.  Then. \nDone.", [("get_time", {}), ("get_weather", {"city": "Oslo"})])
    spaced = f"{BEGIN}\ncall:get_time{{ }}\n{END}\n{BEGIN}call:get_weather{{ city : {s('Rome')} , days: 2 }}{END}\n"
    assert calls_of(spaced) == (None, [("get_time", {}), ("get_weather", {"city": "Rome", "days": 2})])
    check_every_cut(text)
    check_every_cut(spaced)


def test_repeated_key_keeps_its_first_value():
    text = call("get_weather", f"city:{s('Rome')},city:{s('Milan')},days:2")
    assert calls_of(text)[1] == [("get_weather", {"city": "Rome", "days": 2})]
    check_every_cut(text)


# ---- text that is no call, broken calls, replies cut short -------------------------------------------------

def test_text_that_opens_no_call_stays_content():
    for text in (
        "Just an answer, no calls.",
        f"{BEGIN}get_weather{{city:{s('Paris')}}}{END} after",  # no `call:`
        f"{BEGIN}call:get weather{{}}{END}",  # a blank in the name
        f"{BEGIN}call:{{}}{END}",  # no name
        f"Wait {BEGIN}call:get_wea",  # the header cut short
        f"Wait {BEGIN}",
        "Ends in a marker's start <|tool_ca",
        'A quote token alone <|"|> is text',
    ):
        assert calls_of(text) == (text.strip(), []), text
        check_every_cut(text)
    text = f"{BEGIN}oops {call('get_time', '')}"
    assert calls_of(text) == (f"{BEGIN}oops", [("get_time", {})])
    check_every_cut(text)


def test_a_member_that_does_not_read_ends_the_call_and_the_rest_of_it_is_dropped():
    text = call("get_weather", f"city:{s('Rome')},days:{s('2')} zip:1,more:2") + " Next. " + call("get_time", "")
    assert calls_of(text) == ("Next.", [("get_weather", {"city": "Rome"}), ("get_time", {})])
    check_every_cut(text)
    for body in ("a:[1,2", "a:{b:1]", "a:", ":1", "{a:1}", f"a:{s('x')}y", "a:b<c"):
        assert calls_of(call("f", body) + " tail") == ("tail", [("f", {})]), body
    text = f"{BEGIN}call:f{{a:1,b:2{END} tail {BEGIN}call:g{{x:1,{call('h', 'y:2')}"
    assert calls_of(text) == ("tail", [("f", {"a": 1}), ("g", {"x": 1}), ("h", {"y": 2})])
    check_every_cut(text)


def test_a_reply_cut_short_keeps_the_members_that_stood():
    text = f"Sure. {BEGIN}call:get_weather{{city:{s('Rome')},days:3,zip:{Q}00"
    assert calls_of(text) == ("Sure.", [("get_weather", {"city": "Rome", "days": 3})])
    check_every_cut(text)
    assert calls_of(f"{BEGIN}call:get_time{{}} then text") == ("then text", [("get_time", {})])


def test_streaming_sends_the_name_first_then_each_member_as_it_stands():
    parser = get_tool_parser(NAME)(tools=TOOLS)
    assert parser.feed("Hi <|tool").content == "Hi "
    first = parser.feed("_call>call:get_weather{")
    assert [(d.name, d.arguments) for d in first.tool_calls] == [("get_weather", "{")] and first.tool_calls[0].id
    assert not parser.feed(f"city:{Q}Ro").tool_calls  # a value goes out once its member stands
    assert not parser.feed(f"me, it{Q}").tool_calls
    assert [d.arguments for d in parser.feed(",days:").tool_calls] == ['"city": "Rome, it"']
    assert [d.arguments for d in parser.feed("3}").tool_calls] == [', "days": 3}']
    assert not parser.feed(END) and not parser.finish() and parser.tools_called


# ---- through the chat route's tool hooks -------------------------------------------------------------------

def _request(tool_choice="auto"):
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": tool_choice})


def test_through_the_tool_hooks_named_or_picked_by_the_template():
    req = _request()
    for parser, template in ((NAME, None), (None, TEMPLATE)):
        content, calls = parse_tool_calls(REPLY, req, parser, template=template)
        assert content == "Let me look that up."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", WEATHER_ARGS), ("get_time", {})]
        stream, s_content, s_calls = ToolStream(req, parser, template=template), "", {}
        for i in range(0, len(REPLY), 5):
            delta = stream.step(REPLY[i : i + 5], i + 5 >= len(REPLY)) or {}
            s_content += delta.get("content", "")
            for tc in delta.get("tool_calls", []):
                entry = s_calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc["function"].get("name", "")
                entry[1] += tc["function"].get("arguments", "")
        assert stream.tools_called and s_content.strip() == content
        assert [tuple(s_calls[i]) for i in sorted(s_calls)] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]
        assert needs_special_tokens(req, parser, template)
    assert not needs_special_tokens(_request("required"), NAME)
    assert parse_tool_calls(REPLY, _request("none"), NAME) == (REPLY, None)
