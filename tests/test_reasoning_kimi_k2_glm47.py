"""ferrox.reasoning: the kimi_k2 parser (Kimi-K2-Thinking / K2.5) and glm47 (vLLM's other name of glm45) on
text and token ids (no engine): the answer tags that end a thinking without `</think>` (Kimi's tool-call
section, GLM's `<tool_call>`) and stay in the answer for the tool parser, streamed at every cut (inside
the tags too), the template switches, the prompt rule at the reply's turn, the token count and the
thinking budget; and the calls read from the answer, whole and streamed through both parsers."""

from __future__ import annotations

import json
import types

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.serving import ServingContext
from ferrox.entrypoints.openai.tools import ToolStream, parse_tool_calls
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser
from ferrox.reasoning.plugin import BUILT_IN
from ferrox.sampling_params import SamplingParams
from ferrox.structured.thinking_budget import ThinkingBudget

from tests.test_reasoning_parsers_more import assert_streams_like_split, cuts

THINK, UNTHINK, SECTION, IM_ASSISTANT, IM_MIDDLE, IM_USER, IM_END = 10, 11, 20, 30, 31, 32, 33
KIMI_VOCAB = {"<think>": THINK, "</think>": UNTHINK, "<|tool_calls_section_begin|>": SECTION,
              "<|im_assistant|>": IM_ASSISTANT}
TOOL_CALL, ASSISTANT, USER = 40, 41, 42
GLM_VOCAB = {"<think>": THINK, "</think>": UNTHINK, "<tool_call>": TOOL_CALL, "<|assistant|>": ASSISTANT}

S_BEGIN, S_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
WEATHER_ARGS = '{"city": "São Paulo", "days": 2, "units": {"temp": "C"}, "alerts": true}'
KIMI_CALLS = (S_BEGIN + CALL + "functions.get_weather:0" + ARGS + WEATHER_ARGS + CALL_END
              + CALL + "functions.get_time:1" + ARGS + "{}" + CALL_END + S_END)
GLM47_CALLS = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>São Paulo</arg_value>"
               "<arg_key>days</arg_key>\\n<arg_value>2</arg_value><arg_key>units</arg_key><arg_value>"
               '{"temp": "C"}</arg_value><arg_key>alerts</arg_key><arg_value>true</arg_value></tool_call>'
               "<tool_call>get_time</tool_call>")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"},
        "alerts": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
EXPECTED_CALLS = [("get_weather", {"city": "São Paulo", "days": 2, "units": {"temp": "C"}, "alerts": True}),
                  ("get_time", {})]


def kimi():
    return get_reasoning_parser("kimi_k2", KIMI_VOCAB.get)


def glm(name: str = "glm47"):
    return get_reasoning_parser(name, GLM_VOCAB.get)


def test_names():
    assert {"kimi_k2", "glm47"} <= set(REASONING_PARSERS) and {"kimi_k2", "glm47"} <= set(BUILT_IN)
    # glm47 is vLLM's second name of glm45's parser: one family
    assert glm("glm47").family is glm("glm45").family


# ---- kimi_k2 ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>weigh it</think>The answer.", "weigh it", "The answer."),
    ("weigh it</think>The answer.", "weigh it", "The answer."),  # K2.5's template opened the <think>
    ("cut short", "cut short", None),
    ("<think></think>The answer.", None, "The answer."),
    ("\n<think>a</think>b", "a", "b"),
    # the tool-call section ends the thinking, and starts the answer
    ("plan" + KIMI_CALLS, "plan", KIMI_CALLS),
    ("<think>plan" + S_BEGIN + "x", "plan", S_BEGIN + "x"),
    (S_BEGIN + "x", None, S_BEGIN + "x"),
    (" " + S_BEGIN, " ", S_BEGIN),
    # after </think> the section is the answer's as it is; the first of the two markers ends the thinking
    ("plan</think>Checking." + S_BEGIN + "x", "plan", "Checking." + S_BEGIN + "x"),
    ("plan" + S_BEGIN + "x</think>y", "plan", S_BEGIN + "x</think>y"),
    ("<|tool_calls_sec", "<|tool_calls_sec", None),  # a part of a marker at the very end is text
    ("", None, None),
])
def test_kimi_split(text, reasoning, content):
    assert kimi().split(text) == (reasoning, content)


def test_kimi_streams_like_the_split_at_every_cut():
    p = kimi()
    for text in ["<think>plan</think>ans", "pl" + S_BEGIN + CALL + "x", "<think>a<|tool_calls_section_end|>b" + S_BEGIN,
                 "a<|tool_calls_section_begin" + S_BEGIN, " <th" + S_BEGIN, "x</think>y" + S_BEGIN]:
        for thinking in (True, False):
            assert_streams_like_split(p, text, thinking)


def test_kimi_holds_back_a_partial_section_marker():
    stream = kimi().stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>plan it<|tool_calls") == ("plan it", "")
    assert not stream.ended
    assert stream.feed("_section_begin|>" + CALL) == ("", S_BEGIN + CALL)
    assert stream.ended
    assert stream.feed("</think>", finished=True) == ("", "</think>")


