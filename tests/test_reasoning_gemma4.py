"""ferrox.reasoning: the `gemma4` parser (vLLM's name) on text and token ids (no engine): Gemma 4's
`<|channel>thought\\n...<channel|>` split off with its `thought\\n` label dropped, streamed exactly as split at every
cut, its enable_thinking switch, the prompt rule after a tool's response, and tool calls read from the answer."""

from __future__ import annotations

import itertools

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.serving import ServingContext
from ferrox.entrypoints.openai.tool_parsers.gemma4 import Gemma4ToolParser
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser

VOCAB = {"<|channel>": 100, "<channel|>": 101, "<|turn>": 105, "<turn|>": 106, "<|think|>": 98,
         "<|tool_call>": 48, "<tool_call|>": 49, "<|tool_response>": 50, "<tool_response|>": 51}
CH, UNCH, TURN, TC, TC_END, TR, TR_END = (VOCAB[t] for t in (
    "<|channel>", "<channel|>", "<|turn>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"))


def parser():
    return get_reasoning_parser("gemma4", VOCAB.get)


def cuts(text: str):
    """The text as deltas: one character at a time, and every split into two or three."""
    yield list(text)
    for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        yield [text[:a], text[a:b], text[b:]]


def test_name_switch_and_special_tokens():
    p = parser()
    assert "gemma4" in REASONING_PARSERS and p.needs_special_tokens
    assert p.start_token_id == CH and p.end_token_id == UNCH
    # vLLM's Gemma 4 template thinks only with enable_thinking true (reasoning_effort sets it, as for qwen3)
    assert p.thinks({"enable_thinking": True}) and not p.thinks({}) and not p.thinks(None)
    assert not p.thinks({"enable_thinking": False}) and not p.thinks({"thinking": True})
    assert p.thinks(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                          reasoning_effort="high").template_kwargs())
    ctx = ServingContext(None, "test")  # type: ignore[arg-type]
    ctx.reasoning = p
    assert ctx.reasoning_needs_special_tokens  # replies keep <|channel> / <channel|>


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<|channel>thought\nplan it<channel|>The answer.", "plan it", "The answer."),
    ("\n<|channel>thought\na\n<channel|>\nb", "a\n", "\nb"),  # whitespace before the channel goes with it
    ("<|channel>plan<channel|>x", "plan", "x"),  # no label: all of it is reasoning
    ("<|channel>thoughtful<channel|>x", "thoughtful", "x"),  # only the whole label is dropped
    ("<|channel>thought\n<channel|>Hi", None, "Hi"),  # an empty channel
    ("<|channel>thought\ncut short", "cut short", None),
    ("<|channel>thou", "thou", None),  # a part of the label at the end is reasoning
    ("The answer.", None, "The answer."),  # no channel: all answer (the model opens it itself)
    ("pre<|channel>thought\na<channel|>b", "a", "preb"),  # text before the channel is answer
    ("x<channel|>y", None, "xy"),  # a stray end tag is dropped
    ("<|channel>thought\na<channel|>b<|channel>c<channel|>", "a", "b<|channel>c<channel|>"),
    # a tool call opened while thinking ends the thinking (vLLM's is_reasoning_end); the call stays in the answer
    ("<|channel>thought\nuse it<|tool_call>call:f{}<tool_call|>", "use it", "<|tool_call>call:f{}<tool_call|>"),
    ("<|chan", None, "<|chan"),
    ("", None, None),
])
def test_split(text, reasoning, content):
    assert parser().split(text) == (reasoning, content)


def test_thinking_off_is_all_answer():
    assert parser().split("Hi <|channel>x<channel|>", thinking=False) == (None, "Hi <|channel>x<channel|>")


def test_streams_like_the_split_at_every_cut():
    p = parser()
    for text in ["<|channel>thought\nab<channel|>c", " <|channel>thought", "x<channel|>y<|channel>thought\nz",
                 "<|channel>thought\n<channel|>", "<|channel>though<|tool_call>f", "<<|channel>thought\n<chan<channel|>"]:
        for thinking in (True, False):
            whole = p.split(text, thinking)
            for deltas in cuts(text):
                stream = p.stream(thinking)
                parts = [stream.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
                got = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
                assert got == whole, (text, deltas, thinking)


def test_stream_holds_back_the_label_and_the_tags():
    stream = parser().stream(True)
    assert stream.feed("<|chan") == ("", "")
    assert stream.feed("nel>thou") == ("", "")  # may still be the label
    assert stream.feed("ght\nweigh") == ("weigh", "")
    assert stream.feed(" it<chan") == (" it", "")
    assert stream.feed("nel|>Yes.") == ("", "Yes.")
    assert stream.ended


def test_prompt_rule_and_token_count():
    p = parser()
    system = [2, TURN, 9, 98, 7, 106]
    # enable_thinking false: the template closes an empty channel after `<|turn>model\n`
    assert p.prompt_ends_reasoning([*system, TURN, 11, 12, CH, 13, UNCH])
    assert not p.prompt_ends_reasoning([*system, TURN, 11, 12])  # thinking on: the model opens it
    # after a tool's response Gemma 4 goes on with its turn and may think again (vLLM's rule)
    exchange = [TURN, 11, 12, CH, 13, 14, UNCH, TC, 15, TC_END, TR, 16, TR_END]
    assert not p.prompt_ends_reasoning([*system, *exchange])
    assert p.count_reasoning_tokens([CH, 13, 7, 8, UNCH, 10]) == 3  # (the label's token is counted)
    assert p.count_reasoning_tokens([CH, 7, TC, 9, TC_END]) == 1  # a tool call ends the thinking
    assert p.count_reasoning_tokens([10, 11]) == 0
    assert p.count_reasoning_tokens([CH, 7, UNCH], thinking=False) == 0


def test_tool_calls_read_from_the_answer():
    text = '<|channel>thought\nuse the tool<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    reasoning, answer = parser().split(text)
    assert reasoning == "use the tool"
    got = Gemma4ToolParser(None).extract(answer or "")
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert not got.content


def test_missing_tags_name_the_parser():
    with pytest.raises(ValueError, match="reasoning_parser: 'gemma4' needs <\\|channel> and <channel\\|>"):
        get_reasoning_parser("gemma4", {"<think>": 1, "</think>": 2}.get)
