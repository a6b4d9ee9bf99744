"""The JSON-list tool parsers (granite, granite-20b-fc, phi4_mini_json, xlam): whole-text extraction,
text that is no call staying content, and streamed deltas (every split, any chunking) reassembling
to exactly what extract gives."""

from __future__ import annotations

import json
import random

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    default_tool_parser,
    get_tool_parser,
    json_scan,
)
from ferrox.entrypoints.openai.tools import ToolStream, needs_special_tokens, parse_tool_calls

from .test_tool_parsers import reassemble
from .test_tool_parsers_more import assert_content_only, check_stream_equals_extract

NAMES = ["granite", "granite-20b-fc", "phi4_mini_json", "xlam"]


def calls_of(name: str, text: str) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in get_tool_parser(name)().extract(text).tool_calls]


def check_every_split(name: str, text: str) -> None:
    """Two deltas, cut at every place (so a marker, a name or an escape arrives in two pieces), and
    one character at a time: the same content and calls as extract, the name in each call's first delta."""
    whole = get_tool_parser(name)().extract(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    for chunks in [[cut, len(text) - cut] for cut in range(1, len(text))] + [[1] * len(text)]:
        parser = get_tool_parser(name)()
        content, calls = reassemble(parser, text, chunks, id_prefix="call_")
        assert (content.strip() or None) == whole.content, (text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, (text, chunks)
        assert parser.tools_called == bool(expected)


def test_registered_and_refused_names():
    for name in NAMES:
        assert name in TOOL_PARSERS
        assert not get_tool_parser(name).needs_special_tokens  # Granite's <|tool_call|> may be skipped
    with pytest.raises(ValueError, match="tool_call_parser"):
        get_tool_parser("granite_20b_fc")  # vLLM's name has hyphens


GRANITE_3_TEMPLATE = (  # the part of Granite 3.x's template that renders a call
    "{%- elif message['role'] == 'assistant_tool_call' %}"
    "{{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\\n' }}"
)
GRANITE_4_TEMPLATE = (  # Hermes-style calls, which must stay hermes even if the token is named
    "<|start_of_role|>assistant<|end_of_role|><tool_call>\\n{{ tc | tojson }}\\n</tool_call><|tool_call|>"
)
PHI4_MINI_TEMPLATE = (  # vLLM's examples/tool_chat_template_phi4_mini.jinja, abridged
    "  * prefix function calls with functools marker (no closing marker required)\n"
    '  * all function calls should be generated in a single JSON list formatted as functools[{"name": ...}]'
)
GRANITE_20B_TEMPLATE = "{{ 'SYSTEM: ' + sys_prompt }}\n<|function_call_library|>\n{%- for tool in tools %}"


def test_default_parser_from_template():
    assert default_tool_parser(GRANITE_3_TEMPLATE) == "granite"
    assert default_tool_parser(GRANITE_4_TEMPLATE) == "hermes"
    assert default_tool_parser(PHI4_MINI_TEMPLATE) == "phi4_mini_json"
    assert default_tool_parser(GRANITE_20B_TEMPLATE) == "granite-20b-fc"
    # the earlier choices are unchanged
    assert default_tool_parser("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert default_tool_parser("<tool_call>\n<function=example>\n<parameter=x>") == "qwen3_coder"
    assert default_tool_parser("<|python_tag|>") == "llama3_json"
    assert default_tool_parser("<tool_call>{{ tool_call|tojson }}</tool_call>") == "hermes"
    assert default_tool_parser("{{ messages }}") == "hermes" and default_tool_parser(None) == "hermes"


# ---- granite -----------------------------------------------------------------------------------

GRANITE_TWO = (
    '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "São Paulo", "note": "a \\"q\\" ]}"}},\n'
    ' {"name": "get_time", "arguments": {}}]'
)
GRANITE_VALID = [
    GRANITE_TWO,
    ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # the token skipped: a bare list
    '<tool_call>[{"name": "f", "parameters": {"x": [1, {"y": null}]}}]</tool_call>',  # Granite 3.1's text marker
    '<|tool_call|> <tool_call> [{"name": "f", "arguments": "{\\"x\\": 1}"}]',  # both; stringified arguments
    'Let me look.\n<|tool_call|>[{"name": "f", "arguments": {"k": "\\u00e9\\n\\ud83d\\ude00"}}] Then more.',
    "The answer is 4.",
    "",
]


def test_granite_extract():
    result = get_tool_parser("granite")().extract(GRANITE_TWO)
    assert result.content is None
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "São Paulo", "note": 'a "q" ]}'}),
        ("get_time", {}),
    ]
    assert "São" in result.tool_calls[0].arguments  # the model's own text, not re-escaped
    assert result.tool_calls[0].id.startswith("call_") and result.tool_calls[0].id != result.tool_calls[1].id
    assert calls_of("granite", GRANITE_VALID[1]) == [("get_weather", {"city": "Paris"})]
    assert calls_of("granite", GRANITE_VALID[2]) == [("f", {"x": [1, {"y": None}]})]
    assert calls_of("granite", GRANITE_VALID[3]) == [("f", {"x": 1})]
    result = get_tool_parser("granite")().extract(GRANITE_VALID[4])
    assert result.content == "Let me look.\n Then more."
    assert json.loads(result.tool_calls[0].arguments) == {"k": "é\n😀"}


