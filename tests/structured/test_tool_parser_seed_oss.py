"""The seed_oss tool parser (Seed-OSS's `<seed:tool_call><function=NAME><parameter=KEY>VALUE</parameter>...`,
typed by the request's tools) and the seed_oss reasoning parser (`<seed:think>` / `</seed:think>`): whole-text
extraction, text that is no call staying content, no call read inside the thinking, the chat-template default,
and streamed deltas -- cut at every character, at the markers as a tokenizer would, and at random -- giving
exactly what extract / split give, through each parser alone and through both as the chat route runs them."""

from __future__ import annotations

import json
import random
import re

import pytest
from ferrox.entrypoints.openai.tool_parsers import TOOL_PARSERS, default_tool_parser, get_tool_parser
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser

from tests.test_reasoning_kimi_k2_glm47 import _through_both_parsers
from tests.test_reasoning_parsers_more import assert_streams_like_split

from .test_tool_parsers import reassemble

CALL, CALL_END = "<seed:tool_call>", "</seed:tool_call>"
THINK, THINK_END = "<seed:think>", "</seed:think>"
# Seed-OSS's tokenizer has each marker as one token: a stream cuts around them.
MARKERS = re.compile("|".join(re.escape(m) for m in (CALL, CALL_END, THINK, THINK_END, "<seed:bos>")))

TYPED = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "integer"}, "x": {"type": "number"}, "b": {"type": "boolean"},
    "o": {"type": "object"}, "a": {"type": "array"}, "maybe": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
# (what the model writes for each parameter, the value it stands for)
PAIRS = {
    "s": ("def f(a):\n    return a < 2 and '</parameter>' != \"東京\"\n", "def f(a):\n    return a < 2 and "
          "'</parameter>' != \"東京\""),  # one newline at each end dropped; a `</parameter>` no tag follows is text
    "n": ("42", 42), "x": ("2.50", 2.5), "b": ("True", True), "o": ('{"unit": "C", "h": [1, 2]}', {"unit": "C", "h": [1, 2]}),
    "a": ("['x', None]", ["x", None]), "maybe": ("null", None),
}


def seed_call(name: str, pairs: dict[str, str]) -> str:
    """A call as Seed-OSS's chat template writes one back into the conversation."""
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in pairs.items())
    return f"{CALL}\n<function={name}>\n{body}</function>\n{CALL_END}"


TWO_CALLS = ("Let me look.\n" + seed_call("f", {k: raw for k, (raw, _) in PAIRS.items()}) + "\n"
             + seed_call("get_time", {}))
EXPECTED = [("f", {k: value for k, (_, value) in PAIRS.items()}), ("get_time", {})]


