"""MiniMax-M2's `minimax_m2` tool parser and the `minimax_m2` / `minimax_m2_append_think` reasoning parsers (vLLM's
names): calls read whole, typed by the request's tools, text that is no call staying content, and streamed
deltas -- cut at every character, around the format's tags as a tokenizer would, and at random -- giving
exactly what extract gives; then the two parsers together, as the chat route runs them."""

from __future__ import annotations

import json
import random
import re

import pytest
from ferrox.config import REASONING_PARSER_CHOICES
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from ferrox.entrypoints.openai.tool_parsers.minimax_m2 import convert_value
from ferrox.entrypoints.openai.tools import ToolStream, needs_special_tokens, parse_tool_calls
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser
from ferrox.reasoning.plugin import BUILT_IN

from .test_tool_parsers import reassemble

NAME = "minimax_m2"
BEGIN, END = "<minimax:tool_call>", "</minimax:tool_call>"
TAGS = re.compile(r"<minimax:tool_call>|</minimax:tool_call>|<invoke name=|</invoke>|<parameter name=|</parameter>")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"},
        "alerts": {"type": "boolean"}, "hours": {"type": "array"}, "scale": {"type": "number"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
# The template's tool-call part, as MiniMax-M2's chat template writes an assistant turn's calls back.
TEMPLATE = ("{%- for tool_call in message.tool_calls -%}<minimax:tool_call>\n<invoke name=\"{{ tool_call.name }}\">"
            "{% for k, v in tool_call.arguments.items() %}<parameter name=\"{{ k }}\">{{ v }}</parameter>\n"
            "{% endfor %}</invoke>\n</minimax:tool_call>{% endfor %}")


def invoke(name: str, params: dict[str, str], quote: str = '"') -> str:
    body = "".join(f"<parameter name={quote}{k}{quote}>{v}</parameter>\n" for k, v in params.items())
    return f"<invoke name={quote}{name}{quote}>\n{body}</invoke>\n"


def block(*invokes: str) -> str:
    return BEGIN + "\n" + "".join(invokes) + END


WEATHER = invoke("get_weather", {"city": "São Paulo", "days": "\n3\n", "units": ' {"temp": "C"} ',
                                 "alerts": "yes", "hours": "[1, 2]", "scale": "2.50", "note": "null"})
WEATHER_ARGS = {"city": "São Paulo", "days": 3, "units": {"temp": "C"}, "alerts": True, "hours": [1, 2],
                "scale": 2.5, "note": None}
REPLY = "Let me look that up.\n\n" + block(WEATHER, invoke("get_time", {}, quote=""))


def token_cuts(text: str, seed: int) -> list[int]:
    """Chunk sizes that keep each tag whole and cut the text between at random (a tokenizer's view)."""
    rng, sizes, pos = random.Random(seed), [], 0
    for m in TAGS.finditer(text):
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

def test_registered_and_picked_by_the_template():
    assert NAME in TOOL_PARSERS and not get_tool_parser(NAME).needs_special_tokens
    assert default_tool_parser(TEMPLATE) == NAME
    # MiniMax's tools prompt spells the format out too
    assert default_tool_parser("use XML format:\n<minimax:tool_call>\n<invoke name=\"tool-name-1\">") == NAME
    # the other formats with XML-ish parameters keep their parsers
    assert default_tool_parser("<tool_call>\n<function=example>\n<parameter=x>") == "qwen3_coder"
    assert default_tool_parser("<tool_call>{{ tool_call|tojson }}</tool_call>") == "hermes"


# ---- whole replies -----------------------------------------------------------------------------------------

def test_several_invokes_typed_by_the_tools_with_text_before():
    result = get_tool_parser(NAME)(tools=TOOLS).extract(REPLY)
    assert result.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", WEATHER_ARGS), ("get_time", {})]
    # the arguments are json.dumps of the values, keys in the order written, non-ASCII as is
    assert result.tool_calls[0].arguments == json.dumps(WEATHER_ARGS, ensure_ascii=False)
    assert result.tool_calls[1].arguments == "{}"
    ids = [c.id for c in result.tool_calls]
    assert all(i.startswith("call_") for i in ids) and ids[0] != ids[1]
    check_every_cut(REPLY)


def test_several_blocks_and_text_between_and_after():
    text = "First. " + block(invoke("get_time", {})) + " Then. " + block(invoke("get_weather", {"city": "Oslo"}))
    text += "\nDone."
    assert calls_of(text) == ("First.  Then. \nDone.", [("get_time", {}), ("get_weather", {"city": "Oslo"})])
    check_every_cut(text)
    # without the tools, a parameter the schema does not describe keeps its text (vLLM: a string)
    assert calls_of(block(invoke("get_weather", {"days": "3", "units": "{}"})), tools=None)[1] == [
        ("get_weather", {"days": "3", "units": "{}"})]


def test_values_are_stripped_and_keep_their_inner_text():
    code = "\ndef f(x):\n    return x < 1 and '</inv'\n\n"
    text = block(invoke("write", {"path": "  a.py ", "code": code, "empty": "  "}))
    assert calls_of(text)[1] == [("write", {"path": "a.py", "code": code.strip(), "empty": ""})]
    check_every_cut(text)


def test_repeated_key_keeps_its_first_value_and_names_may_be_single_quoted():
    text = BEGIN + "<invoke name='get_weather'><parameter name='city'>Rome</parameter>" \
        "<parameter name=\"city\">Milan</parameter><parameter name=days>2</parameter></invoke>" + END
    assert calls_of(text)[1] == [("get_weather", {"city": "Rome", "days": 2})]
    check_every_cut(text)


@pytest.mark.parametrize(("text", "schema", "expected"), [
    ("Paris", {"type": "string"}, "Paris"),
    ("42", {"type": "string"}, "42"),
    ("42", {"type": "integer"}, 42),
    ("-7", {"type": "int"}, -7),
    ("4.0", {"type": "number"}, 4),
    ("2.5", {"type": "number"}, 2.5),
    ("1e400", {"type": "number"}, float("inf")),  # not finite: the fallback's JSON reads it (the arguments keep the text)
    ("many", {"type": "integer"}, "many"),
    ("true", {"type": "boolean"}, True),
    ("On", {"type": "boolean"}, True),
    ("0", {"type": "boolean"}, False),
    ("no", {"type": "bool"}, False),
    ("maybe", {"type": "boolean"}, "maybe"),
    ('{"a": [1, null]}', {"type": "object"}, {"a": [1, None]}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("[1, 2", {"type": "array"}, "[1, 2"),
    ("null", {"type": "integer"}, None),
    ("None", None, None),
    ("NIL", {"type": ["string", "null"]}, None),
    ("null", {"type": "string"}, "null"),  # a string-only parameter keeps its text (ferrox; vLLM gives null)
    ("42", {"type": ["string", "integer"]}, 42),  # integer is tried before string, whatever the order
    ("42", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, 42),
    ("7", {"oneOf": [{"type": "null"}, {"type": "number"}]}, 7),
    ("x", {"allOf": [{"type": "integer"}, {}]}, "x"),  # a choice that says nothing is a string
    ("2", {"enum": [1, 2, 3]}, 2),
    ("2", {"enum": ["1", "2"]}, "2"),
    ("true", {"enum": [True, "auto"]}, True),
    ("[1]", {}, "[1]"),  # a schema without a type: string
    ("[1]", {"type": "uuid"}, [1]),  # a type vLLM does not know: JSON when it parses
    ("abc", {"type": "uuid"}, "abc"),
])
def test_convert_value_follows_vllms_rules(text, schema, expected):
    assert convert_value(text, schema) == expected


def test_values_json_cannot_hold_stay_text():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "big": {"type": "number"}, "nan": {"type": "number"}}}}}]
    text = block(invoke("f", {"big": "1e400", "nan": "NaN"}))
    (call,) = get_tool_parser(NAME)(tools=tools).extract(text).tool_calls
    assert call.arguments == '{"big": "1e400", "nan": "NaN"}'


