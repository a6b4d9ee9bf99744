"""Offline LLM.chat(tools=...) on the embedded SmolLM2, whose chat template ignores `tools`: the
tools reach the prompt through the system message, the same rewrite the server does."""

from __future__ import annotations

import pytest
from ferrox import SamplingParams
from ferrox.structured.tools import prepare_tool_messages, template_supports_tools

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_chat_puts_tools_into_the_prompt(llm):
    tokenizer = llm.get_tokenizer()
    template = tokenizer.get_chat_template(None, TOOLS)
    assert not template_supports_tools(template)  # else the template itself would list the tools

    params = SamplingParams(temperature=0, max_tokens=1)
    (with_tools,) = llm.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS)
    (without,) = llm.chat(MESSAGES, params, use_tqdm=False)
    assert "get_weather" in with_tools.prompt and "<tools>" in with_tools.prompt
    assert "get_weather" not in without.prompt
    assert "get_weather" in tokenizer.decode(with_tools.prompt_token_ids)
    # The same text the server renders: the shared helper, then the template without tools.
    messages, tools = prepare_tool_messages(MESSAGES, TOOLS, template)
    assert tools is None and messages[0]["role"] == "system"
    assert with_tools.prompt == tokenizer.apply_chat_template(messages, chat_template=template)


def test_chat_tool_history_and_bad_tools(llm):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    ]
    (out,) = llm.chat(history, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False, tools=TOOLS)
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in out.prompt
    assert '"arguments": {"city": "Paris"}' in out.prompt and "None" not in out.prompt
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False, tools=[{"type": "function"}])