def calls_of(text: str, tools=TYPED) -> tuple[str | None, list[tuple[str, object]]]:
    result = get_tool_parser("seed_oss")(tools=tools).extract(text)
    return result.content, [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


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


def check_every_cut(text: str, tools=TYPED) -> None:
    """Streaming text in two pieces cut at every character, one character at a time, at token-like cuts and
    at random gives extract's content and calls (arguments text equal, character for character)."""
    whole = get_tool_parser("seed_oss")(tools=tools).extract(text)
    expected = [(c.name, c.arguments) for c in whole.tool_calls]
    rng = random.Random(len(text))
    chunkings = [[i, len(text) - i] for i in range(len(text) + 1)] + [[1] * len(text), token_cuts(text)]
    chunkings += [[rng.randint(1, 9) for _ in range(len(text))] for _ in range(5)]
    for chunks in chunkings:
        parser = get_tool_parser("seed_oss")(tools=tools)
        content, calls = reassemble(parser, text, [c for c in chunks if c] or [1])
        assert (content.strip() or None) == whole.content, (text, chunks)
        assert [(c["name"], c["arguments"]) for c in calls] == expected, (text, chunks)
        assert parser.tools_called == bool(expected)


# ---- names and defaults -----------------------------------------------------------------------------
def test_registered_and_default_from_template():
    assert "seed_oss" in TOOL_PARSERS and "seed_oss" in REASONING_PARSERS
    # Seed-OSS's chat template: its markers as variables, then a call written back in the conversation (the
    # `<function=` / `<parameter=` inside would otherwise pick qwen3_coder)
    template = ("{%- set toolcall_begin_token = '<seed:tool_call>' -%}{{ '\\n' + toolcall_begin_token + "
                "'\\n<function=' + tool_call.name + '>\\n' }}{{ '<parameter=' + arg_name + '>' }}")
    assert default_tool_parser(template) == "seed_oss"
    assert default_tool_parser("<tool_call>\n<function=example>\n<parameter=x>") == "qwen3_coder"
    assert not get_tool_parser("seed_oss").needs_special_tokens


# ---- whole text -------------------------------------------------------------------------------------
def test_calls_typed_by_the_tools():
    assert calls_of(TWO_CALLS) == ("Let me look.", EXPECTED)
    # without the tools' schemas a value is JSON when it reads as JSON, else text (qwen3_coder's rule)
    assert calls_of(seed_call("g", {"n": "42", "s": "Paris"}), tools=None) == (None, [("g", {"n": 42, "s": "Paris"})])
    # a value on lines of its own (the format qwen3_coder's template writes) reads the same
    assert calls_of(f"{CALL}\n<function=f>\n<parameter=n>\n7\n</parameter>\n</function>\n{CALL_END}") == (
        None, [("f", {"n": 7})])


@pytest.mark.parametrize(("text", "content", "calls"), [
    # no call: the text is content as written
    ("Just an answer.", "Just an answer.", []),
    # the opening marker without a function header is no call
    (f"See {CALL} here.", f"See {CALL} here.", []),
    # the call of the sibling format is not Seed-OSS's
    ("<tool_call>\n<function=f>\n</function>\n</tool_call>", "<tool_call>\n<function=f>\n</function>\n</tool_call>", []),
    # cut short after the function header: the call stands (as in vLLM), its value running to the end
    (f"Ok.{CALL}\n<function=f>\n<parameter=n>12", "Ok.", [("f", {"n": 12})]),
    # text between calls that holds more than whitespace stays content
    (seed_call("get_time", {}) + " and " + seed_call("get_time", {}), "and", [("get_time", {}), ("get_time", {})]),
])
def test_content_and_calls(text, content, calls):
    assert calls_of(text) == (content, calls)


def test_no_call_is_read_inside_the_thinking():
    """Without a reasoning parser the thinking reaches the tool parser: a call it mentions is no call (vLLM's
    rule); the think block stays content as written. One left open runs to the end."""
    mention = seed_call("f", {"n": "1"})
    text = f"{THINK}I could call {mention} now.{THINK_END}Calling.\n" + seed_call("get_time", {})
    assert calls_of(text) == (f"{THINK}I could call {mention} now.{THINK_END}Calling.", [("get_time", {})])
    assert calls_of(f"{THINK}maybe {mention}") == (f"{THINK}maybe {mention}", [])
    # a stray end marker opens nothing: the call after it is read
    assert calls_of(f"done{THINK_END}{mention}") == (f"done{THINK_END}", [("f", {"n": 1})])


# ---- streamed ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    TWO_CALLS,
    f"{THINK}Plan: {seed_call('f', {'n': '1'})}{THINK_END}\n\nDone." + seed_call("f", {"b": "false", "x": "1e3"}),
    f"{THINK}cut short in the thinking <seed:tool_",
    f"Ok.{CALL}\n<function=f>\n<parameter=s>half a val",
    f"<seed:th{CALL}<seed:tool_call>\n<function=get_time>\n</function>\n{CALL_END}  <seed:thin",
])
def test_stream_equals_extract_at_every_cut(text):
    check_every_cut(text)


def test_streamed_deltas_send_the_header_first():
    """The call's id and name go out with its header, before any parameter is complete."""
    parser = get_tool_parser("seed_oss")(tools=TYPED)
    first = parser.feed(f"Hi.{CALL}\n<function=f>\n<parameter=n>4")
    assert first.content == "Hi." and [(d.name, d.arguments) for d in first.tool_calls] == [("f", "{")]
    assert first.tool_calls[0].id.startswith("call_") and parser.tools_called
    rest = [parser.feed("2</parameter>\n</function>\n" + CALL_END), parser.finish()]
    assert "".join(d.arguments or "" for m in rest for d in m.tool_calls) == '"n": 42}'


