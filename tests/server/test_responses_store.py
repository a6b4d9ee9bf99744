"""Stored responses of /v1/responses (VLLM_ENABLE_RESPONSES_API_STORE=1) through the `openai` client:
previous_response_id, retrieve / delete / input_items, background mode with polling and cancel, and the
store's LRU bound. The store-off refusals are in test_responses.py (the shared server runs without it)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.server.server_proc import ServerProcess
from tests.server.test_metrics_disconnect import scrape, value

MODEL = "smol"
MAX_ENTRIES = 5  # the store's bound on this server (FERROX_RESPONSES_STORE_MAX_ENTRIES)
SYSTEM = "You are a helpful assistant."
# Decoding cannot close this object before 500 numbers, far more than max_output_tokens allows: a
# background request that is surely still running when it is cancelled.
ENDLESS = {"type": "json_schema", "name": "numbers", "schema": {
    "type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}, "minItems": 500}},
    "required": ["numbers"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def store_server():
    srv = ServerProcess("--served-model-name", MODEL,
                        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1",
                             "FERROX_RESPONSES_STORE_MAX_ENTRIES": str(MAX_ENTRIES)})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(store_server):
    with openai.OpenAI(base_url=store_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _create(client, **kwargs):
    return client.responses.create(model=MODEL, temperature=0, **{"max_output_tokens": 8, **kwargs})


def _http(base_url: str, method: str, path: str) -> tuple[int, dict]:
    req = urllib.request.Request(base_url + path, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_chained_turn_is_the_whole_conversation(client):
    """previous_response_id renders the earlier turn's input and output before the new input: the same
    prompt (input_tokens) and greedy answer as sending the whole conversation; the earlier turn's
    instructions do not carry over (OpenAI's rule, vLLM's too), this request's apply."""
    first = _create(client, input="Hi! My name is Ada.", instructions=SYSTEM)
    assert first.store is True and first.previous_response_id is None  # stored by default, as OpenAI
    ask = {"role": "user", "content": "What is my name?"}
    whole = [{"role": "user", "content": "Hi! My name is Ada."}, *[o.model_dump(exclude_none=True) for o in first.output],
             ask]
    for instructions in (SYSTEM, None):
        extra = {"instructions": instructions} if instructions else {}
        chained = _create(client, input=[ask], previous_response_id=first.id, **extra)
        sent = _create(client, input=whole, store=False, **extra)
        assert chained.previous_response_id == first.id and sent.store is False
        assert chained.usage.input_tokens == sent.usage.input_tokens > first.usage.input_tokens
        assert chained.output_text == sent.output_text
    # A chain of chains: the third turn sees both earlier ones (a text input is one user message).
    second = _create(client, input="What is my name?", previous_response_id=first.id, instructions=SYSTEM)
    third = _create(client, input="Thanks.", previous_response_id=second.id, instructions=SYSTEM)
    whole3 = [*whole, *[o.model_dump(exclude_none=True) for o in second.output], {"role": "user", "content": "Thanks."}]
    assert third.usage.input_tokens == _create(client, input=whole3, instructions=SYSTEM, store=False).usage.input_tokens


