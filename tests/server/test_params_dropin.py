"""vLLM's request parameters over HTTP: each one honoured with vLLM's meaning or refused with a 400
naming it (never a 200 that dropped it). Real server (the session's), official `openai` client where
it applies, raw HTTP for what the client cannot send or see (lone surrogates, headers)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from typing import Any

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from tests.server.test_errors import assert_openai_error, post

MODEL = "smol"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in English."}]  # (test_openai_api.py)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def stream_events(base_url: str, path: str, body: dict[str, Any]) -> tuple[CIMultiDict[str], list[dict[str, Any]]]:
    """(response headers, the JSON events before [DONE]) of a streamed request."""
    async def run() -> tuple[CIMultiDict[str], list[dict[str, Any]]]:
        events: list[dict[str, Any]] = []
        async with aiohttp.ClientSession() as session, session.post(base_url + path,
                                                                    json={**body, "stream": True}) as resp:
            assert resp.status == 200, await resp.text()
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
            return CIMultiDict(resp.headers), events

    return asyncio.run(run())


def post_with_headers(base_url: str, path: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> tuple[int, CIMultiDict[str], Any]:
    async def run() -> tuple[int, CIMultiDict[str], Any]:
        async with aiohttp.ClientSession() as session, session.post(base_url + path, json=body,
                                                                    headers=headers or {}) as resp:
            return resp.status, CIMultiDict(resp.headers), await resp.json(content_type=None)

    return asyncio.run(run())


# ---- refused by name -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "length_penalty", 2.0),  # only with use_beam_search
        (COMPLETIONS, "length_penalty", 0.5),
        (CHAT, "logits_processors", ["my.module:Proc"]),
        (COMPLETIONS, "prompt_embeds", "AAAA"),
        (CHAT, "mm_processor_kwargs", {"num_crops": 4}),
        (CHAT, "include_reasoning", False),
        (CHAT, "vllm_xargs", {"a": 1}),
        (CHAT, "kv_transfer_params", {"do_remote_prefill": True}),
        (CHAT, "priority", 5),  # the session server runs the fcfs policy
        (CHAT, "stream_options", {"include_usage": True}),  # without stream
        (CHAT, "guided_decoding_backend", "xgrammar"),
        (CHAT, "truncate_prompt_tokens", 10**6),  # more than max_model_len
        (CHAT, "spaces_between_special_tokens", True),  # with skip_special_tokens false, below
        (COMPLETIONS, "stream_interval", 0),
    ],
)
def test_unsupported_parameters_are_refused_by_name(base_url, path, field, value):
    body: dict[str, Any] = {"max_tokens": 4, field: value}
    body.update({"messages": QUESTION} if path == CHAT else {"prompt": "Hello"})
    if field == "spaces_between_special_tokens":
        body["skip_special_tokens"] = False
    status, resp = post(base_url, path, body)
    assert status == 400, resp
    assert_openai_error(resp, 400, field)


def test_cache_salt_isolates_the_prefix_cache(base_url):
    """Same prompt: a second request with the same salt reuses the first's cached blocks, one with
    another salt (or none) does not (vLLM's meaning: tenants never share KV)."""
    prompt = "Tell me about salted caches. " * 12  # several full KV blocks

    def cached(salt: str | None) -> int:
        # The session's server runs without --enable-prompt-tokens-details (usage then has no
        # prompt_tokens_details, as in vLLM): the count is read from /metrics instead (tests run one at a time).
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        before = cached_total()
        status, resp = post(base_url, COMPLETIONS, body)
        assert status == 200, resp
        assert "prompt_tokens_details" not in resp["usage"], resp["usage"]
        return cached_total() - before

    def cached_total() -> int:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                   if line.startswith("ferrox:prompt_tokens_cached_total"))

    cached("tenant-a")  # fills the cache under tenant-a's salt
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0
    assert cached(None) == 0


def test_default_values_of_refused_parameters_are_fine(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, extra_body={
        "use_beam_search": False, "length_penalty": 1.0, "include_reasoning": True, "priority": 0})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, "/v1/messages", "/tokenize"])
