"""GLM-4.7 through a real `ferrox serve --reasoning-parser glm47` (engine, Rust core, official `openai` client):
a tiny random Qwen3 whose tokenizer has `<think>` / `</think>` / `<tool_call>` / `</tool_call>` as added text
tokens, served with a GLM-4.7-style chat template (the prompt ends with `<|assistant|><think>`, or
`<|assistant|></think>` for `enable_thinking: false`; calls are written `<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value>...` with no newlines) and no --tool-call-parser: the template picks `glm47`.

- Thinking on: the model thinks until it samples `</think>` (a logit bias and a seed found by trying); a
  guided_choice then forces an answer with two calls in GLM-4.7's format (one with a literal `\\n` between a
  key and its value, as GLM-4.7 may write it); the values are typed by the request's tools.
- Thinking off: the prompt closed the thinking; the guided reply is all answer.
- A `<tool_call>` sampled before any `</think>` ends the thinking: the rest is the answer's."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.tiny_models import make_tiny_qwen3
from tests.server.server_proc import served_openai_client

MODEL = "tiny-glm47"
END, TOOL_CALL = 385, 386  # </think> and <tool_call> in the tiny tokenizer (after the 384 trained ids)
TEMPLATE = (
    "[gMASK]<sop>{% if tools %}<|system|>\n# Tools\n\nFor each function call, output the function name and arguments "
    "within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value>...</tool_call>{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|assistant|></think>' + (m['content'] or '') }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{{ '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' }}{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "alerts": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
REPLY = ("Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>São Paulo</arg_value><arg_key>days"
         "</arg_key>\\n<arg_value>2</arg_value><arg_key>alerts</arg_key><arg_value>true</arg_value></tool_call>"
         "<tool_call>get_time</tool_call>")
EXPECTED = [("get_weather", {"city": "São Paulo", "days": 2, "alerts": True}), ("get_time", {})]
QUESTION = [{"role": "user", "content": "Weather in São Paulo, and the time?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("glm47") / "model", qwen_tokens=True)
    yield from served_openai_client(folder, "--reasoning-parser", "glm47", "--served-model-name", MODEL,
                                         "--chat-template", TEMPLATE)


def ask(client: openai.OpenAI, **kw):
    body: dict = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=400, temperature=1.0)
    body.update(kw)
    return client.chat.completions.create(**body)


def streamed(client: openai.OpenAI, **kw) -> tuple[str, str, list[tuple[str, dict]], str | None]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in ask(client, stream=True, **kw):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    return reasoning, content, [(calls[i][0], json.loads(calls[i][1])) for i in sorted(calls)], finish


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_thinking_then_tool_calls(client):
    for seed in range(100):
        resp = ask(client, seed=seed, logit_bias={str(END): 3.0},
                   extra_body={"guided_choice": [REPLY], "return_token_ids": True})
        ids = resp.choices[0].model_extra["token_ids"]
        if END in ids[2:40] and TOOL_CALL not in ids[:ids.index(END)]:
            break
    else:
        pytest.fail("no seed thinks for 2+ tokens, then closes the thinking")
    choice = resp.choices[0]
    thought = choice.message.model_extra["reasoning"]
    assert thought and "</think>" not in thought
    assert choice.message.content == "Checking." and calls_of(choice.message) == EXPECTED
    assert choice.finish_reason == "tool_calls"
    assert resp.usage.completion_tokens_details.reasoning_tokens == ids.index(END)
    reasoning, content, calls, finish = streamed(client, seed=seed, logit_bias={str(END): 3.0},
                                                 extra_body={"guided_choice": [REPLY]})
    assert (reasoning, content.strip(), calls, finish) == (thought, "Checking.", EXPECTED, "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_is_all_answer(client, stream):
    kw = dict(seed=0, extra_body={"guided_choice": [REPLY], "chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        assert streamed(client, **kw) == ("", "Checking.", EXPECTED, "tool_calls")
        return
    message = ask(client, **kw).choices[0].message
    assert message.model_extra["reasoning"] is None and message.content == "Checking."
    assert calls_of(message) == EXPECTED


def test_a_tool_call_ends_the_thinking(client):
    """A `<tool_call>` the model opens while still thinking ends the thinking (vLLM's glm45 / glm47 rule)."""
    for seed in range(200):
        resp = ask(client, seed=seed, tools=None, max_tokens=24, logit_bias={str(TOOL_CALL): 3.0},
                   extra_body={"return_token_ids": True})
        ids = resp.choices[0].model_extra["token_ids"]
        if TOOL_CALL in ids[2:20] and END not in ids[:ids.index(TOOL_CALL)]:
            break
    else:
        pytest.fail("no seed thinks for 2+ tokens, then opens a tool call")
    message = resp.choices[0].message
    thought, answer = message.model_extra["reasoning"], message.content
    assert thought and "<tool_call>" not in thought and answer.startswith("<tool_call>")
    assert resp.usage.completion_tokens_details.reasoning_tokens == ids.index(TOOL_CALL)
    reasoning, content, _, _ = streamed(client, seed=seed, tools=None, max_tokens=24,
                                        logit_bias={str(TOOL_CALL): 3.0})
    assert (reasoning, content) == (thought, answer)
