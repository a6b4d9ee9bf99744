"""ferrox.reasoning: the deepseek_v3, mistral and granite parsers on text and token ids (no engine), and
their tool calls read from the answer."""

from __future__ import annotations

import itertools
import types

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.serving import ServerOptions, ServingContext
from ferrox.entrypoints.openai.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from ferrox.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser

THINK, UNTHINK, INST_END, SYS = 384, 385, 4, 17
VOCAB = {"<think>": 384, "</think>": 385, "[THINK]": 30, "[/THINK]": 31, "[INST]": 3, "[/INST]": INST_END}
M_THINK, M_UNTHINK = VOCAB["[THINK]"], VOCAB["[/THINK]"]
HI = [{"role": "user", "content": "hi"}]


def parser(name: str):
    return get_reasoning_parser(name, VOCAB.get)


def cuts(text: str):
    """The text as deltas at every cut: one character at a time, and every split into two or three."""
    yield list(text)
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        yield [text[:a], text[a:b], text[b:]]


def assert_streams_like_split(p, text: str, thinking: bool) -> None:
    """Every cut of the text into deltas streams exactly the non-streamed split."""
    whole = p.split(text, thinking)
    for deltas in cuts(text):
        stream = p.stream(thinking)
        parts = [stream.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
        got = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
        assert got == whole, (text, deltas)


def test_names_are_choices():
    assert {"deepseek_v3", "mistral", "granite"} <= set(REASONING_PARSERS)


# ---- deepseek_v3 ----------------------------------------------------------------------------------------

def test_deepseek_v3_switch_is_thinking_or_enable_thinking():
    p = parser("deepseek_v3")
    assert not p.thinks(None) and not p.thinks({}) and not p.thinks({"thinking": False})
    assert p.thinks({"thinking": True}) and p.thinks({"enable_thinking": True})
    # reasoning_effort becomes enable_thinking (vLLM's way), which this parser reads too.
    assert p.thinks(ChatCompletionRequest(model="m", messages=HI, reasoning_effort="high").template_kwargs())
    assert not p.thinks(ChatCompletionRequest(model="m", messages=HI, reasoning_effort="none").template_kwargs())


@pytest.mark.parametrize("text", ["weigh it</think>\n\nYes.", "<think>a</think>b", "cut short", "</think>x",
                                  "a</think>b</think>c", "", "<thi"])
def test_deepseek_v3_reads_as_r1_with_thinking_on_and_as_answer_off(text):
    v3, r1 = parser("deepseek_v3"), parser("deepseek_r1")
    assert v3.split(text, thinking=True) == r1.split(text, thinking=True)
    assert v3.split(text, thinking=False) == (None, text or None)
    assert v3.count_reasoning_tokens([7, 8, UNTHINK, 9], thinking=True) == 2
    assert v3.count_reasoning_tokens([7, 8, UNTHINK, 9], thinking=False) == 0


def test_deepseek_v3_prompt_decides_with_the_switch():
    """V3.1's template ends the prompt with `<think>` (thinking) or `</think>` (not): the server's rule
    (the parser's switch, unless the prompt closed the thinking) agrees with both."""
    ctx = ServingContext(None, "test")  # type: ignore[arg-type]
    ctx.reasoning = parser("deepseek_v3")
    assert not ctx.starts_thinking([1, 2, UNTHINK])
    assert ctx.starts_thinking([1, 2, THINK], {"thinking": True})
    assert not ctx.starts_thinking([1, 2, UNTHINK], {"enable_thinking": True})  # template read only `thinking`
    options = ServerOptions(default_chat_template_kwargs=types.MappingProxyType({"thinking": True}))
    ctx = ServingContext(None, "test", options)  # type: ignore[arg-type]
    ctx.reasoning = parser("deepseek_v3")
    assert ctx.starts_thinking([1, THINK]) and not ctx.starts_thinking([1, THINK], {"thinking": False})


def test_deepseek_v3_tool_calls_read_from_the_answer():
    calls = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
             "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    reasoning, answer = parser("deepseek_v3").split("call get_time</think>Checking." + calls, thinking=True)
    assert reasoning == "call get_time"
    got = DeepSeekV3ToolParser(None).extract(answer or "")
    assert got.content == "Checking." and [(c.name, c.arguments) for c in got.tool_calls] == \
        [("get_time", "{}")]


# ---- mistral --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("[THINK]plan it[/THINK]The answer.", "plan it", "The answer."),
    ("\n[THINK]a[/THINK]\nb", "a", "\nb"),  # whitespace before [THINK] goes with it
    ("The answer.", None, "The answer."),  # no [THINK]: all answer (vLLM's rule), not reasoning
    ("[THINK]cut short", "cut short", None),
    ("pre[THINK]a[/THINK]b", "a", "preb"),  # text before [THINK] is answer
    ("x[/THINK]y", None, "xy"),  # a stray [/THINK] is dropped
    ("[THINK]a[/THINK]b[THINK]c[/THINK]", "a", "b[THINK]c[/THINK]"),  # after the thinking, all is answer
    ("[THI", None, "[THI"),  # a part of a tag at the very end is text
    ("", None, None),
])
def test_mistral_split(text, reasoning, content):
    assert parser("mistral").split(text) == (reasoning, content)