@pytest.mark.parametrize(
    "text",
    [
        "[1, 2, 3]",
        "[]",
        "<|tool_call|>[]",
        '[{"name": "Bob", "age": 3}]',  # JSON, but no call: the answer itself
        '[{"name": 7, "arguments": {}}]',
        "<|tool_call|>",
        "<|tool_call|>not json",
        '<|tool_call|>{"name": "f", "arguments": {}}',  # an object: Granite writes a list
        '<|tool_call|>[{"name": "get_wea',  # cut short before the name is complete
        'A list: [{"name": "f", "arguments": {}}]',  # a bare list counts only at the start
        '<|tool_call|>[{"name" "f", "arguments": {}}]',  # not JSON, seen before the name is out
        "[TOOL_CALLS] is not Granite's",
    ],
)
def test_granite_not_a_call_is_content(text):
    assert_content_only("granite", text)


def test_granite_list_stops_at_an_item_that_is_no_call():
    text = '<|tool_call|>[{"name": "f", "arguments": {"a": 1}}, 42, {"name": "g", "arguments": {}}]'
    result = get_tool_parser("granite")().extract(text)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("f", '{"a": 1}')]
    assert result.content == '42, {"name": "g", "arguments": {}}]'
    check_every_split("granite", text)


@pytest.mark.parametrize("text", GRANITE_VALID)
def test_granite_stream_reassembles_to_extract(text):
    check_every_split("granite", text)
    check_stream_equals_extract("granite", text)


def test_granite_stream_sends_name_then_argument_fragments():
    parser = get_tool_parser("granite")()
    assert parser.feed("Sure. <|tool").content == "Sure. "  # the marker's start waits
    d = parser.feed('_call|>[{"name": "get_weather", "argu')
    assert not d  # the name is complete, but {"name": "Bob", ...} could still be an answer
    d = parser.feed('ments": {"city": "Pa')
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("get_weather", '{"city": "Pa')]
    assert d.tool_calls[0].id.startswith("call_") and parser.tools_called
    d = parser.feed('ris"}}, {"name": "get_time", "arguments": {}}]')
    assert [(t.index, t.name, t.arguments) for t in d.tool_calls] == [
        (0, None, 'ris"}'),
        (1, "get_time", "{}"),
    ]
    assert not parser.finish()


def test_granite_bare_json_answer_streams_as_content():
    parser = get_tool_parser("granite")()
    assert not parser.feed('[{"name": "Bob", ')
    assert parser.feed('"age": 3}]').content == '[{"name": "Bob", "age": 3}]'  # closed, and no call
    assert not parser.finish()
    assert not parser.tools_called


