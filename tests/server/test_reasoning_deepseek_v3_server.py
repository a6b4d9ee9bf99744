"""`ferrox serve --reasoning-parser deepseek_v3` on a tiny random Qwen3 whose tokenizer has `<think>` /
`</think>` as added text tokens, served with DeepSeek-V3.1's thinking switch in its chat template (the
`thinking` variable: the prompt ends with `<think>` when on, `</think>` when off), through the official
`openai` client. Off (the default), the whole reply is the answer: a guided_choice forces it from the
first token. On, the model thinks until it samples `</think>` (a logit bias and a seed found by trying
make that a few tokens), and the guided answer after it comes back apart from the thinking, whole and
streamed alike."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.tiny_models import make_tiny_qwen3
from tests.server.server_proc import served_openai_client

MODEL = "tiny-deepseek-v31"
END = "385"  # </think> in the tiny tokenizer
REPLY = "The sky is blue."
# ChatML, ending the prompt as DeepSeek-V3.1's template does after its assistant tag.
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{% if thinking is defined and thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("deepseek_v31") / "model", qwen_tokens=True)
    yield from served_openai_client(folder, "--reasoning-parser", "deepseek_v3", "--served-model-name", MODEL,
                                         "--chat-template", TEMPLATE)


def ask(client: openai.OpenAI, thinking: bool | None = None, **kw):
    extra: dict = {"guided_choice": [REPLY]}
    if thinking is not None:
        extra["chat_template_kwargs"] = {"thinking": thinking}
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=40, temperature=1.0,
        logit_bias={END: 3.0}, extra_body=extra, **kw)


def streamed(client: openai.OpenAI, **kw) -> tuple[str, str, dict]:
    reasoning = content = ""
    usage: dict = {}
    for chunk in ask(client, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
    return reasoning, content, usage


@pytest.mark.parametrize("thinking", [None, False])
def test_thinking_off_is_all_answer(client, thinking):
    resp = ask(client, thinking, seed=0)
    message = resp.choices[0].message
    assert message.content == REPLY and message.model_extra["reasoning"] is None
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content, usage = streamed(client, thinking=thinking, seed=0)
    assert (reasoning, content) == ("", REPLY)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 0


def test_thinking_on_returns_the_thinking_apart(client):
    for seed in range(100):
        resp = ask(client, True, seed=seed)
        message = resp.choices[0].message
        if message.model_extra["reasoning"] and message.content == REPLY:
            break
    else:
        pytest.fail("no seed gives a thinking, a </think> and the guided answer within max_tokens")
    thought = message.model_extra["reasoning"]
    assert "</think>" not in thought and resp.usage.completion_tokens_details.reasoning_tokens > 0
    reasoning, content, usage = streamed(client, thinking=True, seed=seed)
    assert (reasoning, content) == (thought, REPLY)
    assert usage["completion_tokens_details"] == resp.usage.completion_tokens_details.model_dump()