def test_kimi_switch_is_thinking():
    """Kimi's template reads `thinking` (false: an empty think block in the prompt); enable_thinking, which
    reasoning_effort sets, is not its switch (vLLM's parser reads `thinking` alone)."""
    p = kimi()
    assert p.thinks(None) and p.thinks({}) and p.thinks({"thinking": True}) and not p.thinks({"thinking": False})
    assert p.thinks({"enable_thinking": False})
    hi = [{"role": "user", "content": "hi"}]
    assert p.thinks(ChatCompletionRequest(model="m", messages=hi, reasoning_effort="none").template_kwargs())
    assert p.split("The answer." + KIMI_CALLS, thinking=False) == (None, "The answer." + KIMI_CALLS)
    assert p.count_reasoning_tokens([7, 8, UNTHINK, 9], thinking=False) == 0


def test_kimi_tags_are_special_tokens():
    p = kimi()
    assert p.needs_special_tokens and p.answer_token_ids == (SECTION,) and p.turn_token_id == IM_ASSISTANT
    ctx = ServingContext(None, "test")  # type: ignore[arg-type]
    ctx.reasoning = p
    assert ctx.reasoning_needs_special_tokens  # replies keep <think> / </think> and the section markers


def test_kimi_token_count_stops_at_the_section():
    p = kimi()
    assert p.count_reasoning_tokens([THINK, 7, 8, UNTHINK, 9]) == 2
    assert p.count_reasoning_tokens([7, 8, 9, SECTION, 5, 6]) == 3  # the section ended the thinking
    assert p.count_reasoning_tokens([7, UNTHINK, 8, SECTION, 9]) == 1
    assert p.count_reasoning_tokens([7, 8]) == 2  # cut short while thinking
    stream = p.stream()
    for chunk in ([THINK, 7], [8, SECTION], [9]):
        stream.count_tokens(chunk)
    assert stream.reasoning_tokens == 2


def test_kimi_prompt_rule_reads_the_reply_turn_only():
    """Earlier assistant turns keep their think blocks: the thinking of this turn is closed only by what
    comes after the last `<|im_assistant|>` (K2.5's `<think></think>` for thinking false)."""
    p = kimi()
    history = [IM_USER, 5, IM_END, IM_ASSISTANT, 6, IM_MIDDLE, THINK, 7, UNTHINK, 8, IM_END, IM_USER, 9, IM_END]
    assert not p.prompt_ends_reasoning([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK])  # K2.5, thinking
    assert p.prompt_ends_reasoning([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK, UNTHINK])  # thinking false
    assert not p.prompt_ends_reasoning([*history, IM_ASSISTANT, 6, IM_MIDDLE])  # K2-Thinking: the model opens it
    assert p.prompt_ends_reasoning([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK, 7, SECTION])  # a prefilled call
    ctx = ServingContext(None, "test")  # type: ignore[arg-type]
    ctx.reasoning = p
    assert ctx.starts_thinking([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK])
    assert not ctx.starts_thinking([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK], {"thinking": False})
    assert not ctx.starts_thinking([*history, IM_ASSISTANT, 6, IM_MIDDLE, THINK, UNTHINK])


def test_kimi_tokenizers():
    with pytest.raises(ValueError, match="reasoning_parser: 'kimi_k2' needs <think> and </think>"):
        get_reasoning_parser("kimi_k2", {"<|tool_calls_section_begin|>": 1}.get)
    # without the section as one token the text still splits there; only the ids are missing
    p = get_reasoning_parser("kimi_k2", {"<think>": 1, "</think>": 2}.get)
    assert p.answer_token_ids == () and p.split("a" + S_BEGIN) == ("a", S_BEGIN)
    assert p.count_reasoning_tokens([5, 6, 7]) == 3


def _through_both_parsers(p, text: str, deltas: list[str], tool_parser: str, thinking: bool = True):
    """A reply streamed as the chat route does: the reasoning stream first, its content into a ToolStream."""
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    stream, tools = p.stream(thinking), ToolStream(request, tool_parser)
    reasoning, content, calls = "", "", {}
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        r, c = stream.feed(delta, finished=last)
        reasoning += r
        for out in (tools.feed(c) if c else None, tools.finish() if last else None):
            content += (out or {}).get("content", "")
            for tc in (out or {}).get("tool_calls", []):
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc["function"].get("name", "")
                entry[1] += tc["function"].get("arguments", "")
    whole_reasoning, whole_content = p.split(text, thinking)
    whole_text, whole_calls = parse_tool_calls(whole_content or "", request, tool_parser)
    assert (reasoning or None) == whole_reasoning, deltas
    assert (content.strip() or None) == whole_text, deltas
    assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == \
        [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole_calls or []]
    return whole_reasoning, whole_text, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                         for c in whole_calls or []]