@pytest.mark.parametrize("text", [
    BEGIN,
    "Hi " + BEGIN + "just text" + END + " bye",
    BEGIN + END,
    BEGIN + '\n<invoke name="two words">\n</invoke>\n' + END,
    BEGIN + '<invoke name="">\n</invoke>' + END,
    BEGIN + '<invoke name="get_weather"\n<parameter name="city">Paris</parameter></invoke>' + END,
    BEGIN + '<invoke name="get_<weather">' + END,
    "Cut short: " + BEGIN + "\n<invo",
    "Cut short: " + BEGIN + '\n<invoke name="get_wea',
    "A marker's start at the end <minimax:tool_cal",
    '<invoke name="get_weather"><parameter name="city">Paris</parameter></invoke>',  # no block
    "<minimax:tool_call > " + invoke("get_time", {}),  # not the marker
])
def test_malformed_and_partial_blocks_are_content(text):
    result = get_tool_parser(NAME)(tools=TOOLS).extract(text)
    assert result.tool_calls == [] and result.content == (text.strip() or None), text
    check_every_cut(text)


def test_a_reply_cut_short_after_a_header_keeps_the_call_and_its_complete_parameters():
    text = "Sure. " + BEGIN + '\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n' \
        '<parameter name="days">3'
    assert calls_of(text) == ("Sure.", [("get_weather", {"city": "Paris"})])
    check_every_cut(text)
    # a block that is not closed after its calls: the calls stand; other text after them is content
    text = block(invoke("get_time", {}))[: -len(END)] + "and then some words"
    assert calls_of(text) == ("and then some words", [("get_time", {})])
    check_every_cut(text)