# ---- the reasoning parser, alone and ahead of the tool parser -----------------------------------------
BOS, SEED_THINK, SEED_UNTHINK = 12, 10, 11
VOCAB = {THINK: SEED_THINK, THINK_END: SEED_UNTHINK, "<seed:bos>": BOS}


def seed_reasoning():
    return get_reasoning_parser("seed_oss", VOCAB.get)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    (f"{THINK}weigh it{THINK_END}The answer.", "weigh it", "The answer."),
    (f"\n{THINK}a{THINK_END}b", "a", "b"),
    (f"weigh it{THINK_END}The answer.", "weigh it", "The answer."),  # no opening marker: reasoning (vLLM's)
    (f"{THINK}cut short", "cut short", None),
    (f"{THINK}{THINK_END}The answer.", None, "The answer."),
    ("<think>not Seed's</think>x", "<think>not Seed's</think>x", None),
    # a call written while thinking does not end it (vLLM's seed_oss waits for </seed:think>)
    (f"{THINK}plan{CALL}x", f"plan{CALL}x", None),
])
def test_reasoning_split(text, reasoning, content):
    assert seed_reasoning().split(text) == (reasoning, content)
    assert_streams_like_split(seed_reasoning(), text, True)


def test_reasoning_prompt_rule_and_counts():
    """`thinking_budget: 0` makes the template close a think block after the reply's `<seed:bos>assistant`: the
    output is all answer. Earlier assistant turns keep their think blocks, so the prompt is read after its last
    `<seed:bos>`."""
    p = seed_reasoning()
    assert p.thinks(None) and p.thinks({"thinking_budget": 0}) and not p.needs_special_tokens
    history = [BOS, 5, 6, BOS, 7, SEED_THINK, 8, SEED_UNTHINK, 9, BOS, 5, 6]
    assert not p.prompt_ends_reasoning([*history, BOS, 7])
    assert p.prompt_ends_reasoning([*history, BOS, 7, SEED_THINK, 8, SEED_UNTHINK])
    assert p.count_reasoning_tokens([SEED_THINK, 7, 8, SEED_UNTHINK, 9]) == 2
    with pytest.raises(ValueError, match="seed_oss.*<seed:think>"):
        get_reasoning_parser("seed_oss", {THINK_END: 1}.get)


def test_calls_read_from_the_answer_through_both_parsers():
    """The reasoning stream ahead of the tool stream, as the chat route runs them, cut anywhere (inside the
    markers too): the thinking goes out as reasoning, its mention of a call is no call, the calls after
    `</seed:think>` come back typed."""
    from tests.test_reasoning_kimi_k2_glm47 import EXPECTED_CALLS

    calls = (seed_call("get_weather", {"city": "São Paulo", "days": "2", "units": '{"temp": "C"}', "alerts": "true"})
             + seed_call("get_time", {}))
    text = f"{THINK}Try {CALL}.{THINK_END}Looking." + calls
    for deltas in [[text], list(text), *([text[:a], text[a:]] for a in range(len(text) + 1))]:
        got = _through_both_parsers(seed_reasoning(), text, deltas, "seed_oss")
        assert got == (f"Try {CALL}.", "Looking.", EXPECTED_CALLS), deltas


def test_broken_text_never_raises_and_streams_as_extracted():
    """Calls and thinking broken at random places with the format's markers: the parser never raises, and any
    chunking of the text streams what extract gives."""
    rng = random.Random(7)
    pieces = [CALL, CALL_END, THINK, THINK_END, "<function=f>", "<parameter=n>", "</parameter>", "</function>",
              "<seed:", "</seed:tool", "<", ">", "\n", " ", "x", "3"]
    base = [TWO_CALLS, f"{THINK}a{THINK_END}" + seed_call("f", {"n": "1"}), f"pre {CALL}\n<function=g>\n</function>"]
    for _ in range(150):
        text = rng.choice(base)
        for _ in range(rng.randint(1, 3)):
            at = rng.randint(0, len(text))
            text = text[:at] + rng.choice(pieces) + text[at + rng.randint(0, 2):]
        whole = get_tool_parser("seed_oss")(tools=TYPED).extract(text)
        chunks = [rng.randint(1, 6) for _ in range(len(text))]
        content, calls = reassemble(get_tool_parser("seed_oss")(tools=TYPED), text, chunks)
        assert (content.strip() or None) == whole.content, text
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls], text