@pytest.mark.parametrize("thinking_ends", ["</think>", ""])
def test_kimi_calls_read_from_the_answer_at_every_cut(thinking_ends):
    """The calls after `</think>`, or after a thinking the section itself ended, come back as tool_calls
    (with Kimi's ids) and nothing of them as thinking, streamed cut anywhere (inside the markers too)."""
    text = "Look it up." + thinking_ends + KIMI_CALLS
    for deltas in [[text], list(text), *([text[:a], text[a:]] for a in range(len(text) + 1))]:
        got = _through_both_parsers(kimi(), text, deltas, "kimi_k2")
        assert got == ("Look it up.", None, EXPECTED_CALLS)
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    _, calls = parse_tool_calls(kimi().split(text)[1] or "", request, "kimi_k2")
    assert [c["id"] for c in calls or []] == ["functions.get_weather:0", "functions.get_time:1"]
    # thinking off (the template's empty think block): the same reply is all answer
    text = "Checking." + KIMI_CALLS
    for deltas in cuts(text[:40]):
        deltas[-1] += text[40:]
        assert _through_both_parsers(kimi(), text, deltas, "kimi_k2", thinking=False) == (
            None, "Checking.", EXPECTED_CALLS)


# ---- glm47 / glm45: `<tool_call>` ends the thinking ------------------------------------------------------

@pytest.mark.parametrize("name", ["glm45", "glm47"])
@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>weigh it</think>The answer.", "weigh it", "The answer."),
    ("weigh it</think>\n" + GLM47_CALLS, "weigh it", "\n" + GLM47_CALLS),  # GLM-4.7's prompt opened <think>
    ("plan" + GLM47_CALLS, "plan", GLM47_CALLS),  # a call before any </think> ends the thinking
    ("<think>plan<tool_call>f</tool_call>", "plan", "<tool_call>f</tool_call>"),
    ("plan</think>a<tool_call>x</think>", "plan", "a<tool_call>x</think>"),
    ("plan<tool_", "plan<tool_", None),
])
def test_glm_split(name, text, reasoning, content):
    assert glm(name).split(text) == (reasoning, content)


def test_glm47_switch_prompt_rule_and_counts():
    p = glm()
    assert p.thinks(None) and not p.thinks({"enable_thinking": False})
    assert p.split("The answer.", thinking=False) == (None, "The answer.")
    # GLM-4.7's template: earlier turns `<|assistant|></think>...`, the reply `<|assistant|><think>` (thinking)
    # or `<|assistant|></think>` (enable_thinking false)
    history = [USER, 5, ASSISTANT, UNTHINK, 6, TOOL_CALL, 7, USER, 8]
    assert not p.prompt_ends_reasoning([*history, ASSISTANT, THINK])
    assert p.prompt_ends_reasoning([*history, ASSISTANT, UNTHINK])
    assert not p.prompt_ends_reasoning([*history, ASSISTANT])
    assert p.answer_token_ids == (TOOL_CALL,) and not p.needs_special_tokens
    assert p.count_reasoning_tokens([7, 8, TOOL_CALL, 9]) == 2
    assert p.count_reasoning_tokens([THINK, 7, UNTHINK, TOOL_CALL, 9]) == 1
    for text in ["pl<tool_call>x", "<think>a</think>b<tool_call>", "a<tool_ca<tool_call>", " <thi<tool_call>"]:
        for thinking in (True, False):
            assert_streams_like_split(p, text, thinking)


def test_glm47_calls_read_from_the_answer_at_every_cut():
    text = "Look it up." + GLM47_CALLS
    for deltas in [[text], list(text), *([text[:a], text[a:]] for a in range(len(text) + 1))]:
        assert _through_both_parsers(glm(), text, deltas, "glm47") == ("Look it up.", None, EXPECTED_CALLS)
    text = "Look it up.</think>Checking.\n" + GLM47_CALLS
    assert _through_both_parsers(glm(), text, [text], "glm47") == ("Look it up.", "Checking.", EXPECTED_CALLS)


# ---- the thinking budget ----------------------------------------------------------------------------------

def test_budget_ends_at_an_answer_token():
    """Kimi's thinking ended by its tool-call section is over: the budget forces no `</think>` into the calls."""
    b = ThinkingBudget(2, THINK, UNTHINK, [1, THINK], answer_tokens=[SECTION])
    b.accept(7)
    b.accept(SECTION)
    for token in (8, 9, 10):
        assert b.forced_token() is None and not b.may_force_within(1)
        b.accept(token)
    assert not ThinkingBudget(1, THINK, UNTHINK, [THINK, 5, SECTION], answer_tokens=[SECTION]).thinking
    # without answer tokens (deepseek_r1) the same tokens are thought, and the budget closes them
    b = ThinkingBudget(2, THINK, UNTHINK, [1, THINK])
    b.accept(7)
    b.accept(SECTION)
    assert b.forced_token() == UNTHINK


def test_engine_budget_takes_the_parser_answer_tokens():
    from ferrox.engine.engine_core import EngineCore

    core = types.SimpleNamespace(reasoning=kimi())
    budget = EngineCore._thinking_budget(core, SamplingParams(thinking_token_budget=3), [IM_ASSISTANT, THINK])  # type: ignore[arg-type]
    assert budget.thinking and budget.answer_tokens == {SECTION}
