"""POST /v1/responses under `--reasoning-parser deepseek_r1`, through the official `openai` client:
the thinking is a `reasoning` item before the message / function_call items, which are read from
the answer after `</think>` alone; usage counts the thinking's tokens; streamed, the reasoning
item's events come first and the answer's items follow at output index 1.

/v1/responses takes neither a seed nor a logit_bias, so the requests decode greedily (temperature
0: the same tokens on every route). A random model's greedy output hardly ever picks `</think>`,
so the tiny Qwen3's output row for it is scaled x2 (untied lm_head): then some prompts think for a
couple of tokens and close the thinking; one is found by trying prompts through chat (each try a
few milliseconds), whose `reasoning` / `content` split the Responses items must match."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator

import openai
import pytest
from openai.types.responses import (
    ResponseFunctionToolCall,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
)
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import make_tiny_qwen3
from tests.server.server_proc import ServerProcess, openai_client

MODEL = "tiny-reasoner"
END = 385  # </think> in the tiny tokenizer (QWEN_TEXT_TOKENS after the 384 trained ids)
MAX_TOKENS = 16
# An enum: a random model would write a free string until max_output_tokens.
WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["parameters"]}}
# The words of the questions asked with the tools (wordy_questions).
WORDS = ("weather", "Paris", "Oslo", "rain", "sun", "cold", "hot", "city", "today", "now", "why", "how")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("reasoner") / "model", qwen_tokens=True,
                             tie_word_embeddings=False)
    path = os.path.join(folder, "model.safetensors")
    weights = load_file(path)
    weights["lm_head.weight"][END] *= 2.0  # greedy decoding closes the thinking for some prompts
    save_file(weights, path, metadata={"format": "pt"})
    srv = ServerProcess(folder, "--reasoning-parser", "deepseek_r1", "--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def chat(client: openai.OpenAI, question: str, max_tokens: int = MAX_TOKENS, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                          max_tokens=max_tokens, temperature=0,
                                          extra_body={"return_token_ids": True}, **kw)


def respond(client: openai.OpenAI, question: str, max_output_tokens: int = MAX_TOKENS, **kw):
    return client.responses.create(model=MODEL, input=question, max_output_tokens=max_output_tokens,
                                   temperature=0, **kw)


def find_thinker(client: openai.OpenAI, questions: Iterable[str], closes_once: bool = True,
                 max_tokens: int = MAX_TOKENS, **kw):
    """The first question whose greedy output thinks for 2+ tokens and closes the thinking (once, and
    answers after it, with closes_once): (the question, its chat completion, the output's token ids)."""
    for question in questions:
        resp = chat(client, question, max_tokens, **kw)
        ids = resp.choices[0].model_extra["token_ids"]
        thinks = END in ids and ids.index(END) >= 2
        if thinks and (not closes_once or (ids.count(END) == 1 and ids.index(END) < len(ids) - 2)):
            return question, resp, ids
    pytest.fail("no question gives a thinking of 2+ tokens closed by </think>")


def wordy_questions(n: int) -> Iterator[str]:
    """Forty seeded words each: with the tools' long system prompt in front, a short question hardly
    moves the tiny model's greedy output."""
    for seed in range(n):
        rng = random.Random(seed)
        yield " ".join(rng.choice(WORDS) for _ in range(40))


@pytest.fixture(scope="module")
def thinker(client):
    return find_thinker(client, (f"Question {i}?" for i in range(300)))


@pytest.fixture(scope="module")
def answer(client, thinker):
    return respond(client, thinker[0])


def test_reasoning_item_before_the_message(client, thinker, answer):
    question, completion, ids = thinker
    message = completion.choices[0].message
    assert message.model_extra["reasoning"] and message.content  # the chat route's split of the same tokens
    assert [type(item) for item in answer.output] == [ResponseReasoningItem, ResponseOutputMessage]
    reasoning = answer.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.summary == [] and reasoning.status == "completed"
    assert [(part.type, part.text) for part in reasoning.content] == [("reasoning_text", message.model_extra["reasoning"])]
    assert answer.output_text == message.content
    assert "</think>" not in answer.output_text + reasoning.content[0].text
    usage = answer.usage
    assert usage.output_tokens_details.reasoning_tokens == ids.index(END)  # the tokens before </think>
    assert usage.output_tokens == len(ids) and usage.input_tokens == completion.usage.prompt_tokens
    assert answer.status == ("incomplete" if completion.choices[0].finish_reason == "length" else "completed")


def test_streamed_reasoning_events(client, thinker, answer):
    events = list(respond(client, thinker[0], stream=True))
    kinds = [e.type for e in events]
    thoughts = kinds.count("response.reasoning_text.delta")
    texts = kinds.count("response.output_text.delta")
    assert thoughts >= 1 and texts >= 1
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", *["response.reasoning_text.delta"] * thoughts,
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * texts,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        f"response.{answer.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added, deltas, done, item_done = events[2], events[3:3 + thoughts], events[3 + thoughts], events[4 + thoughts]
    assert isinstance(added, ResponseOutputItemAddedEvent) and isinstance(added.item, ResponseReasoningItem)
    assert added.output_index == 0 and added.item.status == "in_progress" and not added.item.content
    rs_id = added.item.id
    assert all(isinstance(e, ResponseReasoningTextDeltaEvent) for e in deltas)
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(rs_id, 0, 0)}
    thinking = "".join(e.delta for e in deltas)
    assert thinking == answer.output[0].content[0].text
    assert isinstance(done, ResponseReasoningTextDoneEvent) and (done.item_id, done.output_index, done.text) == \
        (rs_id, 0, thinking)
    assert isinstance(item_done, ResponseOutputItemDoneEvent) and item_done.output_index == 0
    assert item_done.item == ResponseReasoningItem(id=rs_id, type="reasoning", summary=[], status="completed",
                                                   content=[{"type": "reasoning_text", "text": thinking}])
    # The message after it, at output index 1.
    message_events = events[5 + thoughts:-1]
    assert {e.output_index for e in message_events} == {1}
    text = "".join(e.delta for e in message_events if e.type == "response.output_text.delta")
    assert text == answer.output_text
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].id == rs_id and final.output[0].content[0].text == thinking
    assert final.output_text == text
    assert final.usage.output_tokens_details.reasoning_tokens == answer.usage.output_tokens_details.reasoning_tokens
    assert final.usage.output_tokens == answer.usage.output_tokens
    # The client's stream helper, which checks each event against the items it has seen, takes it too.
    with client.responses.stream(model=MODEL, input=thinker[0], max_output_tokens=MAX_TOKENS, temperature=0) as s:
        helped = list(s)
    assert [e.type for e in helped] == kinds
    assert helped[-1].response.output[0].content[0].text == thinking