def test_a_parameter_the_invoke_ends_inside_is_dropped_and_stray_text_skipped():
    text = BEGIN + '<invoke name="get_weather"><parameter name="days">3</invoke>\n' \
        + invoke("get_weather", {"city": "Oslo"}) + END
    assert calls_of(text)[1] == [("get_weather", {}), ("get_weather", {"city": "Oslo"})]
    check_every_cut(text)
    # text inside an invoke that is no tag is skipped, as vLLM reads only the tags
    text = BEGIN + '<invoke name="get_weather">\nnoise <b>bold</b>\n<parameter name="city">Oslo</parameter>' \
        'more <parameter name=<x>>\n</invoke>' + END
    assert calls_of(text)[1] == [("get_weather", {"city": "Oslo"})]
    check_every_cut(text)


PIECES = [BEGIN, END, "<invoke name=", '"get_weather">', "'get_time'>", "f>", "</invoke>", '<parameter name="city">',
          "<parameter name=days>", "</parameter>", "<minimax:tool", "</inv", "</param", "<parameter name=", "<",
          ">", '"', "\n", " ", "Paris", "3", "null", '{"a": 1}', "text", "<b>", "</minimax:tool_call"]


@pytest.mark.parametrize("seed", range(3))
def test_random_texts_stream_as_they_extract(seed):
    """Texts strung together from the format's pieces (whole, broken and out of order) stream, in random
    chunks, to what extract gives."""
    rng = random.Random(seed)
    for _ in range(60):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
        whole = get_tool_parser(NAME)(tools=TOOLS).extract(text)
        for chunks in ([1] * len(text), [rng.randint(1, 6) for _ in range(len(text))]):
            parser = get_tool_parser(NAME)(tools=TOOLS)
            content, calls = reassemble(parser, text, chunks, id_prefix="call_")
            assert (content.strip() or None) == whole.content, (text, chunks)
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in whole.tool_calls], (text, chunks)
        for call in whole.tool_calls:
            assert isinstance(json.loads(call.arguments), dict)


def test_streaming_sends_the_name_first_then_each_parameter():
    parser = get_tool_parser(NAME)(tools=TOOLS)
    assert parser.feed("Checking.\n" + BEGIN[:8]).content == "Checking.\n"  # the marker's start is held back
    head = parser.feed(BEGIN[8:] + '\n<invoke name="get_weather">\n<parameter name="city">Par')
    assert head.content is None and [(d.index, d.name, d.arguments) for d in head.tool_calls] == [
        (0, "get_weather", "{")]
    assert head.tool_calls[0].id.startswith("call_") and parser.tools_called
    assert not parser.feed("is").tool_calls  # a value goes out once complete
    (city,) = parser.feed("</parameter>\n<parameter name=\"days\">2</parameter>").tool_calls
    assert (city.index, city.id, city.name, city.arguments) == (0, None, None, '"city": "Paris", "days": 2')
    (close,) = parser.feed("\n</invoke>").tool_calls
    assert close.arguments == "}"
    (second,) = parser.feed('<invoke name="get_time"></invoke>\n' + END).tool_calls
    assert (second.index, second.name, second.arguments) == (1, "get_time", "{}")
    assert not parser.finish()


# ---- through the serving layer's hooks ------------------------------------------------------------------

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
        assert not needs_special_tokens(req, parser, template)
    assert parse_tool_calls(REPLY, _request("none"), NAME) == (REPLY, None)


# ---- the reasoning parsers -----------------------------------------------------------------------------

VOCAB = {"<think>": 10, "</think>": 11}
THINK, UNTHINK = 10, 11


def reasoning(name: str = "minimax_m2"):
    return get_reasoning_parser(name, VOCAB.get)


def test_reasoning_names():
    for name in ("minimax_m2", "minimax_m2_append_think"):
        assert name in REASONING_PARSERS and name in BUILT_IN and name in REASONING_PARSER_CHOICES
    assert reasoning("minimax_m2_append_think").family.inline and not reasoning().family.inline
    with pytest.raises(ValueError, match="reasoning_parser: 'minimax_m2' needs <think> and </think>"):
        get_reasoning_parser("minimax_m2", {}.get)


