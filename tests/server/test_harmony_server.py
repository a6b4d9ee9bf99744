"""`ferrox serve --reasoning-parser openai_gptoss --tool-call-parser openai` on a tiny random Llama that
speaks through a harmony tokenizer (tests/helpers/harmony_tokenizer.py): the routes decode with the
markers kept and return what the parsers read from the tokens (chat, streamed and not, /v1/responses,
/v1/messages), the chat template gets gpt-oss's variables, and what the parser cannot do is refused.

A random model writes harmony only by chance: a logit bias on the markers and `analysis` makes messages
common, and seeds are tried until outputs with thinking and with an answer come up (milliseconds each).
The parsers' own rules (tool calls included) are tested on fixed texts in tests/test_harmony_reasoning.py
and tests/structured/test_tool_parser_openai_harmony.py."""

from __future__ import annotations

import json

import pytest
from ferrox.entrypoints.openai.tool_parsers import get_tool_parser
from ferrox.reasoning import get_reasoning_parser
from ferrox.reasoning.harmony import MARKERS

from tests.helpers.harmony_tokenizer import build_harmony_tokenizer, make_tiny_harmony_llama
from tests.server.server_proc import ServerProcess, post_json

MODEL = "tiny-harmony"
QUESTION = [{"role": "user", "content": "Is the sky blue?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tok():
    return build_harmony_tokenizer()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = make_tiny_harmony_llama(tmp_path_factory.mktemp("harmony") / "model")
    srv = ServerProcess(folder, "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                        "--served-model-name", MODEL)
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log[-30:])


def body(tok, seed: int, **kw) -> dict:
    bias = {str(tok.token_to_id(t)): b for t, b in
            (("<|channel|>", 5), ("<|message|>", 5), ("analysis", 8), ("<|end|>", 2), ("<|start|>", 2))}
    return {"model": MODEL, "messages": QUESTION, "max_tokens": 40, "seed": seed, "temperature": 1.0,
            "logit_bias": bias, **kw}


def stream_chat(server, payload: dict) -> tuple[str, str, list[dict]]:
    import urllib.request

    req = urllib.request.Request(server.base_url + "/v1/chat/completions", data=json.dumps(
        {**payload, "stream": True}).encode(), headers={"Content-Type": "application/json"})
    reasoning = content = ""
    chunks = []
    with urllib.request.urlopen(req, timeout=60) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                chunks.append(chunk)
                for choice in chunk["choices"]:
                    reasoning += choice["delta"].get("reasoning") or ""
                    content += choice["delta"].get("content") or ""
    return reasoning, content, chunks


@pytest.fixture(scope="module")
def replies(server, tok):
    """(seed, token ids, chat message, usage) for seeds until one has thinking and one has an answer."""
    found = []
    for seed in range(60):
        status, out = post_json(server.base_url, body(tok, seed, return_token_ids=True))
        assert status == 200, out
        message = out["choices"][0]["message"]
        found.append((seed, out["choices"][0]["token_ids"], message, out["usage"]))
        if any(m["reasoning"] for _, _, m, _ in found) and any(m["content"] for _, _, m, _ in found) \
                and len(found) >= 6:
            return found
    pytest.fail("no seed gives a reply with thinking")


def test_chat_returns_what_the_parsers_read(server, tok, replies):
    parser = get_reasoning_parser("openai_gptoss", tok.token_to_id)
    for seed, ids, message, usage in replies:
        text = tok.decode(ids, skip_special_tokens=False)  # the markers are kept for the parser
        assert (message["reasoning"], message["content"]) == parser.split(text), (seed, text)
        assert message["reasoning_content"] == message["reasoning"]
        for part in (message["reasoning"] or "", message["content"] or ""):
            assert not any(m in part for m in MARKERS), (seed, part)
        assert usage["completion_tokens_details"]["reasoning_tokens"] == parser.count_reasoning_tokens(ids)
        # Streamed: the same parts, split across the chunks.
        reasoning, content, _ = stream_chat(server, body(tok, seed))
        assert (reasoning or None, content or None) == (message["reasoning"], message["content"]), seed


def test_chat_with_tools_reads_the_calls_from_the_answer(server, tok, replies):
    """tools + tool_choice auto: the openai tool parser reads the answer (none of these random replies
    addresses a function, so the answer is the same content and no call)."""
    parser = get_reasoning_parser("openai_gptoss", tok.token_to_id)
    for seed, *_ in replies[:3]:
        status, out = post_json(server.base_url, body(tok, seed, tools=TOOLS, return_token_ids=True))
        assert status == 200, out
        got = out["choices"][0]
        text = tok.decode(got["token_ids"], skip_special_tokens=False)
        reasoning, answer = parser.split(text, tool_calls=True)
        extracted = get_tool_parser("openai")(tools=TOOLS).extract(answer or "")
        assert got["message"]["reasoning"] == reasoning
        assert got["message"]["content"] == extracted.content
        assert not got["message"].get("tool_calls") and not extracted.tool_calls


def test_responses_and_messages_split_the_same_way(server, tok):
    """/v1/responses and /v1/messages take no seed or logit bias: greedy replies (whatever harmony the
    random model writes) split as the chat route splits the same tokens."""
    parser = get_reasoning_parser("openai_gptoss", tok.token_to_id)
    for question in ("Is the sky blue?", "Paris or Berlin?", "Numbers: 1 2 3"):
        messages = [{"role": "user", "content": question}]
        status, chat = post_json(server.base_url, {"model": MODEL, "messages": messages, "max_tokens": 24,
                                                   "temperature": 0.0, "return_token_ids": True})
        assert status == 200, chat
        ids = chat["choices"][0]["token_ids"]
        reasoning, content = parser.split(tok.decode(ids, skip_special_tokens=False))
        assert (chat["choices"][0]["message"]["reasoning"], chat["choices"][0]["message"]["content"]) == \
            (reasoning, content)
        status, out = post_json(server.base_url, {"model": MODEL, "input": messages, "max_output_tokens": 24,
                                                  "temperature": 0.0}, "/v1/responses")
        assert status == 200, out
        items = {item["type"]: item for item in out["output"]}
        assert (items["reasoning"]["content"][0]["text"] if "reasoning" in items else None) == reasoning
        assert items["message"]["content"][0]["text"] == (content or "")
        status, out = post_json(server.base_url, {"model": MODEL, "messages": messages, "max_tokens": 24,
                                                  "temperature": 0.0}, "/v1/messages")
        assert status == 200, out
        blocks = {block["type"]: block for block in out["content"]}
        assert (blocks["thinking"]["thinking"] if "thinking" in blocks else None) == reasoning
        assert blocks["text"]["text"] == (content or "")


def test_template_gets_gpt_oss_variables(server, tok):
    """reasoning_effort reaches the template; an earlier turn's reasoning comes back as `thinking` and a
    call's JSON arguments as an object (rendered by the template's tojson, not as a quoted string)."""
    history = [*QUESTION, {"role": "assistant", "content": None, "reasoning_content": "I should look it up.",
                           "tool_calls": [{"id": "call_1", "type": "function", "function": {
                               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    status, out = post_json(server.base_url, {"model": MODEL, "messages": history, "chat_template_kwargs": {
        "reasoning_effort": "low", "model_identity": "You are Harmony."}}, "/tokenize")
    assert status == 200, out
    prompt = tok.decode(out["tokens"], skip_special_tokens=False)
    assert prompt.startswith("<|start|>system<|message|>You are Harmony.\nReasoning: low\n")
    assert "<|start|>assistant<|channel|>analysis<|message|>I should look it up.<|end|>" in prompt
    assert '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>' in prompt
    assert prompt.endswith("<|start|>assistant")


@pytest.mark.parametrize(("path", "payload", "param"), [
    ("/v1/chat/completions", {"messages": QUESTION, "reasoning_effort": "none"}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": QUESTION, "thinking_token_budget": 4}, "thinking_token_budget"),
    ("/v1/chat/completions", {"messages": QUESTION, "chat_template_kwargs": {"builtin_tools": ["python"]}},
     "chat_template_kwargs"),
    ("/v1/responses", {"input": QUESTION, "text": {"format": {"type": "json_object"}}}, "text.format"),
    ("/v1/responses", {"input": QUESTION, "reasoning": {"effort": "minimal"}}, "reasoning_effort"),
    ("/v1/messages", {"messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking_token_budget"),
])
def test_refused_by_name(server, path, payload, param):
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    status, out = post_json(server.base_url, {"model": MODEL, limit: 8, **payload}, path)
    assert status == 400, out
    if path == "/v1/messages":  # Anthropic's error names no param: the message does
        assert out["error"]["message"].startswith(param + ":"), out
    else:
        assert out["error"]["param"] == param, out
