"""The OpenAI-compatible routes, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import aiohttp
import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN

MODEL = "smol"
# "Answer in English.": alone the question sits near a tie between an English and a French first token on
# the embedded model (0.06 nats on its quantized CPU path), which any change of rounding may tip.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in English."}]


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def greedy_answer(client) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=24)


def test_models_lists_max_model_len(client):
    """The server runs with --served-model-name smol smol-alias: both listed, either answers, and
    responses name the first (vLLM's rule)."""
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, "smol-alias"]
    assert models[0].max_model_len == MAX_MODEL_LEN
    assert models[0].object == "model"
    assert client.models.retrieve(MODEL).max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve("smol-alias").id == "smol-alias"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    resp = client.completions.create(model="smol-alias", prompt="Hi", max_tokens=1)
    assert resp.model == MODEL


def test_chat_non_streaming(greedy_answer):
    resp = greedy_answer
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client, greedy_answer):
    stream = client.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_answer.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [greedy_answer.choices[0].finish_reason]
    # include_usage: every chunk carries usage null except a last one with empty choices.
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == greedy_answer.usage.completion_tokens
    assert last.usage.prompt_tokens == greedy_answer.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_non_streaming_and_echo(client):
    resp = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                     max_tokens=8, echo=True)
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    text = resp.choices[0].text
    assert text.startswith("The capital of France is") and len(text) > len("The capital of France is")
    assert resp.usage.completion_tokens <= 8
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_completion_streaming_matches(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", temperature=0, max_tokens=12,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12


def post_json(base_url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def test_completion_prompt_forms(client, base_url):
    ids = post_json(base_url, "/tokenize", {"prompt": "Hello there"})["tokens"]
    # A list of prompts (text and token ids) gives one choice group per prompt, in order.
    resp = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=4,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.choices[0].text == resp.choices[1].text
    assert resp.usage.prompt_tokens == 2 * len(ids)
    by_text = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=4,
                                        extra_body={"ignore_eos": True})
    assert by_text.choices[0].text == resp.choices[0].text


def test_n2_sampling(client):
    kwargs = dict(model=MODEL, messages=QUESTION, n=2, temperature=1.0, seed=7, max_tokens=8)
    resp = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.message.content for c in resp.choices)
    assert 2 <= resp.usage.completion_tokens <= 16
    # Seeded: the same request gives the same two samples again.
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]


def test_chat_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=5,
                                          logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, entry.top_logprobs[0].logprob, abs_tol=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob


def test_completion_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=4, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and all(a <= b for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False))
    assert all(len(top) <= 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True))


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert "7" in base, base
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12,
                                        stop=["7"]).choices[0]
    assert stopped.text == base[: base.index("7")]
    assert stopped.finish_reason == "stop"
    kept = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=["7"],
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == base[: base.index("7") + 1]


async def _sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def test_sse_framing_ends_with_done(base_url):
    async def run() -> list[str]:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, "stream": True}
            async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                return await _sse_events(resp)

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_32_concurrent_streams(base_url):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], temperature=0, max_tokens=6,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens

    async def run() -> list[tuple[str, int]]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32
    assert all(tokens == 6 and text for text, tokens in results)
    # Same prompt -> same greedy text, however the batch was composed.
    assert results[3][0] == asyncio.run(_single(base_url, 3))


async def _single(base_url: str, i: int) -> str:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        resp = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], temperature=0, max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        return resp.choices[0].message.content


def test_tokenize_detokenize_roundtrip(base_url):
    tok = post_json(base_url, "/tokenize", {"prompt": "Hello, world!", "add_special_tokens": False})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    detok = post_json(base_url, "/detokenize", {"tokens": tok["tokens"]})
    assert detok["prompt"] == "Hello, world!"
    chat = post_json(base_url, "/tokenize", {"messages": QUESTION})
    assert chat["count"] > tok["count"]


# Prints a part's text, or the item a loop over a string gives (a character): shows which shape it got.
PARTS_TEMPLATE = ("{% for m in messages %}{% for p in m.content %}{% if p is mapping %}{{ p.text }}{% else %}{{ p }}"
                  "{% endif %}|{% endfor %}{% endfor %}")
TWO_PARTS = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]


def rendered(base_url: str, body: dict) -> str:
    ids = post_json(base_url, "/tokenize", body)["tokens"]
    return post_json(base_url, "/detokenize", {"tokens": ids})["prompt"]


def test_content_parts_reach_a_template_that_loops_over_them(base_url):
    """--chat-template-content-format auto (the default): a template that loops over a message's content
    gets OpenAI text parts, a plain string as one part; the model's own template gets the parts joined by
    newlines (vLLM's joiner). Rendered through /tokenize with the request's own template (trusted here)."""
    assert rendered(base_url, {"messages": TWO_PARTS, "chat_template": PARTS_TEMPLATE}) == "ab|c|"
    assert rendered(base_url, {"messages": [{"role": "user", "content": "abc"}],
                               "chat_template": PARTS_TEMPLATE}) == "abc|"
    joined = rendered(base_url, {"messages": TWO_PARTS})
    assert "ab\nc" in joined, joined


def test_version_and_health(base_url):
    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session:
            async with session.get(base_url + "/health") as health:
                status = health.status
            async with session.get(base_url + "/version") as version:
                return status, await version.json()

    status, version = asyncio.run(run())
    assert status == 200 and version["version"]


def test_generation_server_refuses_embeddings_and_runtime_lora_updates(client, base_url):
    with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
        client.embeddings.create(model=client.models.list().data[0].id, input="hi")
    # Loading adapters at run time is off unless the environment allows it (as vLLM): 404 naming the switch.
    req = urllib.request.Request(base_url + "/v1/load_lora_adapter", json.dumps({"lora_name": "x", "lora_path": "/"}).encode(),
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in err.value.read().decode()


def test_mistral_tool_format_keeps_special_tokens(client):
    """A chat template that writes Mistral's [TOOL_CALLS] picks the mistral tool parser, whose marker is
    a special token: with tools in play the reply keeps special tokens (vLLM's rule), as a logit bias
    on <|im_start|> (id 1, special) shows; without tools it does not."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if tools %}[TOOL_CALLS]{% endif %}<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = dict(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0,
                logit_bias={"1": 100}, extra_body={"chat_template": template})
    kept = client.chat.completions.create(tools=tools, **body).choices[0].message
    assert kept.content == "<|im_start|>" * 3 and not kept.tool_calls
    assert not client.chat.completions.create(**body).choices[0].message.content


def test_sagemaker_invocations_picks_the_api_from_the_body(base_url):
    """/invocations (SageMaker's route, beside /ping): `messages` is a chat completion, `prompt` a
    completion, each validated by its own route; a body naming neither is a 400."""
    chat = post_json(base_url, "/invocations", {"messages": QUESTION, "max_tokens": 3, "temperature": 0})
    assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] == 3
    same = post_json(base_url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 3, "temperature": 0})
    assert chat["choices"][0]["message"] == same["choices"][0]["message"]
    text = post_json(base_url, "/invocations", {"prompt": "Once upon a time", "max_tokens": 2})
    assert text["object"] == "text_completion" and len(text["choices"]) == 1
    for body, param in (({"max_tokens": 2}, "messages"), ({"prompt": "x", "max_tokens": -1}, "max_tokens")):
        req = urllib.request.Request(base_url + "/invocations", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=60)
        assert err.value.code == 400
        assert json.loads(err.value.read())["error"]["param"] == param
