"""POST /v1/messages through the official `anthropic` client."""

from __future__ import annotations

import anthropic
import pytest

MODEL = "smol"
# Recent anthropic SDKs dropped temperature/top_p/top_k from create(); the API still takes them.
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(base_url):
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


# "Answer in English.": with the system prompt alone the embedded model sits near a tie between an English
# and a French answer (0.1 nats), which its int8-activation CPU path may tip either way.
QUESTION = "What is the capital of France? Answer in English."


def test_message_non_streaming(client):
    msg = client.messages.create(
        model=MODEL, max_tokens=24, **GREEDY, system="You are a helpful assistant.",
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.content[0].type == "text" and "Paris" in msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 5 and 0 < msg.usage.output_tokens <= 24
    counted = client.messages.count_tokens(
        model=MODEL, system="You are a helpful assistant.",
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
    )
    # Anthropic's split: computed + read from the prefix cache = the prompt.
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert msg.usage.cache_creation_input_tokens == 0


def test_max_tokens_stop_reason(client):
    msg = client.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "Tell a story."}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_stop_sequence(client):
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    base = client.messages.create(model=MODEL, max_tokens=30, messages=messages, **GREEDY).content[0].text
    assert "5" in base, base
    msg = client.messages.create(model=MODEL, max_tokens=30, messages=messages, stop_sequences=["5"], **GREEDY)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "5"
    assert msg.content[0].text == base[: base.index("5")]


def test_streaming_event_sequence(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=messages, **GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=messages, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    raw = [k for k in kinds if k not in ("text",)]  # the SDK adds synthetic "text" events
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(raw[2:-3]) <= {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The stream came second: its prompt was read from the prefix cache, which message_start says.
    start = events[0].message.usage
    assert start.cache_read_input_tokens > 0
    assert start.input_tokens + start.cache_read_input_tokens == whole.usage.input_tokens + \
        whole.usage.cache_read_input_tokens


def test_output_config_format_constrains_the_reply(client):
    """output_config.format (Anthropic's structured outputs) holds the reply to the JSON schema, streamed
    and not; output_config.effort reaches the template; a format beside a forcing tool_choice, or a
    key ferrox does not know in output_config, is a 400 naming it."""
    import json

    import anthropic
    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"]}
    body = dict(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Plan a trip as JSON."}],
                output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"}, **GREEDY)
    msg = client.messages.create(**body)
    reply = json.loads(msg.content[0].text)
    jsonschema.validate(reply, schema)
    assert set(reply) == {"city", "days"}  # objects closed, as chat's response_format
    streamed = "".join(e.delta.text for e in client.messages.create(**body, stream=True)
                       if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert streamed == msg.content[0].text
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {}}}
    for extra, param in (({"tools": [tool], "tool_choice": {"type": "any"}}, "output_config.format"),
                         ({"output_config": {"task_budget": 5}}, "output_config.task_budget")):
        with pytest.raises(anthropic.BadRequestError) as info:
            client.messages.create(**{**body, **extra})
        assert param in str(info.value.body), info.value.body


def test_claude_codes_billing_header_is_not_in_the_prompt(client):
    """Claude Code's first system block carries a per-request hash (cch); kept, it would change every
    turn's first tokens and the prefix cache would never hit. The model never sees it."""
    from ferrox.entrypoints.anthropic.protocol import MessagesRequest

    def header(cch: str) -> str:
        return f"x-anthropic-billing-header: cc_version=2.1.100.7b4; cc_entrypoint=cli; cch={cch};"

    ask = [{"role": "user", "content": QUESTION}]
    blocks = [{"type": "text", "text": header("eb6c6")}, {"type": "text", "text": "You are a coding agent."}]
    req = MessagesRequest.model_validate({"max_tokens": 5, "messages": ask, "system": blocks})
    assert req.template_messages()[0] == {"role": "system", "content": "You are a coding agent."}
    inline = MessagesRequest.model_validate({"max_tokens": 5, "messages": ask,
                                             "system": header("71fea") + "\nYou are a coding agent."})
    assert inline.system_text() == "You are a coding agent."
    plain = client.messages.count_tokens(model=MODEL, system="You are a coding agent.", messages=ask).input_tokens
    for cch in ("eb6c6", "0aaa9"):
        system = [{"type": "text", "text": header(cch)}, {"type": "text", "text": "You are a coding agent."}]
        assert client.messages.count_tokens(model=MODEL, system=system, messages=ask).input_tokens == plain
    # Two turns with different hashes: the second reads the first's prompt blocks from the prefix cache.
    long_system = "You are a coding agent. " * 40
    usages = []
    for cch in ("1a2b3", "4c5d6"):
        system = [{"type": "text", "text": header(cch)}, {"type": "text", "text": long_system}]
        usages.append(client.messages.create(model=MODEL, max_tokens=2, system=system, messages=ask).usage)
    assert usages[1].cache_read_input_tokens >= usages[0].input_tokens + usages[0].cache_read_input_tokens - 16
