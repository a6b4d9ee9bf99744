"""ferrox.reasoning.harmony: gpt-oss's `openai_gptoss` reasoning parser on harmony text and token ids
(a tiny tokenizer with harmony's seven markers as special tokens: tests/helpers/harmony_tokenizer.py)."""

from __future__ import annotations

import random

import pytest
from ferrox.errors import InvalidArgumentError
from ferrox.reasoning import get_reasoning_parser
from ferrox.reasoning.harmony import parse_header

from tests.helpers.harmony_tokenizer import (
    ANSWER,
    ARGS,
    HARMONY_ANSWER_REPLY,
    HARMONY_TOOL_REPLY,
    PREAMBLE,
    THINK,
    build_harmony_tokenizer,
    token_pieces,
)

CALL_MESSAGE = ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                f"{ARGS}<|call|>")
# (output, reasoning, content without calls, content with calls kept for the tool parser)
CASES = [
    (HARMONY_ANSWER_REPLY, THINK, ANSWER, ANSWER),
    (HARMONY_TOOL_REPLY, THINK, PREAMBLE, PREAMBLE + CALL_MESSAGE),
    # what the detokenizer gives: the stop tokens (<|return|>, <|call|>) are not in the text
    (HARMONY_ANSWER_REPLY.removesuffix("<|return|>"), THINK, ANSWER, ANSWER),
    # the recipient before the channel, the content type bare (as the chat template writes calls)
    ('<|channel|>analysis<|message|>hm<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}',
     "hm", None, "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>"),
    # two thinkings and two answers: joined by a newline (vLLM's joiner)
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>c<|end|><|start|>assistant<|channel|>final<|message|>d",
     "a\nb", "c\nd", "c\nd"),
    # a call to a built-in tool (browser, python: never run by ferrox) is thinking
    ("<|channel|>analysis to=browser.search code<|message|>{\"query\": \"x\"}<|call|>", '{"query": "x"}', None, None),
    # cut by max_tokens inside the thinking, inside a header
    ("<|channel|>analysis<|message|>still thinking", "still thinking", None, None),
    ("<|channel|>analysis<|message|>done<|end|><|start|>assistant<|channel|>fin", "done", None, None),
    # text outside any message (the prompt ended inside a final message) is content
    ("continued answer", None, "continued answer", "continued answer"),
    ("", None, None, None),
    ("<|chan", None, "<|chan", "<|chan"),  # a part of a marker at the very end is text
    ("a < b <| c", None, "a < b <| c", "a < b <| c"),
]


@pytest.fixture(scope="module")
def tok():
    return build_harmony_tokenizer()


@pytest.fixture(scope="module")
def parser(tok):
    return get_reasoning_parser("openai_gptoss", tok.token_to_id)


def test_needs_harmony_tokens():
    from tests.helpers.tiny_models import build_tokenizer

    with pytest.raises(ValueError, match=r"reasoning_parser: 'openai_gptoss' needs <\|start\|>.*single tokens"):
        get_reasoning_parser("openai_gptoss", build_tokenizer().token_to_id)


def test_parser_interface(parser):
    assert parser.needs_special_tokens and parser.end_token_id is None and parser.start_token_id is None
    assert parser.thinks({"enable_thinking": False}) and not parser.prompt_ends_reasoning([1, 2, 3])
    parser.check_template_kwargs({"reasoning_effort": "low"})
    parser.check_template_kwargs({})
    with pytest.raises(InvalidArgumentError, match="reasoning_effort: gpt-oss") as err:
        parser.check_template_kwargs({"reasoning_effort": "none"})
    assert err.value.param == "reasoning_effort"
    with pytest.raises(InvalidArgumentError, match="builtin_tools") as err:
        parser.check_template_kwargs({"builtin_tools": ["browser"]})
    assert err.value.param == "chat_template_kwargs"
    parser.check_template_kwargs({"builtin_tools": [], "model_identity": "You are a test."})


