"""POST /v1/responses through the official `openai` client's `responses.create`, streamed and not."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

MODEL = "smol"
# "Answer in English.": with this system prompt the embedded model otherwise sits near a tie between an
# English and a French answer (0.1 nats), which its int8-activation CPU path may tip either way.
QUESTION = "What is the capital of France? Answer in English."
SYSTEM = "You are a helpful assistant."
WEATHER = {
    "type": "function", "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def answer(client):
    return client.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=24,
                                   temperature=0)


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def test_text_input_with_instructions(client, answer):
    assert answer.object == "response" and answer.id.startswith("resp_") and answer.model == MODEL
    assert answer.status in ("completed", "incomplete")
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output[0].role == "assistant" and answer.output[0].content[0].type == "output_text"
    assert "Paris" in answer.output_text
    # instructions are the system message: the same text as chat with that system prompt.
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], 24)
    assert answer.output_text == chat.choices[0].message.content
    usage = answer.usage
    assert usage.input_tokens > 5 and 0 < usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert answer.instructions == SYSTEM and answer.max_output_tokens == 24 and answer.temperature == 0


def test_streaming_event_sequence(client, answer):
    events = list(client.responses.create(model=MODEL, input=QUESTION, instructions=SYSTEM, max_output_tokens=24,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    end = "response.completed" if answer.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done", end,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == answer.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == answer.output_text and final.usage.output_tokens == answer.usage.output_tokens
    assert events[2].item.id == events[-2].item.id == final.output[0].id


def test_output_text_logprobs_as_chat_reports_them(client):
    """include ["message.output_text.logprobs"] + top_logprobs: each output token's logprob and its top
    alternatives on the output_text part (OpenAI's shape), the same as chat's for the same prompt; a
    stream's deltas carry them as their text comes, its done event all of them."""
    kwargs = {"model": MODEL, "input": QUESTION, "instructions": SYSTEM, "max_output_tokens": 8, "temperature": 0,
              "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    resp = client.responses.create(**kwargs)
    entries = resp.output[0].content[0].logprobs
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    ref = chat.choices[0].logprobs.content
    assert len(entries) == len(ref) == resp.usage.output_tokens
    for got, want in zip(entries, ref, strict=True):
        assert got.token == want.token and got.bytes == want.bytes and abs(got.logprob - want.logprob) < 1e-4
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [e.token for e in entries]
    # (the end-of-sequence token brings no text, so no delta: the done event has it)
    assert [lp.token for lp in streamed] == [e.token for e in entries][:len(streamed)] and len(streamed) >= len(entries) - 1
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as info:  # without the include, top_logprobs would do nothing
        client.responses.create(model=MODEL, input="hi", max_output_tokens=2, top_logprobs=3)
    assert info.value.body["param"] == "top_logprobs"


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=5, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5 and resp.output[0].status == "incomplete"


def test_message_list_input(client):
    history = [
        {"role": "developer", "content": SYSTEM},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi! My name is Ada."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada!"}]},
        {"role": "user", "content": "What is my name?"},
    ]
    resp = client.responses.create(model=MODEL, input=history, max_output_tokens=16, temperature=0)
    chat = _chat(client, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi! My name is Ada."},
                          {"role": "assistant", "content": "Hello Ada!"},
                          {"role": "user", "content": "What is my name?"}], 16)
    # Rendered as chat renders the same conversation: same prompt, same greedy answer.
    assert resp.usage.input_tokens == chat.usage.prompt_tokens > 30
    assert resp.output_text == chat.choices[0].message.content


def test_function_call_and_its_output(client):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    resp = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    assert resp.status == "completed" and [item.type for item in resp.output] == ["function_call"]
    call = resp.output[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    follow = [*ask, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees Celsius"}]
    after = client.responses.create(model=MODEL, input=follow, tools=[WEATHER], max_output_tokens=40, temperature=0)
    assert after.usage.input_tokens > resp.usage.input_tokens + 20
    assert "24" in after.output_text, after.output_text


def test_function_call_streams(client):
    with client.responses.stream(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.name == "get_weather"
    call = final.output[0]
    assert "".join(deltas) == call.arguments and isinstance(json.loads(call.arguments)["city"], str)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    resp = client.responses.create(
        model=MODEL, input="Make up a person.", max_output_tokens=60, temperature=0,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"reasoning": {"summary": "detailed"}}, "reasoning.summary"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
])
def test_unsupported_fields_are_refused_by_name(client, extra, param):
    kwargs = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_without_the_store_its_fields_and_routes_name_the_variable(client, base_url):
    """The shared server runs without VLLM_ENABLE_RESPONSES_API_STORE: store / previous_response_id /
    background are refused by name, and the store's routes answer 404, each saying how to turn it on."""
    for extra in ({"store": True}, {"previous_response_id": "resp_1"}, {"background": True}):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=4, **extra)
        assert info.value.body["param"] == next(iter(extra))
        assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in info.value.body["message"]
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        req = urllib.request.Request(f"{base_url}/v1/responses/resp_1{path}", method=method)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 404
        assert "VLLM_ENABLE_RESPONSES_API_STORE=1" in json.loads(err.value.read())["error"]["message"]


def test_off_values_of_unserved_fields_pass(client):
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False, include=[],
                                   top_p=0.5, metadata={"k": "v"})
    assert resp.store is False and resp.top_p == 0.5 and resp.metadata == {"k": "v"}


def test_reasoning_effort_and_echoed_reasoning_items():
    """reasoning.effort is the chat template's reasoning_effort (and enable_thinking), as on chat; an
    earlier response's reasoning item sent back in `input` goes to the following assistant turn's
    reasoning_content (agent SDKs send the whole earlier output back)."""
    from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}],
         "encrypted_content": None, "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "Sunny."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
        {"role": "user", "content": "thanks"},
    ], "reasoning": {"effort": "none", "summary": "auto"}})
    messages = req.to_chat_messages()
    assert [(m["role"], m.get("reasoning_content")) for m in messages] == [
        ("user", None), ("assistant", "Look."), ("tool", None), ("assistant", "Sunny."), ("user", None)]
    assert req.template_kwargs() == {"reasoning_effort": "none", "enable_thinking": False}


def test_codex_shaped_request_fields():
    """What Codex sends with store=false: prompt_cache_key, include ["reasoning.encrypted_content"] (ferrox's
    reasoning items then carry their text as encrypted_content, and such an item sent back without its
    content still reaches the template), safety_identifier. Other include values are refused by name."""
    import pydantic
    from ferrox.entrypoints.openai.protocol_responses import ResponsesRequest, encrypt_reasoning

    base = {"input": "hi", "store": False, "prompt_cache_key": "thread-1", "safety_identifier": "u1",
            "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "low", "summary": "auto"},
            "tool_choice": "auto", "parallel_tool_calls": True}
    req = ResponsesRequest.model_validate(base)
    assert req.refused_fields() == [] and req.includes_encrypted_reasoning
    echoed = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encrypt_reasoning("Think ü.")},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A."}]},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAB-another-providers"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "B."}]},
    ]})
    assert [m.get("reasoning_content") for m in echoed.to_chat_messages()] == [None, "Think ü.", None]
    with pytest.raises(pydantic.ValidationError, match="include"):
        ResponsesRequest.model_validate({**base, "include": ["file_search_call.results"]})
    with pytest.raises(pydantic.ValidationError, match="encrypted_content"):
        ResponsesRequest.model_validate({"input": [{"type": "reasoning", "id": "r",
                                                     "encrypted_content": "ferrox-reasoning-v1:%%%"}]})
