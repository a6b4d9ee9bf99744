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


def test_chat_template_content_format(llm):
    """LLM.chat(chat_template_content_format=...) as vLLM's: a template that loops over a message's
    content gets OpenAI text parts ("auto" sees the loop), "string" joins them by newlines, and a
    non-text part is refused naming it."""
    from ferrox.errors import InvalidArgumentError

    template = ("{% for m in messages %}{% for p in m.content %}{% if p is mapping %}{{ p.text }}{% else %}{{ p }}"
                "{% endif %}|{% endfor %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]
    params = SamplingParams(temperature=0, max_tokens=1)
    (auto,) = llm.chat(parts, params, use_tqdm=False, chat_template=template)
    (string,) = llm.chat(parts, params, use_tqdm=False, chat_template=template, chat_template_content_format="string")
    assert (auto.prompt, string.prompt) == ("ab|c|", "a|b|\n|c|")
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]\.content\[0\]: content part type .video_url."):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}], params,
                 use_tqdm=False)
    # An image part on a text-only model is refused naming the part (multimodal/chat_parts.py).
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]\.content\[0\]: .* takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], params,
                 use_tqdm=False)
