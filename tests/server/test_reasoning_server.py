"""`ferrox serve --reasoning-parser deepseek_r1` on a tiny random Qwen3 whose tokenizer has Qwen's
`<think>` / `</think>` / `<tool_call>` as added text tokens, through the official `openai` client:
the thinking comes back as `reasoning` (and `reasoning_content`) apart from the answer, streamed and
not, with its token count in the usage; a structured output constrains the answer only (the
grammar starts at the sampled `</think>`); tool calls are read from the answer; include_reasoning
false hides the thinking and what would spell it out.

A random model thinks as long as it samples no `</think>`: a seeded request with a logit bias on
`</think>` gives a thinking of a few tokens, found by trying seeds (each one a few milliseconds)."""

from __future__ import annotations

import json

import openai
import pytest

from tests.helpers.tiny_models import make_tiny_qwen3
from tests.server.server_proc import ServerProcess, openai_client

MODEL = "tiny-reasoner"
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
END = "385"  # </think> in the tiny tokenizer (QWEN_TEXT_TOKENS after the 384 trained ids)
# An enum: a random model would write a free string until max_tokens.
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}]


# ChatML with a system line naming a template variable (--default-chat-template-kwargs sets it).
GREETING_TEMPLATE = ("{{ '<|im_start|>system\\n' + (greeting | default('Hi')) + '<|im_end|>\\n' }}"
                     "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("reasoner") / "model", qwen_tokens=True)
    srv = ServerProcess(folder, "--reasoning-parser", "deepseek_r1", "--served-model-name", MODEL,
                        "--default-chat-template-kwargs", json.dumps({"greeting": "Ahoy"}),
                        "--chat-template", GREETING_TEMPLATE)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def ask(client: openai.OpenAI, **kw):
    body = dict(model=MODEL, messages=QUESTION, max_tokens=16, temperature=1.0, logit_bias={END: 3.0})
    body.update(kw)
    return client.chat.completions.create(**body)


@pytest.fixture(scope="module")
def thinker(client) -> tuple[int, list[int]]:
    """A seed whose answer thinks for 2 or more tokens, then closes the thinking, then answers."""
    for seed in range(200):
        resp = ask(client, seed=seed, extra_body={"return_token_ids": True})
        ids = resp.choices[0].model_extra["token_ids"]
        if ids.count(int(END)) == 1 and int(END) in ids[2:-2]:
            return seed, ids
    pytest.fail("no seed gives a thinking of 2+ tokens, one </think> and an answer")


def stream_parts(client: openai.OpenAI, **kw) -> tuple[str, str, str, dict]:
    reasoning = reasoning_content = content = ""
    usage: dict = {}
    for chunk in ask(client, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning += extra.get("reasoning") or ""
            reasoning_content += extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    return reasoning, reasoning_content, content, usage


def test_thinking_returned_apart_from_the_answer(client, thinker):
    seed, ids = thinker
    k = ids.index(int(END))
    resp = ask(client, seed=seed)
    message = resp.choices[0].message
    extra = message.model_extra
    assert extra["reasoning"] and extra["reasoning_content"] == extra["reasoning"]
    assert message.content and "</think>" not in message.content + extra["reasoning"]
    assert resp.usage.completion_tokens_details.reasoning_tokens == k  # the tokens before </think>
    assert resp.usage.completion_tokens == len(ids)
    # Streamed, the same split of the same tokens.
    reasoning, reasoning_content, content, usage = stream_parts(client, seed=seed)
    assert (reasoning, content) == (extra["reasoning"], message.content)
    assert reasoning_content == reasoning
    assert usage["completion_tokens_details"]["reasoning_tokens"] == k


def test_structured_output_constrains_the_answer_only(client, thinker):
    """The grammar waits for `</think>`: the thinking is sampled as without it (same seed, same
    tokens), the answer after it is one of the choices."""
    seed, ids = thinker
    k = ids.index(int(END))
    for stream in (False, True):
        body = dict(seed=seed, extra_body={"guided_choice": ["yes", "no"], "return_token_ids": True})
        if not stream:
            resp = ask(client, **body)
            got = resp.choices[0].model_extra["token_ids"]
            assert got[:k + 1] == ids[:k + 1]
            assert resp.choices[0].message.content in ("yes", "no")
            assert resp.choices[0].finish_reason == "stop"
            reasoning = resp.choices[0].message.model_extra["reasoning"]
        else:
            reasoning, _, content, _ = stream_parts(client, **body)
            assert content in ("yes", "no")
        assert reasoning == ask(client, seed=seed).choices[0].message.model_extra["reasoning"]


def test_grammar_from_the_start_when_the_prompt_closed_the_thinking(client):
    """A prompt whose last tag is `</think>` (Qwen3's empty think block for enable_thinking false)
    has no thinking left: the grammar applies at once and the whole output is the answer."""
    messages = [{"role": "user", "content": "Answer at once.<think></think>"}]
    resp = ask(client, messages=messages, seed=1, extra_body={"guided_regex": "(yes|no)!"})
    message = resp.choices[0].message
    assert message.content in ("yes!", "no!")
    assert message.model_extra["reasoning"] is None
    assert resp.usage.completion_tokens_details.reasoning_tokens == 0


def test_tool_call_read_from_the_answer(client):
    """tool_choice required: the Hermes `<tool_call>` block is the answer after the thinking, and the
    model's single `<tool_call>` token is text to the grammar (a Qwen tokenizer's added token)."""
    resp = ask(client, seed=0, max_tokens=80, tools=TOOLS, tool_choice="required", logit_bias={END: 100}, parallel_tool_calls=False,
               extra_body={"return_token_ids": True})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.model_extra["token_ids"][0] == int(END)
    assert choice.message.model_extra["reasoning"] is None  # </think> came first: no thinking


def test_include_reasoning_false_hides_the_thinking(client, thinker):
    seed, _ = thinker
    resp = ask(client, seed=seed, logprobs=True, extra_body={"include_reasoning": False, "return_token_ids": True})
    choice = resp.choices[0]
    assert choice.message.model_extra["reasoning"] is None
    assert choice.message.content == ask(client, seed=seed).choices[0].message.content
    assert choice.logprobs is None and "token_ids" not in (choice.model_extra or {})
    reasoning, _, content, _ = stream_parts(client, seed=seed, extra_body={"include_reasoning": False})
    assert reasoning == "" and content == choice.message.content


# ---- Anthropic's Messages API: the thinking as a `thinking` block ---------------------------------------


def test_anthropic_thinking_block_streamed_and_not(server):
    """Greedy, the tiny model never samples `</think>`: the whole reply is thinking (cut by max_tokens),
    one `thinking` block with a signature; streamed, the same text in thinking_delta events, then a
    signature_delta, in block 0."""
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        body = dict(model=MODEL, max_tokens=8, messages=QUESTION, extra_body={"temperature": 0})
        msg = client.messages.create(**body)
        assert [b.type for b in msg.content] == ["thinking"]
        assert msg.content[0].thinking and msg.content[0].signature
        assert msg.stop_reason == "max_tokens"
        events = list(client.messages.create(**body, stream=True))
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
        assert kinds[1] == ("content_block_start", None) and events[1].content_block.type == "thinking"
        assert ("content_block_delta", "signature_delta") in kinds
        thought = "".join(e.delta.thinking for e in events
                          if e.type == "content_block_delta" and e.delta.type == "thinking_delta")
        assert thought == msg.content[0].thinking
        assert {e.index for e in events if e.type.startswith("content_block")} == {0}
        # A prompt that closed the thinking: the reply is the answer, one text block; and an earlier
        # turn's thinking block is taken back (as the template's reasoning_content).
        history = [*QUESTION, {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "It is day.", "signature": "x"},
            {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Yes."}]},
            {"role": "user", "content": "Sure?<think></think>"}]
        msg = client.messages.create(**{**body, "messages": history})
        assert [b.type for b in msg.content] == ["text"]
        events = list(client.messages.create(**{**body, "messages": history}, stream=True))
        text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
        assert text == msg.content[0].text


# ---- thinking_token_budget (chat) and Anthropic's thinking.budget_tokens ---------------------------------
# The prompt opens the thinking (an assistant turn "<think>" continued, as DeepSeek-R1's template
# ends); a bias of -100 on `</think>` keeps the model thinking, so only the budget ends it.
OPENED = [*QUESTION, {"role": "assistant", "content": "<think>"}]


def test_thinking_token_budget_ends_the_thinking(client):
    body = dict(messages=OPENED, max_tokens=10, logit_bias={END: -100}, seed=3,
                extra_body={"add_generation_prompt": False, "continue_final_message": True, "return_token_ids": True,
                            "ignore_eos": True})
    free = ask(client, **body)
    assert int(END) not in free.choices[0].model_extra["token_ids"]
    assert free.choices[0].message.content is None  # all thinking
    cut = ask(client, **{**body, "extra_body": {**body["extra_body"], "thinking_token_budget": 3}})
    ids = cut.choices[0].model_extra["token_ids"]
    assert ids[:3] == free.choices[0].model_extra["token_ids"][:3] and ids[3] == int(END)
    assert cut.usage.completion_tokens_details.reasoning_tokens == 3
    assert cut.choices[0].message.content  # the answer comes after the forced </think>
    reasoning, _, content, usage = stream_parts(client, **{**body, "extra_body": {**body["extra_body"],
                                                                                  "thinking_token_budget": 3}})
    assert (reasoning, content) == (cut.choices[0].message.model_extra["reasoning"], cut.choices[0].message.content)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, extra_body={"thinking_token_budget": -5})
    assert e.value.body["param"] == "thinking_token_budget"


def test_anthropic_thinking_budget_tokens(server):
    """thinking.budget_tokens is the budget; display "omitted" keeps the block without its text; disabled
    closes the thinking at once (a budget of 0: this template opens it whatever enable_thinking says)."""
    import anthropic

    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        body = dict(model=MODEL, max_tokens=8, messages=OPENED,
                    extra_body={"temperature": 0})

        def create(**kw):
            return client.messages.create(**{**body, **kw})

        free = create()
        assert [b.type for b in free.content] == ["thinking"]  # greedy, it thinks to max_tokens
        msg = create(thinking={"type": "enabled", "budget_tokens": 2})
        assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
        assert free.content[0].thinking.startswith(msg.content[0].thinking)
        omitted = create(thinking={"type": "enabled", "budget_tokens": 2, "display": "omitted"})
        assert [b.type for b in omitted.content] == ["thinking", "text"] and omitted.content[0].thinking == ""
        events = list(client.messages.create(**body, thinking={"type": "enabled", "budget_tokens": 2,
                                                               "display": "omitted"}, stream=True))
        assert not [e for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
        assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["thinking", "text"]
        disabled = create(thinking={"type": "disabled"})
        assert [b.type for b in disabled.content] == ["text"]
        assert create(thinking={"type": "adaptive"}).content[0].type == "thinking"


def test_default_chat_template_kwargs_under_the_requests(server):
    """--default-chat-template-kwargs reaches the template on every route (here /tokenize, which renders
    as chat does); a request's chat_template_kwargs win."""
    import urllib.request

    def tokens(extra: dict) -> list[int]:
        body = json.dumps({"model": MODEL, "messages": QUESTION, **extra}).encode()
        req = urllib.request.Request(server.base_url + "/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["tokens"]

    def text(ids: list[int]) -> str:
        body = json.dumps({"model": MODEL, "tokens": ids}).encode()
        req = urllib.request.Request(server.base_url + "/detokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            return json.loads(resp.read())["prompt"]

    assert "Ahoy" in text(tokens({}))
    overridden = text(tokens({"chat_template_kwargs": {"greeting": "Howdy"}}))
    assert "Howdy" in overridden and "Ahoy" not in overridden
