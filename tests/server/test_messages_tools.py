"""Tool use and assistant prefill on /v1/messages, through the official `anthropic` client."""

from __future__ import annotations

import json
import urllib.request

import anthropic
import pytest

MODEL = "smol"
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


@pytest.fixture(scope="module")
def client(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def forced_call(client) -> anthropic.types.Message:
    return client.messages.create(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice=ONE_CALL,
                                  messages=ASK, **GREEDY)


def test_tool_choice_any_returns_a_tool_use_block(forced_call):
    msg = forced_call
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["tool_use"]
    call = msg.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    assert isinstance(call.input, dict) and isinstance(call.input["city"], str)


def test_tool_use_streams_input_json_deltas(client, forced_call):
    with client.messages.stream(model=MODEL, max_tokens=60, tools=[WEATHER], tool_choice=ONE_CALL,
                                messages=ASK, **GREEDY) as stream:
        events = [e for e in stream if e.type not in ("text", "input_json")]  # drop the SDK's own events
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert events[1].content_block.type == "tool_use" and events[1].content_block.name == "get_weather"
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert len(deltas) > 1 and all(d.type == "input_json_delta" for d in deltas)
    assert json.loads("".join(d.partial_json for d in deltas)) == forced_call.content[0].input
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.stop_reason == "tool_use" and final.content[0].input == forced_call.content[0].input


def test_named_tool_cut_by_max_tokens_is_not_a_call(client):
    msg = client.messages.create(model=MODEL, max_tokens=3, tools=[WEATHER],
                                 tool_choice={"type": "tool", "name": "get_weather"}, messages=ASK, **GREEDY)
    assert msg.stop_reason == "max_tokens"
    assert all(b.type == "text" for b in msg.content), msg.content  # never a tool_use with half its input


def test_tool_choice_auto_streams_what_it_returns(client):
    # With auto the model may answer in text or call; the stream must carry the same blocks either way
    # (text through the tool parser's hold-back of a possible <tool_call> start).
    kwargs = {"model": MODEL, "max_tokens": 40, "tools": [WEATHER], "messages": ASK, **GREEDY}
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [
        {**b.model_dump(), **({"id": final.content[i].id} if b.type == "tool_use" else {})}
        for i, b in enumerate(whole.content)]
    assert final.stop_reason == whole.stop_reason
    called = any(b.type == "tool_use" for b in whole.content)
    assert whole.stop_reason in (("tool_use", "max_tokens") if called else ("end_turn", "max_tokens"))


def test_tool_result_goes_into_the_next_turn(client, forced_call):
    call = forced_call.content[0]

    def turn(result: str) -> list[dict]:
        return [*ASK, {"role": "assistant", "content": [call.model_dump(include={"type", "id", "name", "input"})]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]

    short = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turn("Sunny"))
    longer = client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turn("Sunny, 24 degrees Celsius"))
    assert longer.input_tokens > short.input_tokens
    msg = client.messages.create(model=MODEL, max_tokens=40, tools=[WEATHER],
                                 messages=turn("Sunny, 24 degrees Celsius"), **GREEDY)
    assert msg.content[0].type == "text" and "24" in msg.content[0].text, msg.content


def test_tools_enter_the_prompt_also_under_choice_none(client):
    """As vLLM renders them: tool_choice none only means no call is read from the reply (a server started
    with --exclude-tools-when-tool-choice-none leaves them out: tests/server/test_launch_flags.py)."""
    plain = client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER]).input_tokens
    none = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER],
                                        tool_choice={"type": "none"}).input_tokens
    assert with_tools > plain + 20 and none == with_tools


def test_assistant_prefill_is_continued(client, base_url):
    prefill = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": prefill}]
    msg = client.messages.create(model=MODEL, max_tokens=12, messages=messages, **GREEDY)
    text = msg.content[0].text
    assert "Paris" in text and not text.lstrip().startswith("The capital"), text
    # The same continuation as chat's continue_final_message (no new assistant turn).
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    req = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.load(resp)["choices"][0]["message"]["content"] == text


@pytest.mark.parametrize(("extra", "named"), [
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"tools": [{**WEATHER, "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}],
      "tool_choice": {"type": "any"}}, "tools"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 1024}}, "budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, extra, named):
    kwargs = {"model": MODEL, "max_tokens": 5, "messages": ASK, **extra}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**kwargs)
    assert named in info.value.message


def test_thinking_on_a_model_that_does_not_think(client):
    """Claude Code sends `thinking` enabled by default; served without --reasoning-parser the model does
    not think: the request is answered as without it (a cap it cannot exceed), no thinking block."""
    plain = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, extra_body={"temperature": 0})
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}):
        msg = client.messages.create(model=MODEL, max_tokens=6, messages=ASK, thinking=thinking,
                                     extra_body={"temperature": 0})
        assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == plain.content[0].text