@pytest.mark.parametrize(
    ("text", "sent"),
    [
        ('<|tool_call|>[{"name": "f", "arguments": {"a": 1', ("", '{"a": 1')),  # cut short
        ('<|tool_call|>[{"name": "f", "arguments": {"a": tru}}]', ("", '{"a": tru}')),  # json refuses it
        ('<|tool_call|>[{"name": "f", "arguments": {"a": 1} oops', ("oops", '{"a": 1}')),  # the scanner does
    ],
)
def test_granite_stream_cannot_take_back_a_name_sent(text, sent):
    """As hermes and llama3_json: once a call's name went out the stream keeps the call (the text from
    where it broke is content), while extract, which sees the whole object first, finds no call."""
    assert get_tool_parser("granite")().extract(text).content == text
    content, calls = reassemble(get_tool_parser("granite")(), text, [5] * len(text))
    assert (content.strip(), [(c["name"], c["arguments"]) for c in calls]) == (sent[0], [("f", sent[1])])


def test_granite_through_the_tool_hooks():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "auto"}
    )
    assert not needs_special_tokens(req, "granite")
    text = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    content, calls = parse_tool_calls(text, req, None, GRANITE_3_TEMPLATE)  # the template picks granite
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    stream = ToolStream(req, "granite")
    names, arguments = [], ""
    for i in range(0, len(text), 4):
        for tc in (stream.step(text[i : i + 4], i + 4 >= len(text)) or {}).get("tool_calls", []):
            names += [tc["function"]["name"]] if tc["function"].get("name") else []
            arguments += tc["function"]["arguments"]
    assert stream.tools_called and names == ["get_weather"] and arguments == '{"city": "Paris"}'


# ---- granite-20b-fc ----------------------------------------------------------------------------

FC_TWO = (
    'I will call both. <function_call> {"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    '<function_call> {"name": "get_time", "arguments": {"tz": "\\"UTC\\""}}'
)
FC_VALID = [
    FC_TWO,
    '<function_call> {"name": "no_function", "arguments": {}}',
    '<function_call>{"name": "f", "arguments": {"a": [1, 2]}} and a remark',
    "Plain text.",
]


def test_granite_20b_fc_extract():
    result = get_tool_parser("granite-20b-fc")().extract(FC_TWO)
    assert result.content == "I will call both."
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "Zürich"}),
        ("get_time", {"tz": '"UTC"'}),
    ]
    assert calls_of("granite-20b-fc", FC_VALID[1]) == [("no_function", {})]  # as vLLM: a call
    result = get_tool_parser("granite-20b-fc")().extract(FC_VALID[2])
    assert result.content == "and a remark" and [c.name for c in result.tool_calls] == ["f"]


@pytest.mark.parametrize(
    "text",
    [
        "<function_call>",
        "<function_call> I cannot help with that.",
        '<function_call> [{"name": "f", "arguments": {}}]',  # a list: this format writes one object
        '<function_call> {"name": "f"}',  # no arguments
        '<function_call> {"name": "f", "argu',  # cut short before the arguments began
        "Use <function_call> to call.",
    ],
)
def test_granite_20b_fc_not_a_call_is_content(text):
    assert_content_only("granite-20b-fc", text)


@pytest.mark.parametrize("text", FC_VALID)
def test_granite_20b_fc_stream_reassembles_to_extract(text):
    check_every_split("granite-20b-fc", text)


# ---- phi4_mini_json ----------------------------------------------------------------------------

PHI4_TWO = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}, '
    '{"name": "get_time", "parameters": {"zone": "CET\\u00a0"}}]'
)
PHI4_VALID = [
    PHI4_TWO,
    'Checking the weather.\nfunctools [{"name": "f", "arguments": {"matrix": [[1], [2, [3]]]}}]',
    "I used functools.partial here.",
    "No tools needed.",
]


def test_phi4_mini_extract():
    assert calls_of("phi4_mini_json", PHI4_TWO) == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"zone": "CET\u00a0"}),
    ]
    assert get_tool_parser("phi4_mini_json")().extract(PHI4_TWO).content is None
    result = get_tool_parser("phi4_mini_json")().extract(PHI4_VALID[1])
    assert result.content == "Checking the weather."  # vLLM drops it; it is the model's text
    assert json.loads(result.tool_calls[0].arguments) == {
        "matrix": [[1], [2, [3]]]
    }  # nested lists: no cut at "]"