def test_mistral_streams_like_the_split_at_every_cut():
    p = parser("mistral")
    for text in ["[THINK]plan[/THINK]ans", " [THINK]a[/TH", "x[/THINK]y[THINK]z", "[THINK][/THINK]", "[[THINK]a[/[/THINK]b"]:
        for thinking in (True, False):
            assert_streams_like_split(p, text, thinking)


def test_mistral_tags_are_special_tokens_and_counted():
    p = parser("mistral")
    assert p.needs_special_tokens and not parser("deepseek_v3").needs_special_tokens
    ctx = ServingContext(None, "test")  # type: ignore[arg-type]
    ctx.reasoning = p
    assert ctx.reasoning_needs_special_tokens  # replies keep [THINK] / [/THINK]
    assert p.count_reasoning_tokens([M_THINK, 7, 8, 9, M_UNTHINK, 10]) == 3
    assert p.count_reasoning_tokens([10, 11]) == 0  # never thought: no reasoning tokens
    assert p.count_reasoning_tokens([M_THINK, 7, 8]) == 2  # cut short while thinking
    assert p.count_reasoning_tokens([M_THINK, 7, M_UNTHINK], thinking=False) == 0


def test_mistral_prompt_rule_reads_the_reply_turn_only():
    """Magistral's system prompt spells out `[THINK]...[/THINK]`: that does not close the reply's thinking."""
    p = parser("mistral")
    system = [SYS, M_THINK, 9, M_UNTHINK, 9]
    assert not p.prompt_ends_reasoning([*system, 3, 5, 6, INST_END])
    assert p.prompt_ends_reasoning([*system, 3, 5, INST_END, M_THINK, 7, M_UNTHINK])  # a prefilled thinking
    assert not p.prompt_ends_reasoning([*system, 3, 5, INST_END, M_THINK, 7])


def test_mistral_tool_calls_read_from_the_answer():
    text = '[THINK]use the tool[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    reasoning, answer = parser("mistral").split(text)
    assert reasoning == "use the tool"
    got = MistralToolParser(None).extract(answer or "")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert not got.content


# ---- granite --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("Here is my thought process: sky scatters blue.\nHere is my response: Yes.", " sky scatters blue.\n", " Yes."),
    ("Here's my thought process:a Here's my response:b", "a ", "b"),  # vLLM's "Here's" variants
    ("Here is my thought process:a Here's my response:b", "a ", "b"),
    ("\nHere is my thought process:a Here is my response:b", "a ", "b"),
    ("Yes, it is blue.", None, "Yes, it is blue."),  # no thought-process marker: all answer
    ("Here is my thought process: cut", " cut", None),  # no response marker: cut short while thinking
    ("Here is my thought process:a Here is my response:b Here is my response:c", "a ", "b Here is my response:c"),
    ("Here is my", None, "Here is my"),
    ("", None, None),
])
def test_granite_split(text, reasoning, content):
    assert parser("granite").split(text, thinking=True) == (reasoning, content)


def test_granite_switch_is_thinking():
    p = parser("granite")
    assert p.thinks({"thinking": True}) and not p.thinks({}) and not p.thinks({"enable_thinking": True})
    text = "Here is my thought process: a Here is my response: b"
    assert p.split(text, thinking=False) == (None, text)


def test_granite_streams_like_the_split_at_every_cut():
    p = parser("granite")
    for text in ["Here is my thought process: ab Here's my response: c", " Here's my thought process:x Here",
                 "Here Here is my thought process:Here is my respons", "Hero", "x Here is my response:y"]:
        for thinking in (True, False):
            assert_streams_like_split(p, text, thinking)


def test_granite_holds_back_a_partial_marker():
    stream = parser("granite").stream(True)
    assert stream.feed("Here is my tho") == ("", "")
    assert stream.feed("ught process: blue sky. Here's my") == (" blue sky. ", "")
    assert stream.feed(" resp") == ("", "")
    assert stream.feed("onse: Yes.") == ("", " Yes.")
    assert stream.ended


def test_granite_has_no_token_ids():
    """The markers are text: no ids for the grammar gate or the budget (the engine refuses both), no
    prompt rule, and no reasoning tokens counted."""
    p = parser("granite")
    assert p.start_token_id is None and p.end_token_id is None
    assert not p.prompt_ends_reasoning([1, 2, 3])
    assert p.count_reasoning_tokens([1, 2, 3]) == 0
    assert get_reasoning_parser("granite", {}.get).name == "granite"  # any tokenizer


def test_missing_tags_name_the_parser():
    with pytest.raises(ValueError, match=r"reasoning_parser: 'mistral' needs \[THINK\] and \[/THINK\]"):
        get_reasoning_parser("mistral", {"<think>": 1, "</think>": 2}.get)
    with pytest.raises(ValueError, match="reasoning_parser: 'deepseek_v3' needs <think> and </think>"):
        get_reasoning_parser("deepseek_v3", {}.get)
