"""gpt-oss's `openai` tool parser (harmony messages `to=functions.NAME`), alone and behind the
`openai_gptoss` reasoning parser, whole and streamed (any chunking, and token by token with a tiny
tokenizer that has harmony's markers as special tokens), and the chat route's glue that picks it."""

from __future__ import annotations

import json

import pytest
from ferrox.entrypoints.openai.protocol import ChatCompletionRequest
from ferrox.entrypoints.openai.tool_parsers import default_tool_parser, get_tool_parser
from ferrox.entrypoints.openai.tools import (
    ToolStream,
    needs_special_tokens,
    parse_tool_calls,
    reads_harmony_calls,
)
from ferrox.entrypoints.tool_use import BlockStream, ToolRequest, split_reply
from ferrox.reasoning import get_reasoning_parser

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

from .test_tool_parsers import reassemble
from .test_tool_parsers_more import chunkings

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
TWO_CALLS = (HARMONY_TOOL_REPLY + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>")
HARMONY_TEMPLATE = "{{ '<|start|>assistant<|channel|>final<|message|>' }}"  # as gpt-oss's templates write it


@pytest.fixture(scope="module")
def tok():
    return build_harmony_tokenizer()


@pytest.fixture(scope="module")
def reasoning(tok):
    return get_reasoning_parser("openai_gptoss", tok.token_to_id)


def extract(text: str):
    result = get_tool_parser("openai")(tools=TOOLS).extract(text)
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    (HARMONY_TOOL_REPLY, PREAMBLE, [("get_weather", ARGS)]),
    (TWO_CALLS, PREAMBLE, [("get_weather", ARGS), ("get_time", "{}")]),
    (HARMONY_ANSWER_REPLY, ANSWER, []),
    ("plain text, no harmony", "plain text, no harmony", []),
    # cut by max_tokens inside the arguments: the call stands with what was written
    ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Pa', None,
     [("get_weather", '{"city": "Pa')]),
    ("<|channel|>commentary to=functions.get_weather <|const", None, []),  # inside the header: no call yet
])
def test_extract_from_the_whole_output(text, content, calls):
    assert extract(text) == (content, calls)


@pytest.mark.parametrize("text", [HARMONY_TOOL_REPLY, TWO_CALLS, HARMONY_ANSWER_REPLY])
def test_extract_behind_the_reasoning_parser(reasoning, text):
    """The reasoning parser's content (calls kept as canonical messages) parses as the raw output does."""
    thought, content = reasoning.split(text, tool_calls=True)
    assert thought == THINK
    assert extract(content or "") == extract(text)


@pytest.mark.parametrize("text", [HARMONY_TOOL_REPLY, TWO_CALLS, HARMONY_ANSWER_REPLY])
def test_stream_equals_extract(text):
    content, calls = extract(text)
    for chunks in chunkings(text):
        parser = get_tool_parser("openai")(tools=TOOLS)
        got_content, got_calls = reassemble(parser, text, chunks, id_prefix="call_")
        assert (got_content or None) == content
        assert [(c["name"], c["arguments"]) for c in got_calls] == calls
        assert parser.tools_called == bool(calls)


def test_token_by_token_through_both_parsers(tok, reasoning):
    """Detokenized pieces -> reasoning stream -> tool parser: the thinking, the preamble as content, the
    call's id and name first, then its arguments as they come (joined: valid JSON)."""
    split = reasoning.stream(tool_calls=True)
    parser = get_tool_parser("openai")(tools=TOOLS)
    thought = content = ""
    deltas = []
    for i, piece in enumerate([*token_pieces(tok, TWO_CALLS), ""]):
        r, c = split.feed(piece, finished=i == len(token_pieces(tok, TWO_CALLS)))
        thought += r
        d = parser.feed(c)
        content += d.content or ""
        deltas += d.tool_calls
    deltas += parser.finish().tool_calls
    assert (thought, content) == (THINK, PREAMBLE)
    assert [(d.index, d.name) for d in deltas if d.id] == [(0, "get_weather"), (1, "get_time")]
    args = ["".join(d.arguments or "" for d in deltas if d.index == i) for i in (0, 1)]
    assert [json.loads(a) for a in args] == [json.loads(ARGS), {}]
    assert sum(1 for d in deltas if d.index == 0 and not d.id) > 5  # streamed, not held back


def test_the_route_glue(reasoning):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert default_tool_parser(HARMONY_TEMPLATE) == "openai"
    assert needs_special_tokens(req, template=HARMONY_TEMPLATE) and reads_harmony_calls(req, template=HARMONY_TEMPLATE)
    assert not reads_harmony_calls(req, "hermes")
    none = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none")
    assert not reads_harmony_calls(none, "openai")
    # chat, not streamed: the answer after the reasoning parser, then the tool parser
    _, answer = reasoning.split(HARMONY_TOOL_REPLY, tool_calls=True)
    content, calls = parse_tool_calls(answer, req, "openai")
    assert content == PREAMBLE and calls is not None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("get_weather", ARGS)]
    # chat, streamed
    stream = ToolStream(req, "openai")
    delta = stream.step(answer, finished=True) or {}
    assert delta["content"] == PREAMBLE and delta["tool_calls"][0]["function"]["name"] == "get_weather"
    assert stream.tools_called
    # /v1/responses and /v1/messages: blocks
    tools = ToolRequest(tools=TOOLS, tool_choice="auto")
    blocks = split_reply(answer, tools, HARMONY_TEMPLATE)
    assert [(b.kind, b.text or b.name) for b in blocks] == [("text", PREAMBLE), ("tool_call", "get_weather")]
    assert blocks[1].arguments_complete
    events = BlockStream(tools, HARMONY_TEMPLATE).step(answer, finished=True)
    assert [e.kind for e in events] == ["start", "delta", "stop", "start", "delta", "stop"]