def test_thinking_cut_short(client, thinker):
    """max_output_tokens inside the thinking: the reasoning item alone, incomplete, all of it reasoning."""
    question, _, ids = thinker
    k = ids.index(END)
    resp = respond(client, question, max_output_tokens=k)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["reasoning"] and resp.output[0].status == "incomplete"
    assert resp.usage.output_tokens_details.reasoning_tokens == k == resp.usage.output_tokens
    events = list(respond(client, question, max_output_tokens=k, stream=True))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-4:] == [
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.output_item.done",
        "response.incomplete"]
    assert events[-2].item.status == "incomplete"
    assert events[-3].text == resp.output[0].content[0].text
    assert events[-1].response.output[0].content[0].text == resp.output[0].content[0].text


def test_prompt_that_closed_the_thinking(client):
    """A prompt whose last tag is `</think>` has no thinking left: no reasoning item, 0 reasoning tokens."""
    resp = respond(client, "Answer at once.<think></think>")
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage.output_tokens_details.reasoning_tokens == 0
    events = list(respond(client, "Answer at once.<think></think>", stream=True))
    assert not any("reasoning" in e.type for e in events) and events[2].output_index == 0
    assert events[-1].response.output_text == resp.output_text


def test_function_call_read_from_the_answer(client):
    """tool_choice required: the call's grammar starts at `</think>`, so the thinking is sampled as
    without it and the call is the answer, the item after the reasoning."""
    # The call's grammar waits for `</think>`, which is all the search needs (tool_choice auto, same prompt).
    question, completion, ids = find_thinker(client, wordy_questions(200), closes_once=False, max_tokens=8,
                                             tools=[CHAT_WEATHER])
    resp = respond(client, question, max_output_tokens=80, tools=[WEATHER], tool_choice="required",
                   parallel_tool_calls=False)
    assert resp.status == "completed", resp
    assert [type(item) for item in resp.output] == [ResponseReasoningItem, ResponseFunctionToolCall]
    assert resp.output[0].content[0].text == completion.choices[0].message.model_extra["reasoning"]
    call = resp.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert resp.usage.output_tokens_details.reasoning_tokens == ids.index(END)
    events = list(respond(client, question, max_output_tokens=80, tools=[WEATHER], tool_choice="required",
                          parallel_tool_calls=False, stream=True))
    calls = [e for e in events if e.type.startswith("response.function_call_arguments")]
    assert calls and {e.output_index for e in calls} == {1}
    assert calls[-1].arguments == call.arguments
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == resp.output[0].content[0].text


def test_output_sent_back_as_input(client, thinker, answer):
    """An agent's next turn sends the earlier output back, reasoning item included (as the agent SDKs
    and Codex do), with reasoning.effort: the server takes both."""
    turn = [{"role": "user", "content": thinker[0]}, *[item.model_dump(exclude_none=True) for item in answer.output],
            {"role": "user", "content": "And then?"}]
    resp = client.responses.create(model=MODEL, input=turn, max_output_tokens=4, temperature=0,
                                   reasoning={"effort": "high", "summary": "auto"})
    assert resp.status in ("completed", "incomplete") and resp.output


def test_codex_request_with_encrypted_reasoning(client, thinker):
    """Codex's request shape (store false, prompt_cache_key, include reasoning.encrypted_content, summary
    auto): the reasoning item carries its text as encrypted_content (streamed too), and the next turn
    may send the item back with that alone (its text reaching the template: test_responses.py)."""
    from ferrox.entrypoints.openai.protocol_responses import ReasoningItem

    extra = {"store": False, "prompt_cache_key": "thread-42", "include": ["reasoning.encrypted_content"],
             "reasoning": {"effort": "medium", "summary": "auto"}, "parallel_tool_calls": True}
    first = respond(client, thinker[0], **extra)
    reasoning = first.output[0]
    assert reasoning.type == "reasoning" and first.prompt_cache_key == "thread-42"
    blob = reasoning.encrypted_content
    assert ReasoningItem(type="reasoning", encrypted_content=blob).text() == reasoning.content[0].text
    events = list(respond(client, thinker[0], stream=True, **extra))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "reasoning"]
    assert [item.encrypted_content for item in done] == [blob]
    turn = [{"role": "user", "content": thinker[0]},
            {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": blob},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
            {"role": "user", "content": "And then?"}]
    assert client.responses.create(model=MODEL, input=turn, max_output_tokens=2, temperature=0,
                                   **extra).status in ("completed", "incomplete")