def test_lone_surrogate_is_a_400_naming_the_field(base_url, path):
    bodies = {
        CHAT: (b'{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', "messages.0.content"),
        COMPLETIONS: (b'{"prompt": "a\\udc00b", "max_tokens": 2}', "prompt"),
        "/v1/messages": (b'{"model": "smol", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud83d"}]}',
                         "messages.0.content"),
        "/tokenize": (b'{"prompt": "x\\ud800"}', "prompt"),
    }
    data, field = bodies[path]
    status, resp = post(base_url, path, data=data, headers={"Content-Type": "application/json"})
    assert status == 400, resp
    if path == "/v1/messages":
        assert resp["type"] == "error" and field in resp["error"]["message"]
    else:
        assert_openai_error(resp, 400, field)
    if path == COMPLETIONS:
        # Raw UTF-8 bytes of a surrogate (ED A0 80; json.loads decodes them with surrogatepass), upper-case
        # escapes, and a Hangul syllable whose UTF-8 also starts with ED.
        for raw, bad in ((b'{"prompt": "a\xed\xa0\x80", "max_tokens": 2}', True),
                         (b'{"prompt": "a\\uDC00", "max_tokens": 2}', True),
                         ('{"prompt": "\ud55c", "max_tokens": 2}'.encode(), False)):
            status, resp = post(base_url, path, data=raw, headers={"Content-Type": "application/json"})
            assert (status == 400) == bad, (raw, resp)
            if bad:
                assert_openai_error(resp, 400, "prompt")
    # A valid surrogate pair (an emoji) is fine.
    if path == "/tokenize":
        status, resp = post(base_url, path, data=b'{"prompt": "\\ud83d\\ude00"}',
                            headers={"Content-Type": "application/json"})
        assert status == 200 and resp["count"] >= 1


# ---- honoured ---------------------------------------------------------------------------------------


def test_allowed_token_ids_and_return_token_ids(client, base_url):
    tok = post(base_url, "/tokenize", {"prompt": " 1 2 3 4 5 6 7 8 9"})[1]["tokens"]
    allowed = sorted(set(tok))
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, **GREEDY,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                              "return_token_ids": True})
    choice = r.choices[0].model_dump()
    assert len(choice["token_ids"]) == 6 and set(choice["token_ids"]) <= set(allowed), choice
    assert choice["prompt_token_ids"] == post(base_url, "/tokenize", {"prompt": "The capital of France is"})[1]["tokens"]


def test_bad_words(client, base_url):
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, **GREEDY)
    assert "Paris" in plain.choices[0].message.content
    banned = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, **GREEDY,
                                            extra_body={"bad_words": ["Paris"], "return_token_ids": True})
    ids = {t for w in ("Paris", " Paris") for t in post(base_url, "/tokenize", {"prompt": w})[1]["tokens"]}
    assert not ids & set(banned.choices[0].model_dump()["token_ids"])
    assert "Paris" not in banned.choices[0].message.content
    # A word of two tokens (vLLM bans its last token right after the first): the free answer says it.
    prompt = "Write a sentence about photosynthesis:"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    assert "Photosynthesis" in free.choices[0].text
    word = post(base_url, "/tokenize", {"prompt": "Photosynthesis", "add_special_tokens": False})[1]["tokens"]
    assert len(word) == 2
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY,
                                  extra_body={"bad_words": ["Photosynthesis"], "return_token_ids": True})
    got = r.choices[0].model_dump()["token_ids"]
    assert word[0] in got and all(got[i:i + 2] != word for i in range(len(got)))
    status, resp = post(base_url, COMPLETIONS, {"prompt": prompt, "max_tokens": 2, "bad_words": [" ".join(["antidisestablishmentarianism"] * 120)]})
    assert status == 400, resp
    assert_openai_error(resp, 400, "bad_words")


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens(client, base_url, side):
    prompt = "one two three four five six seven"
    full = post(base_url, "/tokenize", {"prompt": prompt})[1]["tokens"]
    extra: dict[str, Any] = {"truncate_prompt_tokens": 3, "return_token_ids": True}
    if side == "right":
        extra["truncation_side"] = "right"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True, **GREEDY, extra_body=extra)
    kept = full[-3:] if side == "left" else full[:3]
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].model_dump()["prompt_token_ids"] == kept
    echoed = post(base_url, "/detokenize", {"tokens": kept})[1]["prompt"]
    assert r.choices[0].text.startswith(echoed)


def test_prompt_logprobs(client, base_url):
    prompt = "The capital of France is"
    ids = post(base_url, "/tokenize", {"prompt": prompt})[1]["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **GREEDY,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.choices[0].model_dump()["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for tid, position in zip(ids[1:], plp[1:], strict=True):
        assert str(tid) in position and 2 <= len(position) <= 3  # the prompt token + the top 2
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in position.values())
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, **GREEDY,
                                          extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    body = chat.model_dump()
    assert len(body["prompt_logprobs"]) == len(body["prompt_token_ids"]) and body["prompt_logprobs"][0] is None
    status, resp = post(base_url, COMPLETIONS, {"prompt": prompt, "prompt_logprobs": 1, "stream": True})
    assert status == 400 and resp["error"]["param"] == "prompt_logprobs"


