"""DeepSeek-V3's tool calls through a real `ferrox serve` (engine, Rust core, official `openai` client): a
tiny random Llama served with a DeepSeek-V3-style chat template and no --tool-call-parser, so the server
picks `deepseek_v3` from the template's markers. A guided_choice of one reply steers the random model to
write exactly that reply, in DeepSeek's format (the tiny tokenizer is byte-level: it spells the fullwidth
markers byte by byte); the chat route then returns the calls, whole and streamed."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.tiny_models import make_tiny_llama
from tests.server.server_proc import served_openai_client

MODEL = "tiny-deepseek-tools"
# The tool-call part of DeepSeek-V3's template: an assistant turn's calls written back in its format.
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% if m.get('tool_calls') %}{{ '<｜tool▁calls▁begin｜>' }}{% for tool in m['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n'"
    " + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>' }}{% endfor %}"
    "{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
    "{% else %}{{ m['content'] or '' }}{% endif %}{% endfor %}"
    "{% if tools %}{% endif %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ARGUMENTS = '{"city": "São Paulo", "days": 2}'
REPLY = ("Checking. <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         + ARGUMENTS + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```"
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
EXPECTED = [("get_weather", ARGUMENTS), ("get_time", "{}")]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("deepseek_tools") / "model")
    yield from served_openai_client(folder, "--served-model-name", MODEL, "--chat-template", TEMPLATE)


def ask(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in São Paulo, and the time?"}], tools=TOOLS,
        max_tokens=600, temperature=0.0, extra_body={"guided_choice": [REPLY]}, **kw)


def test_calls_read_from_the_reply(client):
    choice = ask(client).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == EXPECTED
    assert all(c.type == "function" and c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    assert json.loads(calls[0].function.arguments)["city"] == "São Paulo"


def test_calls_streamed(client):
    content, calls, finish = "", {}, None
    for chunk in ask(client, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.id.startswith("call_") and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
    assert content.strip() == "Checking." and finish == "tool_calls"
    assert [tuple(calls[i]) for i in sorted(calls)] == EXPECTED
    assert "｜" not in content  # no marker leaked into the content
