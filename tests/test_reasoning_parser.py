"""ferrox.reasoning: the deepseek_r1 / qwen3 parsers on text and token ids (no engine)."""

from __future__ import annotations

import random

import pytest
from ferrox.reasoning import REASONING_PARSERS, get_reasoning_parser

START, END = 384, 385
VOCAB = {"<think>": START, "</think>": END}


def parser(name: str = "deepseek_r1"):
    return get_reasoning_parser(name, VOCAB.get)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    ("<think>\nweigh it\n</think>\n\nYes.", "\nweigh it\n", "\n\nYes."),
    ("weigh it</think>Yes.", "weigh it", "Yes."),  # the template opened the <think> in the prompt
    ("  \n<think>a</think>b", "a", "b"),  # whitespace before the opening tag goes with it
    ("still thinking when cut", "still thinking when cut", None),  # no </think>: all reasoning
    ("<think>cut short", "cut short", None),
    ("</think>only the answer", None, "only the answer"),
    ("a</think>", "a", None),
    ("a</think>b</think>c", "a", "b</think>c"),  # the first </think> ends the reasoning
    ("x<think>y</think>z", "x<think>y", "z"),  # a <think> after text is text
    ("", None, None),
    ("<thi", "<thi", None),  # a part of a tag at the very end is text
])
def test_split(text, reasoning, content):
    assert parser().split(text) == (reasoning, content)


def test_qwen3_with_thinking_off_is_all_answer():
    qwen = parser("qwen3")
    assert not qwen.thinks({"enable_thinking": False})
    assert qwen.thinks({}) and qwen.thinks(None) and qwen.thinks({"enable_thinking": True})
    assert qwen.split("the answer", thinking=False) == (None, "the answer")
    assert qwen.split("the answer") == ("the answer", None)  # thinking on (default) and cut short
    assert parser("deepseek_r1").thinks({"enable_thinking": False})  # R1 always thinks (vLLM)


# harmony, mistral, granite, seed_oss and gemma4: their own tests (test_harmony_reasoning.py,
# test_reasoning_parsers_more.py, structured/test_tool_parser_seed_oss.py, test_reasoning_gemma4.py)
@pytest.mark.parametrize("name", [n for n in REASONING_PARSERS
                                  if n not in ("openai_gptoss", "mistral", "granite", "seed_oss", "gemma4")])
def test_stream_concatenates_to_the_split(name):
    """Any cut of the text into deltas streams exactly the non-streamed split, and nothing of a tag
    leaks into either part."""
    rng = random.Random(0)
    texts = ["<think>\nweigh it</think>\n\nYes.", "  <think>a</th", "abc</think>", "</think>x", "<", " <think",
             "a</thinker>b</think>c", "<think><think>x</think>y", "\n\n", "no tags at all"]
    p = parser(name)
    for text in texts:
        for thinking in (True, False):
            for _ in range(20):
                cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(0, 4))))
                deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
                stream = p.stream(thinking)
                parts = [stream.feed(d, finished=i == len(deltas) - 1) for i, d in enumerate(deltas)]
                reasoning = "".join(r for r, _ in parts)
                content = "".join(c for _, c in parts)
                assert ((reasoning or None), (content or None)) == p.split(text, thinking), (text, deltas)


def test_stream_holds_back_a_possible_tag():
    stream = parser().stream()
    assert stream.feed("  ") == ("", "")  # maybe whitespace before <think>
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>plan</") == ("plan", "")  # "</" may start </think>
    assert not stream.ended
    assert stream.feed("think>ans") == ("", "ans")
    assert stream.ended
    assert stream.feed("wer", finished=True) == ("", "wer")


def test_token_counts_and_prompt_rule():
    p = parser()
    assert p.count_reasoning_tokens([START, 7, 8, 9, END, 10, 11]) == 3
    assert p.count_reasoning_tokens([7, 8]) == 2  # cut short while thinking
    assert p.count_reasoning_tokens([7, END, 8], thinking=False) == 0
    stream = p.stream()
    for chunk in ([START, 7], [8], [END, 9], [10]):
        stream.count_tokens(chunk)
    assert stream.reasoning_tokens == 2
    # The prompt's last tag decides whether the thinking is already over (Qwen3's empty think block).
    assert p.prompt_ends_reasoning([1, START, 5, END, 6])
    assert not p.prompt_ends_reasoning([1, END, 5, START, 6])
    assert not p.prompt_ends_reasoning([1, 2, 3])


def test_unknown_parser_and_missing_tags_name_the_field():
    with pytest.raises(ValueError, match="reasoning_parser: 'hunyuan_a13b' is not one of"):
        get_reasoning_parser("hunyuan_a13b", VOCAB.get)
    with pytest.raises(ValueError, match="reasoning_parser: 'qwen3' needs </think> as single tokens"):
        get_reasoning_parser("qwen3", {"<think>": 5}.get)


def test_server_default_template_kwargs_decide_thinking_under_the_requests():
    """--default-chat-template-kwargs '{"enable_thinking": false}' turns a Qwen3's thinking off for
    every request; a request's own chat_template_kwargs win."""
    import types

    from ferrox.entrypoints.openai.serving import ServerOptions, ServingContext

    options = ServerOptions(default_chat_template_kwargs=types.MappingProxyType({"enable_thinking": False}))
    ctx = ServingContext(None, "test", options)  # type: ignore[arg-type]
    ctx.reasoning = parser("qwen3")
    assert not ctx.starts_thinking([1, 2])
    assert ctx.starts_thinking([1, 2], {"enable_thinking": True})
    assert ctx.template_kwargs({"x": 1}) == {"enable_thinking": False, "x": 1}
    assert not ServingContext(None, "test").starts_thinking([1, 2])  # type: ignore[arg-type]  # no parser