@pytest.mark.parametrize(
    "text",
    [
        "functools",
        "import functools",
        "functools.reduce(f, xs)",
        "functools[]",
        '[{"name": "f", "arguments": {}}]',  # no marker: Phi-4-mini always writes one
        'functools[{"name": "f", "argum',
    ],
)
def test_phi4_mini_not_a_call_is_content(text):
    assert_content_only("phi4_mini_json", text)


@pytest.mark.parametrize("text", PHI4_VALID)
def test_phi4_mini_stream_reassembles_to_extract(text):
    check_every_split("phi4_mini_json", text)


# ---- xlam --------------------------------------------------------------------------------------

XLAM_BARE = '[{"name": "get_weather", "arguments": {"city": "東京"}}, {"name": "get_time", "arguments": {}}]'
XLAM_VALID = [
    XLAM_BARE,
    'I will check.\n```json\n[{"name": "f", "arguments": {"code": "```"}}]\n```\nDone.',
    '```\n[{"name": "f", "arguments": {"a": 1}}]\n```',
    '[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 2}"}]',
    'Ok <tool_call>[{"name": "f", "arguments": {}}]</tool_call>',
    "```python\nprint('[1]')\n```",
    "Just an answer.",
]


def test_xlam_extract():
    result = get_tool_parser("xlam")().extract(XLAM_BARE)
    assert result.content is None
    assert [(c.name, json.loads(c.arguments)) for c in result.tool_calls] == [
        ("get_weather", {"city": "東京"}),
        ("get_time", {}),
    ]
    result = get_tool_parser("xlam")().extract(XLAM_VALID[1])
    assert result.content == "I will check.\n\nDone."  # the fence is markup, the text around it content
    assert json.loads(result.tool_calls[0].arguments) == {"code": "```"}
    assert calls_of("xlam", XLAM_VALID[2]) == [("f", {"a": 1})]
    assert calls_of("xlam", XLAM_VALID[3]) == [("f", {"a": 2})]
    result = get_tool_parser("xlam")().extract(XLAM_VALID[4])
    assert result.content == "Ok" and [c.name for c in result.tool_calls] == ["f"]


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"a": 1}\n```',  # fenced JSON that is no call list
        "```",
        "[TOOL_CALLS]",
        "[Tool calls are not needed]",
        "[1, 2]",
        '<tool_call>{"name": "f", "arguments": {}}</tool_call>',  # Hermes' object: xLAM writes a list
        'Here: [{"name": "f", "arguments": {}}]',  # a bare list only at the start
    ],
)
def test_xlam_not_a_call_is_content(text):
    assert_content_only("xlam", text)


@pytest.mark.parametrize("text", XLAM_VALID)
def test_xlam_stream_reassembles_to_extract(text):
    check_every_split("xlam", text)


def test_xlam_stream_holds_what_may_be_a_marker():
    parser = get_tool_parser("xlam")()
    assert not parser.feed("[")  # "[TOOL_CALLS]" or a list
    assert not parser.feed("TOOL_")
    d = parser.feed('CALLS][{"name": "f", "arguments": {"a"')
    assert [(t.name, t.arguments) for t in d.tool_calls] == [("f", '{"a"')]
    parser = get_tool_parser("xlam")()
    assert parser.feed("Code: ``").content == "Code: "
    assert parser.feed("`py").content == "```py"  # a fence, but of no list
    assert parser.feed("thon\nx = 1\n```").content == "thon\nx = 1\n"  # "```" may become "```json"
    assert parser.finish().content == "```"


# ---- all four ----------------------------------------------------------------------------------


def _random_call(rng: random.Random) -> str:
    value = rng.choice(
        ["Paris", 'a "quoted" } ] word', "é\u4e2d😀", "\\n\\t", "```", "<|tool_call|>", 3, None, [1, [2]]]
    )
    arguments = json.dumps(
        {rng.choice(["city", "k"]): value, "n": rng.randint(0, 9)}, ensure_ascii=rng.random() < 0.5
    )
    if rng.random() < 0.15:
        arguments = json.dumps(arguments)
    members = [f'"name": {json.dumps(rng.choice(["get_weather", "f", "é"]))}', f'"arguments": {arguments}']
    if rng.random() < 0.2:
        members.reverse()
    return "{" + rng.choice([", ", ",\n "]).join(members) + "}"


