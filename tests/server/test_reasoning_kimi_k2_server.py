"""`ferrox serve --reasoning-parser kimi_k2` on a tiny random Llama whose tokenizer has Kimi's `<think>` /
`</think>` (special tokens, as Kimi's) and tool-call markers as single tokens, served with a Kimi-K2.5-style
chat template (the prompt ends with `<think>`, or `<think></think>` for `chat_template_kwargs: {"thinking":
false}`) and no --tool-call-parser (the template's `<|tool_calls_section_begin|>` picks kimi_k2), through the
official clients.

- Thinking on: the model thinks until it samples the special `</think>` (a logit bias and a seed found by
  trying), which the reply keeps (replies keep special tokens under this parser); a guided_choice then forces
  an answer with two tool calls in Kimi's format: the thinking comes back apart, the calls as tool_calls
  (with Kimi's ids), whole and streamed alike.
- Thinking ended by the tool-call section: with the section's token boosted (its lm_head row scaled) the model
  opens its section while still thinking: the thinking stops there, the section is the answer's, and the
  reasoning tokens are those before it; greedy, so chat, Responses and Messages answer alike.
- Thinking off: the prompt closed the thinking, the guided reply is all answer, its calls read."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.helpers.tiny_models import _common, _save, build_tokenizer
from tests.server.server_proc import ServerProcess, openai_client

MODEL = "tiny-kimi"
KIMI_TOKENS = ["<think>", "</think>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
               "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|im_user|>",
               "<|im_assistant|>", "<|im_middle|>"]
# The tool-call markers are special in Kimi's tokenizer too, but a guided_choice cannot spell a special token's
# text (llguidance allows the token for the text, then rejects it): here they are added text tokens, so that
# guided replies can write calls. The thinking tags and the turn tokens are special.
KIMI_TEXT_TOKENS = KIMI_TOKENS[2:7]
THINK, END, SECTION = 384, 385, 386  # after the 384 trained ids
# Kimi-K2.5's layout: the reply's turn opens with `<think>` unless `thinking` is false; earlier calls are
# written back in Kimi's section format (which is what picks the kimi_k2 tool parser).
TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_assistant|>assistant<|im_middle|><think></think>' + (m['content'] or '') }}"
    "{% if m.get('tool_calls') %}{{ '<|tool_calls_section_begin|>' }}{% for tc in m['tool_calls'] %}"
    "{{ '<|tool_call_begin|>' + tc['id'] + '<|tool_call_argument_begin|>' + tc['function']['arguments'] + "
    "'<|tool_call_end|>' }}{% endfor %}{{ '<|tool_calls_section_end|>' }}{% endif %}{{ '<|im_end|>' }}"
    "{% else %}{{ '<|im_user|>' + m['role'] + '<|im_middle|>' + m['content'] + '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{% if thinking is defined and thinking is false %}{{ '<think></think>' }}{% else %}{{ '<think>' }}{% endif %}"
    "{% endif %}"
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
ARGUMENTS = '{"city": "São Paulo", "days": 2}'
CALLS = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         + ARGUMENTS + "<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
         "<|tool_call_end|><|tool_calls_section_end|>")
REPLY = "Checking." + CALLS
EXPECTED = [("get_weather", ARGUMENTS, "functions.get_weather:0"), ("get_time", "{}", "functions.get_time:1")]
QUESTION = [{"role": "user", "content": "Weather in São Paulo, and the time?"}]
# Prompts tried for a greedy reply that opens its tool-call section after a few tokens of thinking.
WORDS = ("weather", "Paris", "Oslo", "rain", "sun", "cold", "hot", "city", "today", "now", "why", "how", "time")


def make_tiny_kimi(folder: str, section_scale: float) -> str:
    """A tiny Llama (untied lm_head) whose tokenizer adds KIMI_TOKENS (special but KIMI_TEXT_TOKENS); the lm_head row of
    `<|tool_calls_section_begin|>` is scaled so that greedy decoding opens the section for some prompts."""
    import torch
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=t not in KIMI_TEXT_TOKENS, normalized=False) for t in KIMI_TOKENS])
    assert [tok.token_to_id(t) for t in KIMI_TOKENS[:3]] == [THINK, END, SECTION]
    params = _common(tok, 64, 2, 4, 2, 128, 2048, False)
    config = LlamaConfig(**params, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        model.lm_head.weight[SECTION] *= section_scale
    return _save(folder, model, tok, max_shard_size=None, generation=None)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_kimi(str(tmp_path_factory.mktemp("kimi") / "model"), section_scale=4.0)
    srv = ServerProcess(folder, "--reasoning-parser", "kimi_k2", "--served-model-name", MODEL,
                        "--chat-template", TEMPLATE)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def ask(client: openai.OpenAI, **kw):
    body: dict = dict(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=400, temperature=1.0)
    body.update(kw)
    return client.chat.completions.create(**body)


def streamed(client: openai.OpenAI, **kw) -> tuple[str, str, list[tuple[str, str, str]], str | None, dict]:
    reasoning, content, calls, finish, usage = "", "", {}, None, {}
    for chunk in ask(client, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    calls[tc.index] = [tc.function.name, "", tc.id]
                calls[tc.index][1] += tc.function.arguments or ""
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], finish, usage


def calls_of(message) -> list[tuple[str, str, str]]:
    return [(c.function.name, c.function.arguments, c.id) for c in message.tool_calls or []]


@pytest.fixture(scope="module")
def thinker(client) -> tuple[int, int]:
    """(seed, k): a seed whose reply thinks k >= 2 tokens, then samples `</think>` (no section before it)."""
    for seed in range(100):
        resp = ask(client, seed=seed, logit_bias={str(END): 3.0},
                   extra_body={"guided_choice": [REPLY], "return_token_ids": True})
        ids = resp.choices[0].model_extra["token_ids"]
        if END in ids[2:40] and SECTION not in ids[:ids.index(END)]:
            return seed, ids.index(END)
    pytest.fail("no seed thinks for 2+ tokens, then closes the thinking")


def test_thinking_then_tool_calls(client, thinker):
    """`</think>` is a special token the reply keeps: the thinking comes back apart, and the calls after it."""
    seed, k = thinker
    kw = dict(seed=seed, logit_bias={str(END): 3.0}, extra_body={"guided_choice": [REPLY]})
    resp = ask(client, **kw)
    choice = resp.choices[0]
    thought = choice.message.model_extra["reasoning"]
    assert thought and "</think>" not in thought and "<think>" not in thought
    assert choice.message.content == "Checking." and calls_of(choice.message) == EXPECTED
    assert choice.finish_reason == "tool_calls"
    assert resp.usage.completion_tokens_details.reasoning_tokens == k
    reasoning, content, calls, finish, usage = streamed(client, **kw)
    assert (reasoning, content.strip(), calls, finish) == (thought, "Checking.", EXPECTED, "tool_calls")
    assert usage["completion_tokens_details"]["reasoning_tokens"] == k


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_off_is_all_answer(client, stream):
    """chat_template_kwargs thinking false: the template closes the thinking in the prompt; the guided reply
    (constrained from its first token) is the answer, and its calls are read."""
    kw = dict(seed=0, extra_body={"guided_choice": [REPLY], "chat_template_kwargs": {"thinking": False}})
    if stream:
        reasoning, content, calls, finish, usage = streamed(client, **kw)
        assert (reasoning, content.strip(), calls, finish) == ("", "Checking.", EXPECTED, "tool_calls")
        assert usage["completion_tokens_details"]["reasoning_tokens"] == 0
        return
    resp = ask(client, **kw)
    message = resp.choices[0].message
    assert message.model_extra["reasoning"] is None and message.content == "Checking."
    assert calls_of(message) == EXPECTED and resp.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.fixture(scope="module")
def sectioned(client) -> tuple[str, int, str, str]:
    """(prompt, k, reasoning, content): a greedy reply that opens its tool-call section (the token) after
    k >= 2 tokens of thinking, with no `</think>` before it."""
    for word in WORDS:
        resp = ask(client, messages=[{"role": "user", "content": word}], tools=None, max_tokens=16, temperature=0.0,
                   extra_body={"return_token_ids": True})
        ids = resp.choices[0].model_extra["token_ids"]
        if SECTION in ids[2:] and END not in ids[:ids.index(SECTION)]:
            message = resp.choices[0].message
            assert resp.usage.completion_tokens_details.reasoning_tokens == ids.index(SECTION)
            return word, ids.index(SECTION), message.model_extra["reasoning"], message.content
    pytest.fail("no prompt's greedy reply opens the tool-call section after thinking a while")


def test_tool_section_ends_the_thinking(client, sectioned):
    word, k, thought, answer = sectioned
    assert thought and "<|tool_calls_section_begin|>" not in thought
    assert answer.startswith("<|tool_calls_section_begin|>")  # the section is the answer's
    reasoning, content, _, _, usage = streamed(client, messages=[{"role": "user", "content": word}], tools=None,
                                               max_tokens=16, temperature=0.0)
    assert (reasoning, content) == (thought, answer)
    assert usage["completion_tokens_details"]["reasoning_tokens"] == k


def test_tool_section_ends_the_thinking_on_responses(client, sectioned):
    word, k, thought, answer = sectioned
    resp = client.responses.create(model=MODEL, input=word, max_output_tokens=16, temperature=0.0)
    kinds = [item.type for item in resp.output]
    assert kinds == ["reasoning", "message"], kinds
    assert resp.output[0].content[0].text == thought
    assert resp.output[1].content[0].text == answer
    assert resp.usage.output_tokens_details.reasoning_tokens == k
    deltas = "".join(e.delta for e in client.responses.create(model=MODEL, input=word, max_output_tokens=16,
                                                                temperature=0.0, stream=True)
                     if e.type == "response.reasoning_text.delta")
    assert deltas == thought


def test_tool_section_ends_the_thinking_on_messages(server, sectioned):
    word, _, thought, answer = sectioned
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        msg = client.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": word}])
        assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
        assert msg.content[0].thinking == thought and msg.content[1].text == answer
        with client.messages.stream(model=MODEL, max_tokens=16, extra_body={"temperature": 0},
                                    messages=[{"role": "user", "content": word}]) as events:
            final = events.get_final_message()
        assert [b.model_dump() for b in final.content] == [
            {**b.model_dump(), **({"signature": final.content[0].signature} if b.type == "thinking" else {})}
            for b in msg.content]