def _streamed(p, text: str, deltas: list[str], thinking: bool = True) -> tuple[str | None, str | None]:
    stream = p.stream(thinking)
    parts = [stream.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
    return "".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None


def _cuts(text: str) -> list[list[str]]:
    return [list(text)] + [[text[:a], text[a:]] for a in range(len(text) + 1)]


@pytest.mark.parametrize(("text", "expected"), [
    ("Paris is the capital.\n</think>\n\nParis.", ("Paris is the capital.\n", "\n\nParis.")),
    ("cut short while thinking", ("cut short while thinking", None)),  # no </think>: all thinking
    ("\n<think>opened by the model</think>Yes.", ("opened by the model", "Yes.")),
    ("</think>", (None, None)),
])
def test_minimax_m2_reads_the_output_as_thinking_up_to_the_end_tag(text, expected):
    p = reasoning()
    assert p.split(text) == expected
    for deltas in _cuts(text):
        assert _streamed(p, text, deltas) == expected, deltas
    assert p.thinks(None) and p.thinks({"enable_thinking": False})  # no switch: MiniMax-M2 always thinks
    assert p.split(text, thinking=False) == (None, text)  # a prompt that closed the thinking: all answer


def test_minimax_m2_prompt_rule_and_token_count():
    p = reasoning()
    # MiniMax-M2's template ends the prompt with `]~b]ai\n<think>\n`; an earlier turn's think block is closed
    assert not p.prompt_ends_reasoning([1, THINK, 2, UNTHINK, 3, THINK, 4])
    assert p.prompt_ends_reasoning([1, THINK, 2, UNTHINK, 3])
    assert p.count_reasoning_tokens([5, 6, 7, UNTHINK, 8, 9]) == 3
    assert p.count_reasoning_tokens([5, 6], thinking=False) == 0


@pytest.mark.parametrize("text", ["weigh it\n</think>\n\nThe answer.", "cut short", ""])
def test_append_think_keeps_everything_in_the_content_after_a_think_tag(text):
    p = reasoning("minimax_m2_append_think")
    expected = (None, "<think>" + text)  # vLLM's minimax_m2_append_think
    assert p.split(text) == expected
    for deltas in _cuts(text) if text else [[""]]:
        assert _streamed(p, text, deltas) == expected, deltas
    # the prompt closed the thinking: no tag to add
    assert p.split(text, thinking=False) == (None, text or None)
    # the tags still count the thinking and end it for the engine
    assert p.count_reasoning_tokens([5, 6, UNTHINK, 7]) == 2
    assert not p.prompt_ends_reasoning([1, THINK]) and p.end_token_id == UNTHINK


CALLS = block(invoke("get_weather", {"city": "São Paulo", "days": "2"}), invoke("get_time", {}))
EXPECTED_CALLS = [("get_weather", {"city": "São Paulo", "days": 2}), ("get_time", {})]


def _through_both_parsers(p, text: str, deltas: list[str]):
    """A reply streamed as the chat route does: the reasoning stream first, its content into a ToolStream; it
    must give what the two give on the whole reply."""
    request = _request()
    stream, tools = p.stream(True), ToolStream(request, NAME)
    thought, content, calls = "", "", {}
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        r, c = stream.feed(delta, finished=last)
        thought += r
        for out in (tools.feed(c) if c else None, tools.finish() if last else None):
            content += (out or {}).get("content", "")
            for tc in (out or {}).get("tool_calls", []):
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc["function"].get("name", "")
                entry[1] += tc["function"].get("arguments", "")
    whole_reasoning, whole_content = p.split(text)
    whole_text, whole_calls = parse_tool_calls(whole_content or "", request, NAME)
    whole_text = whole_text or None
    assert (thought or None) == whole_reasoning, deltas
    assert (content.strip() or None) == whole_text, deltas
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls or []], deltas
    return whole_reasoning, whole_text, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                         for c in whole_calls or []]


def test_calls_read_from_the_answer_at_every_cut():
    text = "The user wants the weather.\n</think>\n\n" + CALLS
    for deltas in _cuts(text):
        assert _through_both_parsers(reasoning(), text, deltas) == (
            "The user wants the weather.\n", None, EXPECTED_CALLS)
    # a block written while still thinking is thinking (vLLM's parser waits for </think>)
    text = "Maybe " + CALLS
    assert _through_both_parsers(reasoning(), text, [text]) == (text, None, [])
    # append_think: the thinking is content, before the calls
    text = "Weather.\n</think>\n" + CALLS
    for deltas in [[text], list(text), [text[:30], text[30:]]]:
        assert _through_both_parsers(reasoning("minimax_m2_append_think"), text, deltas) == (
            None, "<think>Weather.\n</think>", EXPECTED_CALLS)