@pytest.mark.parametrize(("text", "reasoning", "content", "with_calls"), CASES)
def test_split(parser, text, reasoning, content, with_calls):
    assert parser.split(text) == (reasoning, content)
    assert parser.split(text, tool_calls=True) == (reasoning, with_calls)


@pytest.mark.parametrize("tool_calls", [False, True])
def test_any_chunking_streams_the_split(parser, tool_calls):
    """Cuts anywhere (inside markers too) stream exactly the non-streamed split."""
    rng = random.Random(0)
    for text, *_ in CASES:
        want = parser.split(text, tool_calls=tool_calls)
        cutss = [list(range(1, len(text)))] + [sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 6))))
                                                for _ in range(30)]
        for cuts in cutss:
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = parser.stream(tool_calls=tool_calls)
            parts = [stream.feed(d) for d in deltas] + [stream.feed("", finished=True)]
            got = ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None)
            assert got == want, (text, deltas)


def test_token_by_token(parser, tok):
    """Deltas as the detokenizer gives them (a marker is one delta): nothing of the markers leaks, the
    answer starts when the first non-thinking message opens, and the thinking streams as it comes."""
    stream = parser.stream()
    seen = []
    for piece in token_pieces(tok, HARMONY_TOOL_REPLY):
        reasoning, content = stream.feed(piece)
        seen.append((reasoning, content, stream.ended))
        assert "<|" not in reasoning + content
    assert "".join(r for r, _, _ in seen) == THINK and "".join(c for _, c, _ in seen) == PREAMBLE
    first_content = next(i for i, (_, c, _) in enumerate(seen) if c)
    assert seen[first_content - 1][2] and not any(e for _, _, e in seen[: first_content - 4])
    assert sum(1 for r, _, _ in seen if r) > 5  # streamed, not held back to the end


def test_reasoning_tokens(parser, tok):
    think_tokens = len(tok.encode(THINK, add_special_tokens=False).ids)
    for reply in (HARMONY_TOOL_REPLY, HARMONY_ANSWER_REPLY):
        ids = tok.encode(reply, add_special_tokens=False).ids
        assert parser.count_reasoning_tokens(ids) == think_tokens
        stream = parser.stream()
        for i in range(0, len(ids), 3):
            stream.count_tokens(ids[i:i + 3])
        assert stream.reasoning_tokens == think_tokens
    two = tok.encode("<|channel|>analysis<|message|>ab<|end|><|start|>assistant<|channel|>analysis<|message|>cd"
                     "<|end|><|start|>assistant<|channel|>final<|message|>ef", add_special_tokens=False).ids
    assert parser.count_reasoning_tokens(two) == 2 * len(tok.encode("ab").ids)


@pytest.mark.parametrize(("header", "channel", "recipient", "content_type"), [
    ("<|channel|>analysis", "analysis", None, None),
    ("assistant<|channel|>commentary to=functions.get_weather <|constrain|>json", "commentary",
     "functions.get_weather", "json"),
    ("assistant to=functions.f<|channel|>commentary json", "commentary", "functions.f", "json"),
    ("assistant<|channel|>final", "final", None, None),
    ("assistant", None, None, None),
])
def test_parse_header(header, channel, recipient, content_type):
    parsed = parse_header(header)
    assert (parsed.channel, parsed.recipient, parsed.content_type) == (channel, recipient, content_type)


def test_template_messages(parser):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    bad = {"id": "d", "type": "function", "function": {"name": "g", "arguments": "not json"}}
    messages = [{"role": "user", "content": "hi", "reasoning": "not an assistant's"},
                {"role": "assistant", "content": "", "reasoning_content": "think", "tool_calls": [call, bad]},
                {"role": "assistant", "content": "preamble", "reasoning": "think", "tool_calls": [call]}]
    user, bare, with_content = parser.template_messages(messages)
    assert user is messages[0]
    assert bare["thinking"] == "think"
    assert [c["function"]["arguments"] for c in bare["tool_calls"]] == [{"a": 1}, "not json"]
    assert "thinking" not in with_content  # the template refuses content with thinking
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the request's own: untouched