def test_return_tokens_as_token_ids(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, logprobs=1, **GREEDY,
                                  extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                                              "ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [f"token_id:{t}" for t in r.choices[0].model_dump()["token_ids"]]
    assert all(tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, logprobs=True,
                                          top_logprobs=2, **GREEDY, extra_body={"return_tokens_as_token_ids": True})
    for entry in chat.choices[0].logprobs.content:
        assert entry.token.startswith("token_id:") and entry.bytes == list(entry.token.encode())
        assert all(t.token.startswith("token_id:") for t in entry.top_logprobs)


def test_completion_top_logprobs_hold_the_sampled_token(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, logprobs=1,
                                  temperature=1.5, seed=11, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert all(tok in top and len(top) <= 2 for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))
    # At temperature 1.5 some sampled tokens are not the most likely one: those positions show two.
    assert any(len(top) == 2 for top in lp.top_logprobs), lp.top_logprobs


def test_streamed_token_ids_and_continuous_usage(base_url, client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, **GREEDY,
                                           extra_body={"return_token_ids": True}).model_dump()
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, **GREEDY, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    _, events = stream_events(base_url, CHAT, body)
    assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert streamed == whole["choices"][0]["token_ids"]
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    counts = [u["completion_tokens"] for u in usages]
    assert counts == sorted(counts) and counts[-1] == whole["usage"]["completion_tokens"]
    assert all(u["prompt_tokens"] == whole["usage"]["prompt_tokens"] for u in usages)
    # Completions too; without continuous_usage_stats only the last chunk carries usage.
    _, events = stream_events(base_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True,
                                                      "stream_options": {"include_usage": True,
                                                                         "continuous_usage_stats": True}})
    assert all(e["usage"] is not None for e in events) and events[-1]["usage"]["completion_tokens"] == 4
    _, events = stream_events(base_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True,
                                                      "stream_options": {"include_usage": True}})
    assert [e["usage"] is not None for e in events] == [False] * (len(events) - 1) + [True]


def test_request_id_and_header(base_url):
    body = {"messages": QUESTION, "max_tokens": 2, "request_id": "my-req-1"}
    status, headers, resp = post_with_headers(base_url, CHAT, body)
    assert status == 200 and resp["id"] == "chatcmpl-my-req-1" and headers["X-Request-Id"] == "my-req-1"
    status, headers, resp = post_with_headers(base_url, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2},
                                              {"X-Request-Id": "from-header"})
    assert status == 200 and resp["id"] == "cmpl-from-header" and headers["X-Request-Id"] == "from-header"
    status, headers, resp = post_with_headers(base_url, CHAT, {"messages": QUESTION, "max_tokens": 2})
    assert status == 200 and headers["X-Request-Id"] == resp["id"]
    stream_headers, events = stream_events(base_url, CHAT, body)
    assert stream_headers["X-Request-Id"] == "my-req-1" and events[0]["id"] == "chatcmpl-my-req-1"


def test_documents_and_reasoning_effort_reach_the_template(client, base_url):
    template = ("{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
                "[effort {{ reasoning_effort }} thinking {{ enable_thinking }}]"
                "{% for m in messages %}{{ m.content }}{% endfor %}")
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, reasoning_effort="low",
                                       extra_body={"chat_template": template, "return_token_ids": True,
                                                   "documents": [{"title": "T1", "text": "Lyon is big."}]})
    prompt = post(base_url, "/detokenize", {"tokens": r.model_dump()["prompt_token_ids"]})[1]["prompt"]
    assert prompt.startswith("[doc T1: Lyon is big.][effort low thinking True]What is the capital"), prompt


def test_add_special_tokens_is_honoured_on_chat(client):
    # The chat template already starts with <|im_start|>; add_special_tokens adds the tokenizer's own on
    # top (none for SmolLM2's tokenizer, whose post-processor adds nothing), and never fails.
    a = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, **GREEDY,
                                       extra_body={"add_special_tokens": True})
    b = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, **GREEDY)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_named_tool_choice_cut_by_max_tokens_says_length(client, base_url):
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=TOOLS, tool_choice=NAMED, max_tokens=40, **GREEDY)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert json.loads(whole.choices[0].message.tool_calls[0].function.arguments)["city"]
    cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                         tools=TOOLS, tool_choice=NAMED, max_tokens=3, **GREEDY)
    assert cut.choices[0].finish_reason == "length"
    _, events = stream_events(base_url, CHAT, {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                               "tools": TOOLS, "tool_choice": NAMED, "max_tokens": 3, **GREEDY})
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    for choice in ("required",):
        cut = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                             tools=TOOLS, tool_choice=choice, max_tokens=5, **GREEDY)
        assert cut.choices[0].finish_reason == "length"