def test_retrieve_input_items_and_delete(client, store_server):
    first = _create(client, input="Hi! My name is Ada.")
    second = _create(client, input=[{"role": "user", "content": "What is my name?"}], previous_response_id=first.id)
    got = client.responses.retrieve(second.id)
    assert got.model_dump() == second.model_dump()
    # input_items: everything that produced the response, newest first by default (OpenAI's order).
    items = list(client.responses.input_items.list(second.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert items[0].content[0].text == "Hi! My name is Ada." and items[1].id == first.output[0].id
    assert [i.id for i in client.responses.input_items.list(second.id)] == [i.id for i in reversed(items)]
    paged = list(client.responses.input_items.list(second.id, order="asc", limit=1))  # follows `after`
    assert [i.id for i in paged] == [i.id for i in items]
    status, page = _http(store_server.base_url, "GET", f"/v1/responses/{second.id}/input_items?limit=2")
    assert status == 200 and page["object"] == "list" and page["has_more"] is True
    assert [page["first_id"], page["last_id"]] == [items[2].id, items[1].id]
    for query, param in (("order=up", "order"), ("limit=0", "limit"), ("after=nope", "after"), ("before=x", "before")):
        status, body = _http(store_server.base_url, "GET", f"/v1/responses/{second.id}/input_items?{query}")
        assert status == 400 and body["error"]["param"] == param, body
    # delete: the client's shape (it reads nothing back), then the id is gone; the chain after it stays.
    status, body = _http(store_server.base_url, "DELETE", f"/v1/responses/{first.id}")
    assert status == 200 and body == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert len(list(client.responses.input_items.list(second.id))) == 3
    assert client.responses.delete(second.id) is None


def test_store_false_and_streams(client):
    kept_not = _create(client, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_not.id)
    events = list(_create(client, input="Hi", stream=True))
    final = events[-1].response
    assert final.status in ("completed", "incomplete") and final.store is True
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()  # the stream's last object


def test_unknown_ids(client, store_server):
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve("resp_nope")
    assert info.value.body["message"] == "Response with id 'resp_nope' not found."  # vLLM's words
    with pytest.raises(openai.NotFoundError) as info:
        _create(client, input="hi", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"
    for method, path in (("POST", "/cancel"), ("GET", "/input_items"), ("DELETE", "")):
        status, body = _http(store_server.base_url, method, "/v1/responses/resp_nope" + path)
        assert status == 404 and "resp_nope" in body["error"]["message"], (method, path, body)


def test_background_polls_to_completed(client):
    queued = _create(client, input="Hi! My name is Ada.", background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == [] and queued.usage is None
    deadline = time.monotonic() + 60
    polled = client.responses.retrieve(queued.id)
    while polled.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
        polled = client.responses.retrieve(queued.id)
    assert polled.status in ("completed", "incomplete") and polled.usage.output_tokens > 0 and polled.output_text
    # The same answer as in the foreground; and a finished background response is not cancellable.
    assert polled.output_text == _create(client, input="Hi! My name is Ada.", store=False).output_text
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.BadRequestError, match="synchronous"):
        client.responses.cancel(_create(client, input="Hi").id)
    for extra, param in (({"store": False}, "background"), ({"stream": True}, "stream")):
        with pytest.raises(openai.BadRequestError) as info:
            _create(client, input="Hi", background=True, **extra)
        assert info.value.body["param"] == param


def test_background_cancel_aborts_and_frees_kv(client, store_server):
    base = store_server.base_url
    idle = scrape(base)
    idle_usage, aborted_before = value(idle, "ferrox:kv_cache_usage_perc"), _aborted(idle)
    started = _create(client, input="List numbers.", background=True, max_output_tokens=900,
                      text={"format": ENDLESS})
    deadline = time.monotonic() + 30
    while value(scrape(base), "ferrox:num_requests_running") < 1:  # in the engine, holding KV blocks
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.responses.retrieve(started.id).status == "in_progress"
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and cancelled.usage is None
    assert client.responses.retrieve(started.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while True:
        text = scrape(base)
        running, usage = value(text, "ferrox:num_requests_running"), value(text, "ferrox:kv_cache_usage_perc")
        if running == 0 and usage == idle_usage and _aborted(text) > aborted_before:
            break
        assert time.monotonic() < deadline, f"running={running} usage={usage} (idle {idle_usage})"
        time.sleep(0.1)
    with pytest.raises(openai.BadRequestError, match="cancelled"):
        client.responses.cancel(started.id)


def test_store_keeps_the_most_recently_used(client):
    """At most MAX_ENTRIES responses: the least recently used (created or read) is dropped first."""
    ids = [_create(client, input="Hi", max_output_tokens=1).id for _ in range(MAX_ENTRIES)]
    client.responses.retrieve(ids[0])  # now the most recently used
    ids.append(_create(client, input="Hi", max_output_tokens=1).id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:]):
        assert client.responses.retrieve(kept).id == kept


def _aborted(text: str) -> float:
    try:
        return value(text, "ferrox:request_success_total", finished_reason="abort")
    except AssertionError:
        return 0.0


WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_chained_function_call_and_its_output(client):
    """An agent's loop: the call comes in one response, its output goes back by previous_response_id."""
    ask = "What is the weather in Paris?"
    call_turn = _create(client, input=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                        max_output_tokens=60)
    call = call_turn.output[0]
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees Celsius"}
    chained = _create(client, input=[result], previous_response_id=call_turn.id, tools=[WEATHER], max_output_tokens=4)
    sent = _create(client, input=[{"role": "user", "content": ask}, call.model_dump(exclude_none=True), result],
                   tools=[WEATHER], max_output_tokens=4, store=False)
    assert chained.usage.input_tokens == sent.usage.input_tokens > call_turn.usage.input_tokens


def test_history_with_reasoning_renders_as_sent_whole():
    """A stored turn's reasoning item (under --reasoning-parser) reaches the next turn's assistant message
    as it would if the client had sent it back: with_history is the whole-conversation request."""
    from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest

    first = ResponsesRequest.model_validate({"input": "9.11 or 9.8?"})
    output = [{"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "Compare decimals."}]},
              {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
               "content": [{"type": "output_text", "text": "9.8", "annotations": [], "logprobs": []}]}]
    history = first.stored_input_items() + output
    assert [item["id"][:4] for item in history] == ["msg_", "rs_1", "msg_"]
    nxt = {"input": "Why?", "instructions": "Be brief."}
    chained = ResponsesRequest.model_validate({**nxt, "previous_response_id": "resp_1"}).with_history(history)
    whole = ResponsesRequest.model_validate({**nxt, "input": [*history, {"role": "user", "content": "Why?"}]})
    assert chained.to_chat_messages() == whole.to_chat_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "9.11 or 9.8?"},
        {"role": "assistant", "content": "9.8", "reasoning_content": "Compare decimals."},
        {"role": "user", "content": "Why?"}]