def _random_reply(rng: random.Random, name: str) -> str:
    calls = [_random_call(rng) for _ in range(rng.randint(1, 3))]
    before = rng.choice(["", "", "Let me check.\n", "  "])
    after = rng.choice(["", "", "\nDone.", " \n"])
    if name == "granite-20b-fc":
        return before + "".join(f"<function_call> {c}\n" for c in calls) + after
    listed = "[" + rng.choice([", ", ",", ",\n"]).join(calls) + "]"
    marker = {
        "granite": rng.choice(["<|tool_call|>", "<tool_call>", ""]),
        "phi4_mini_json": "functools",
        "xlam": rng.choice(["```json\n", "[TOOL_CALLS]", ""]),
    }[name]
    if not marker:
        before = ""  # a bare list counts only at the start
    closer = "\n```" if marker == "```json\n" else ""
    return before + marker + listed + closer + after


@pytest.mark.parametrize("name", NAMES)
def test_random_replies_stream_as_extracted(name):
    rng = random.Random(name)
    for _ in range(60):
        text = _random_reply(rng, name)
        whole = get_tool_parser(name)().extract(text)
        assert whole.tool_calls, text
        for chunks in ([rng.randint(1, 6) for _ in text], [1] * len(text)):
            parser = get_tool_parser(name)()
            content, calls = reassemble(parser, text, chunks, id_prefix="call_")
            assert (content.strip() or None) == whole.content, (text, chunks)
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in whole.tool_calls
            ]


PIECES = [
    "<|tool_call|>",
    "<tool_call>",
    "</tool_call>",
    "<function_call>",
    "functools",
    "```json",
    "```",
    "[TOOL_CALLS]",
    "[",
    "]",
    "{",
    "}",
    '"',
    ":",
    ",",
    " ",
    "\n",
    "\\",
    "\\q",
    "\\ud800",
    "tru",
    "é",
]


@pytest.mark.parametrize("name", NAMES)
def test_broken_replies_never_raise(name):
    """Whatever the model writes, the parser answers with content and calls, never an exception, and
    text that is not a call is not lost."""
    rng = random.Random("broken-" + name)
    for _ in range(300):
        text = _random_reply(rng, name)
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(PIECES) + text[at + rng.randint(0, 3) :]
        whole = get_tool_parser(name)().extract(text)
        if not whole.tool_calls:
            assert whole.content == (text.strip() or None), text
        parser = get_tool_parser(name)()
        cut = 0
        while cut < len(text):
            step = rng.randint(1, 6)
            parser.feed(text[cut : cut + step])
            cut += step
        parser.finish()


@pytest.mark.parametrize("name", NAMES)
def test_streaming_a_long_call_reads_each_character_once(name):
    """A ~50 KB call in 1-character deltas: the JSON scanner reads about the text's length in all."""
    arguments = json.dumps(
        {"rows": [{"id": i, "text": f'row {i} with "quotes" and [brackets]'} for i in range(1000)]}
    )
    call = '{"name": "put", "arguments": ' + arguments + "}"
    text = {
        "granite": f"<|tool_call|>[{call}]",
        "granite-20b-fc": f"<function_call> {call}",
        "phi4_mini_json": f"functools[{call}]",
        "xlam": f"```json\n[{call}]\n```",
    }[name]
    parser = get_tool_parser(name)()
    before = json_scan.chars_examined()
    sent = ""
    for c in text:
        sent += "".join(t.arguments or "" for t in parser.feed(c).tool_calls)
    sent += "".join(t.arguments or "" for t in parser.finish().tool_calls)
    examined = json_scan.chars_examined() - before
    assert sent == arguments
    assert examined <= 3 * len(text), (examined, len(text))  # streaming, then one check of the closed object