def test_strict_json_schema_adds_no_properties(client):
    # The schema lists one property; asked for more, the model may only write that one.
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    r = client.chat.completions.create(
        model=MODEL, max_tokens=60, **GREEDY,
        messages=[{"role": "user", "content": "Describe Paris as JSON with keys city, country, population."}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    assert set(json.loads(r.choices[0].message.content)) <= {"city"}


def test_structured_whitespace_options(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=20, **GREEDY, extra_body={
        "structured_outputs": {"json": schema, "whitespace_pattern": ""}})
    text = r.choices[0].text
    assert " " not in text and "\n" not in text and json.loads(text)["n"] is not None, text


def test_repetition_detection_ends_a_loop_or_is_a_400(base_url, client):
    """vLLM's repetition_detection (its RepetitionDetectionParams fields): a looping greedy answer ends with
    finish_reason "repetition" and stop_reason "repetition_detected"; a bad rule is a 400 naming the field."""
    rule = {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3}
    r = client.completions.create(model=MODEL, prompt="ha ha ha ha ha ha ha ha", max_tokens=40, temperature=0,
                                  extra_body={"repetition_detection": rule})
    choice = r.choices[0]
    assert choice.finish_reason == "repetition" and r.usage.completion_tokens < 40
    assert choice.model_extra["stop_reason"] == "repetition_detected"
    status, resp = post(base_url, CHAT, {"messages": QUESTION, "max_tokens": 4,
                                         "repetition_detection": {"max_pattern_size": 4, "min_count": 1}})
    assert status == 400, resp
    assert_openai_error(resp, 400, "repetition_detection")


def test_logprob_token_ids_report_exactly_the_named_tokens(base_url, client):
    """vLLM's logprob_token_ids: with logprobs on, each generated position's alternatives are these ids (in
    the order given) instead of the top-N. Their logprobs are checked against the prompt path: the same
    prompt with the id appended, scored by prompt_logprobs."""
    prompt = "The capital of France is"
    ids = post(base_url, "/tokenize", {"prompt": prompt})[1]["tokens"]
    named = [4000, 0, 17]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1, **GREEDY,
                                  extra_body={"logprob_token_ids": named, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    first = lp.top_logprobs[0]
    assert set(first) == {f"token_id:{t}" for t in named} | {lp.tokens[0]}
    for t in named:
        status, ref = post(base_url, COMPLETIONS, {"prompt": ids + [t], "max_tokens": 1, "prompt_logprobs": 0})
        assert status == 200, ref
        expected = ref["choices"][0]["prompt_logprobs"][-1][str(t)]["logprob"]
        assert abs(first[f"token_id:{t}"] - expected) < 2e-3, (t, first, expected)
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, logprobs=True,
                                          top_logprobs=5, **GREEDY,
                                          extra_body={"logprob_token_ids": named, "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert [t.token for t in entry.top_logprobs] == [f"token_id:{t}" for t in named]
        assert all(t.logprob <= 0 for t in entry.top_logprobs)
    _, events = stream_events(base_url, CHAT, {"model": MODEL, "messages": QUESTION, "max_tokens": 4,
                                                "logprobs": True, "logprob_token_ids": named, **GREEDY,
                                                "return_tokens_as_token_ids": True})
    streamed = [e for ev in events for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert [[t["token"] for t in e["top_logprobs"]] for e in streamed] == [[t.token for t in e.top_logprobs]
                                                                          for e in content]
    assert [round(e["logprob"], 4) for e in streamed] == [round(e.logprob, 4) for e in content]


@pytest.mark.parametrize(("body", "param"), [
    ({"logprob_token_ids": [5]}, "logprob_token_ids"),  # without logprobs it would do nothing
    ({"logprobs": True, "logprob_token_ids": [10**7]}, "logprob_token_ids"),  # outside the vocabulary
    ({"logprobs": True, "logprob_token_ids": [-1]}, "logprob_token_ids"),
    ({"logprobs": True, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
])
def test_bad_logprob_token_ids_are_a_400_naming_the_field(base_url, body, param):
    status, resp = post(base_url, CHAT, {"messages": QUESTION, "max_tokens": 2, **body})
    assert status == 400, resp
    assert_openai_error(resp, 400, param)
