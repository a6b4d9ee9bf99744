"""Chaos storm against a live `ferrox serve`: every API, streamed and not, with clients that vanish,
time out, read slowly or abort, malformed bodies, structured-output, tool and n > 1 requests.

    # start `ferrox serve` here (embedded model, 48 MiB KV cache so that requests get preempted)
    python benches/bench_chaos.py --requests 2000 --concurrency 96
    # against a running server
    python benches/bench_chaos.py --base-url http://127.0.0.1:8000 --requests 2000
    # soak: storms back to back for an hour; RSS, fds, threads of the API server and engine
    # core(s) and KV usage sampled every --sample-seconds, growth after --warmup-minutes reported
    python benches/bench_chaos.py --soak-minutes 60

After the storm the server must settle (nothing running or waiting, KV usage back to its idle
value), every well-formed request must have been answered in full, every malformed one refused
with a 4xx in the route's error shape, no 500 anywhere, and the greedy answers to a fixed set of
prompts must equal those given before the storm. The summary is printed last; the exit code is
non-zero when any check failed. tests/server/test_chaos.py runs a bounded storm through
`run_storm` / `check_after_storm` from here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
APIS = ("chat", "completions", "messages", "responses")
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "messages": "/v1/messages",
          "responses": "/v1/responses"}
PROMPTS = ["The capital of France is", "Write a haiku about rust.", "1, 2, 3, 4,", "Once upon a time",
           "def fibonacci(n):", "List three colours:", "Explain paged attention in one sentence."]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOL_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
# Client behaviours and how often each is drawn. "ok" and "slow" are well-formed requests read to the
# end: they must succeed. The others may end any way except with a 5xx.
BEHAVIOURS = {"ok": 0.45, "slow": 0.08, "vanish": 0.17, "timeout": 0.07, "abort": 0.08, "invalid": 0.10,
              "sdk": 0.05}
# "agent": what agent clients send beside the messages (Claude Code's billing line and thinking on
# /v1/messages, Codex's prompt_cache_key / include / store on /v1/responses, a cache key on chat);
# "beams": use_beam_search with two beams (chat and completions, not streamed).
FEATURES = ("plain", "plain", "json", "tools", "n2", "stop", "agent", "beams")
GREEDY_PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time", "def add(a, b):"]


@dataclass
class Outcome:
    behaviour: str
    api: str
    feature: str
    stream: bool
    status: int | None = None
    problem: str | None = None  # why this outcome breaks the contract; None when it is acceptable


@dataclass
class StormReport:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def problems(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    def counts(self) -> Counter:
        return Counter(o.behaviour for o in self.outcomes)


# ---- request bodies --------------------------------------------------------------------------------


def _tool(api: str) -> dict[str, Any]:
    if api == "messages":
        return {"name": "get_weather", "description": "Weather in a city", "input_schema": TOOL_PARAMS}
    if api == "responses":
        return {"type": "function", "name": "get_weather", "description": "Weather in a city",
                "parameters": TOOL_PARAMS}
    return {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                             "parameters": TOOL_PARAMS}}


def build_body(rng: random.Random, api: str, feature: str, stream: bool, model: str, max_tokens: int) -> dict[str, Any]:
    """A well-formed request of `api` exercising `feature` (n2 and stop only where the API has them)."""
    prompt = rng.choice(PROMPTS)
    temperature = rng.choice([0.0, 0.7])
    if api == "completions":
        body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream,
                                "temperature": temperature}
        if feature == "json":
            body["structured_outputs"] = {"json": SCHEMA}
        elif feature == "tools":  # completions have no tools: a constrained choice instead
            body["structured_outputs"] = {"choice": ["red", "green", "blue"]}
    elif api == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": stream, "temperature": temperature}
        if feature == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
        elif feature == "tools":
            body["tools"] = [_tool(api)]
            body["tool_choice"] = rng.choice(["auto", "required"])
    elif api == "messages":
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "stream": stream, "temperature": temperature}
        if feature == "tools":
            body["tools"] = [_tool(api)]
        elif feature == "stop":
            body["stop_sequences"] = ["\n", "."]
        elif feature == "agent":
            body["system"] = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.1; cch={rng.getrandbits(20):05x};"},
                              {"type": "text", "text": "You are a coding agent."}]
            body["thinking"] = rng.choice([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}])
    else:
        body = {"model": model, "input": prompt, "max_output_tokens": max_tokens, "stream": stream,
                "temperature": temperature}
        if feature == "json":
            body["text"] = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}
        elif feature == "tools":
            body["tools"] = [_tool(api)]
        elif feature == "agent":
            body.update(store=False, prompt_cache_key=f"thread-{rng.randrange(8)}",
                        include=["reasoning.encrypted_content"], parallel_tool_calls=True)
    if api == "chat" and feature == "agent":
        body["prompt_cache_key"] = f"conversation-{rng.randrange(8)}"
        # Agent clients send a turn as several text parts (a reminder block, then the user's words).
        body["messages"][0]["content"] = [{"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                                          {"type": "text", "text": prompt}]
    elif api == "messages" and feature == "agent":
        body["messages"][0]["content"] = [{"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                                          {"type": "text", "text": prompt}]
    if api in ("chat", "completions"):
        if feature == "beams" and not stream:
            body.update(use_beam_search=True, n=2, temperature=0.0)
        if feature == "n2":
            body["n"] = 2
        elif feature == "stop":
            body["stop"] = ["\n", "."]
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            body["ignore_eos"] = True  # keeps streams going long enough for a reader to vanish mid-way
    return body


def malformed(rng: random.Random, model: str) -> tuple[str, str, bytes]:
    """(api, route, raw body) of a request the server must refuse with a 4xx in its error shape."""
    long_prompt = " ".join(["word"] * 3000)  # past --max-model-len once tokenized
    cases: list[tuple[str, Any]] = [
        ("chat", b'{"messages": [{"role": "user", "content": "hi"'),  # truncated JSON
        ("completions", b"[1, 2, 3]"),  # not an object
        ("messages", b"\xff\xfe\x00garbage"),  # not UTF-8
        ("chat", {"model": model, "messages": "hello"}),
        ("chat", {"model": model, "messages": [{"role": "wizard", "content": "x"}]}),
        ("chat", {"model": model, "messages": [{"role": "user", "content": "x"}], "n": 0}),
        ("completions", {"model": model, "prompt": "x", "max_tokens": -5}),
        ("completions", {"model": model, "prompt": "x", "temperature": 9}),
        ("completions", {"model": model, "prompt": "\ud800"}),  # lone surrogate, escaped by json.dumps
        ("completions", {"model": model, "prompt": long_prompt, "max_tokens": 4}),
        ("completions", {"model": "no-such-model", "prompt": "x"}),
        ("messages", {"model": model, "messages": [{"role": "user", "content": "hi"}]}),  # no max_tokens
        ("messages", {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": 5}]}),
        ("responses", {"model": model, "input": 5}),
        ("responses", {"model": model, "input": "x", "max_output_tokens": 0}),
        ("chat", {"model": model, "messages": [{"role": "user", "content": "x"}], "stream": True,
                  "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": 7}}}}),
    ]
    api, body = rng.choice(cases)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api, ROUTES[api], raw


# ---- reading and judging answers -------------------------------------------------------------------


def _error_shaped(api: str, body: Any) -> bool:
    if not isinstance(body, dict):
        return False
    if api == "messages":
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    err = body.get("error")
    return isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)


def judge_json(api: str, feature: str, n: int, body: dict[str, Any]) -> str | None:
    """None if a non-streamed 200 answer has the route's shape (and valid JSON where it was asked for)."""
    if api in ("chat", "completions"):
        choices = body.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            return f"expected {n} choices, got {choices!r:.200}"
        for c in choices:
            if api == "chat" and feature == "json" and c.get("finish_reason") == "stop":
                try:
                    json.loads(c["message"]["content"])
                except (TypeError, ValueError):
                    return f"json_schema answer is not JSON: {c['message']['content']!r:.200}"
        return None
    if api == "messages":
        ok = body.get("type") == "message" and isinstance(body.get("content"), list)
        return None if ok else f"not a message: {body!r:.200}"
    ok = body.get("object") == "response" and body.get("status") in ("completed", "incomplete")
    return None if ok else f"not a finished response: {body!r:.200}"


def judge_stream(api: str, n: int, events: list[tuple[str | None, str]]) -> str | None:
    """None if an SSE stream read to its end finished the way its API says a stream finishes."""
    datas = [d for _, d in events]
    if api in ("chat", "completions"):
        if not datas or datas[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {datas[-2:]!r:.200}"
        chunks = [json.loads(d) for d in datas[:-1]]
        if any("error" in c for c in chunks):
            return f"error in stream: {[c for c in chunks if 'error' in c][0]!r:.200}"
        indices = {ch["index"] for c in chunks for ch in c.get("choices", [])}
        return None if indices == set(range(n)) else f"choices {sorted(indices)} streamed, expected {n}"
    kinds = [json.loads(d).get("type") for d in datas]
    if api == "messages":
        if "error" in kinds or not kinds or kinds[0] != "message_start" or kinds[-1] != "message_stop":
            return f"bad message stream: {kinds[:2]}...{kinds[-2:]}{_error_event(datas, kinds, 'error')}"
        return None
    if not kinds or kinds[-1] not in ("response.completed", "response.incomplete"):
        return f"bad responses stream: ...{kinds[-3:]}{_error_event(datas, kinds, 'response.failed')}"
    return None


def _error_event(datas: list[str], kinds: list[str | None], kind: str) -> str:
    """The stream's error event, to say what went wrong (empty when it has none)."""
    return next((f" ({d[:300]})" for d, k in zip(datas, kinds, strict=True) if k == kind), "")


async def read_sse(resp: aiohttp.ClientResponse, *, delay: float = 0.0,
                   stop_after: int | None = None) -> list[tuple[str | None, str]]:
    """(event name, data) pairs; sleeps `delay` between lines (a slow reader); returns after
    `stop_after` data lines without reading on (the caller then drops the connection)."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            events.append((name, line[6:]))
            name = None
            if stop_after is not None and len(events) >= stop_after:
                return events
        if delay:
            await asyncio.sleep(delay)
    return events


# ---- one client ------------------------------------------------------------------------------------


async def one_request(session: aiohttp.ClientSession, base_url: str, rng: random.Random, model: str,
                      max_tokens: int) -> Outcome:
    behaviour = rng.choices(list(BEHAVIOURS), weights=list(BEHAVIOURS.values()))[0]
    if behaviour == "invalid":
        api, route, raw = malformed(rng, model)
        return await send_malformed(session, base_url + route, api, raw)
    api = rng.choice(APIS)
    feature = rng.choice(FEATURES)
    stream = rng.random() < 0.6 if behaviour not in ("vanish", "slow") else True
    if behaviour == "sdk":
        return await sdk_request(base_url, rng, api, stream, model, max_tokens)
    body = build_body(rng, api, feature, stream, model, max_tokens)
    n = body.get("n", 1)
    out = Outcome(behaviour, api, feature, stream)
    url = base_url + ROUTES[api]
    try:
        if behaviour == "abort":  # the client gives up before the answer: its task is cancelled
            task = asyncio.ensure_future(_post_and_read(session, url, body, stream))
            await asyncio.sleep(rng.uniform(0.0, 0.8))
            task.cancel()
            try:
                out.status, _ = await task
            except asyncio.CancelledError:
                pass
            return _no_5xx(out)
        if behaviour == "timeout":
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.05, 1.0))
            out.status, _ = await _post_and_read(session, url, body, stream, timeout=timeout)
            return _no_5xx(out)
        if behaviour == "vanish":
            async with session.post(url, json=body) as resp:
                out.status = resp.status
                if resp.status == 200:
                    await read_sse(resp, stop_after=rng.randint(0, 4))
                resp.close()  # drop the connection mid-stream
            return _no_5xx(out)
        delay = rng.uniform(0.02, 0.15) if behaviour == "slow" else 0.0
        async with session.post(url, json=body) as resp:
            out.status = resp.status
            if resp.status != 200:
                out.problem = f"well-formed request got {resp.status}: {(await resp.text())[:300]} (body {body})"
            elif stream:
                out.problem = judge_stream(api, n, await read_sse(resp, delay=delay))
            else:
                out.problem = judge_json(api, feature, n, await resp.json())
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        if behaviour not in ("timeout", "abort", "vanish"):
            out.problem = f"{type(exc).__name__}: {exc}"
    return out


async def send_malformed(session: aiohttp.ClientSession, url: str, api: str, raw: bytes) -> Outcome:
    """Post a body the server must refuse: a 4xx in the API's error shape, never anything else."""
    out = Outcome("invalid", api, "malformed", False)
    async with session.post(url, data=raw, headers={"Content-Type": "application/json"}) as resp:
        out.status = resp.status
        text = await resp.text(errors="replace")
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if not (400 <= resp.status < 500 and _error_shaped(api, parsed)):
        out.problem = f"malformed body got {resp.status} {text[:200]!r} (sent {raw[:80]!r})"
    return out


async def _post_and_read(session: aiohttp.ClientSession, url: str, body: dict[str, Any], stream: bool,
                         timeout: aiohttp.ClientTimeout | None = None) -> tuple[int, Any]:
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout else {}
    async with session.post(url, json=body, **kwargs) as resp:
        return resp.status, (await read_sse(resp) if stream else await resp.read())


def _no_5xx(out: Outcome) -> Outcome:
    if out.status is not None and out.status >= 500:
        out.problem = f"{out.behaviour} request got {out.status}"
    return out


async def sdk_request(base_url: str, rng: random.Random, api: str, stream: bool, model: str,
                      max_tokens: int) -> Outcome:
    """The same APIs through the official clients, which parse every event into their own types."""
    import anthropic
    import openai

    out = Outcome("sdk", api, "plain", stream)
    prompt = rng.choice(PROMPTS)
    messages: list[Any] = [{"role": "user", "content": prompt}]
    try:
        if api == "messages":
            async with anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0) as ac:
                if stream:
                    async with ac.messages.stream(model=model, max_tokens=max_tokens, messages=messages) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await ac.messages.create(model=model, max_tokens=max_tokens, messages=messages)
                assert msg.usage.output_tokens > 0
        else:
            async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as oc:
                if api == "responses":
                    r = await oc.responses.create(model=model, input=prompt, max_output_tokens=max_tokens)
                    assert r.status in ("completed", "incomplete")
                elif api == "completions":
                    c = await oc.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
                    assert len(c.choices) == 1
                elif stream:
                    chunks = [c async for c in await oc.chat.completions.create(
                        model=model, messages=messages, max_tokens=max_tokens, stream=True)]
                    assert any(c.choices and c.choices[0].finish_reason for c in chunks)
                else:
                    cc = await oc.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens)
                    assert cc.choices[0].message.content is not None
        out.status = 200
    except Exception as exc:  # any failure of a well-formed request breaks the contract
        out.problem = f"sdk {api} stream={stream}: {type(exc).__name__}: {exc}"
    return out


# ---- embeddings (a pooling server) -----------------------------------------------------------------

EMBED_INPUTS = ["A man is eating food.", "Paris is the capital of France.", "paged attention", "rust and python",
                "The quick brown fox jumps over the lazy dog."]


async def one_embedding_request(session: aiohttp.ClientSession, base_url: str, rng: random.Random,
                                model: str) -> Outcome:
    """One client of an embedding model's /v1/embeddings: the same behaviours as the generation storm
    (no streams: a vanishing client drops the connection before the answer)."""
    behaviour = rng.choices(list(BEHAVIOURS), weights=list(BEHAVIOURS.values()))[0]
    url = base_url + "/v1/embeddings"
    if behaviour == "invalid":
        raw = rng.choice([b'{"input": ["a"', json.dumps({"model": model, "input": []}).encode(),
                          json.dumps({"model": model, "input": [1.5]}).encode(),
                          json.dumps({"model": model, "input": " ".join(["word"] * 3000)}).encode(),
                          json.dumps({"model": model, "input": "x", "encoding_format": "hex"}).encode(),
                          json.dumps({"model": "no-such-model", "input": "x"}).encode()])
        return await send_malformed(session, url, "embeddings", raw)
    inputs = rng.sample(EMBED_INPUTS, rng.randint(1, 3))
    body: dict[str, Any] = {"model": model, "input": inputs if len(inputs) > 1 or rng.random() < 0.5 else inputs[0],
                            "encoding_format": rng.choice(["float", "base64"])}
    out = Outcome(behaviour, "embeddings", "plain", False)
    try:
        if behaviour == "sdk":
            import openai

            async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0) as oc:
                r = await oc.embeddings.create(model=model, input=inputs)
            out.status = 200
            if len(r.data) != len(inputs) or not all(d.embedding for d in r.data):
                out.problem = f"sdk embeddings: {len(r.data)} vectors for {len(inputs)} inputs"
            return out
        if behaviour in ("abort", "vanish", "timeout"):
            timeout = aiohttp.ClientTimeout(total=rng.uniform(0.001, 0.3))
            try:
                out.status, _ = await _post_and_read(session, url, body, False, timeout=timeout)
            except (asyncio.TimeoutError, aiohttp.ClientError):
                pass
            return _no_5xx(out)
        if behaviour == "slow":
            await asyncio.sleep(rng.uniform(0.0, 0.3))
        async with session.post(url, json=body) as resp:
            out.status = resp.status
            answer = await resp.json()
        n = len(body["input"]) if isinstance(body["input"], list) else 1
        if resp.status != 200:
            out.problem = f"well-formed request got {resp.status}: {answer!r:.300}"
        elif len(answer.get("data", [])) != n or answer["usage"]["prompt_tokens"] <= 0:
            out.problem = f"expected {n} embeddings with usage: {answer!r:.300}"
    except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
        out.problem = f"{type(exc).__name__}: {exc}"
    return out


async def reference_embeddings(base_url: str, model: str) -> list[list[float]]:
    """EMBED_INPUTS' vectors, one request each (the storm must not change them)."""
    vectors = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for text in EMBED_INPUTS:
            async with session.post(base_url + "/v1/embeddings", json={"model": model, "input": text}) as resp:
                vectors.append((await resp.json())["data"][0]["embedding"])
    return vectors


# ---- the storm and the checks around it ------------------------------------------------------------


async def run_storm(base_url: str, *, requests: int, concurrency: int, seed: int = 0, max_tokens: int = 12,
                    model: str | list[str] | None = None, into: StormReport | None = None,
                    embeddings: bool = False) -> StormReport:
    """`requests` clients, at most `concurrency` at a time, each drawing its behaviour, API and features
    from a random generator seeded with `seed` (so a failing storm can be replayed). Outcomes are
    appended to `into` as they come (the soak's running total) when given. A list of models (a base
    model and its LoRA adapters' names): each client picks one. embeddings: the server runs an
    embedding model; clients call /v1/embeddings."""
    rng = random.Random(seed)
    report = into if into is not None else StormReport()
    started = time.monotonic()
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        if model is None:
            async with session.get(base_url + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]

        models = [model] if isinstance(model, str) else list(model)

        async def client(i: int) -> None:
            async with sem:
                crng = random.Random(rng.random())
                try:
                    # (One model: no draw, so a seed replays the storm it always did.)
                    chosen = crng.choice(models) if len(models) > 1 else models[0]
                    if embeddings:
                        report.outcomes.append(await one_embedding_request(session, base_url, crng, chosen))
                    else:
                        report.outcomes.append(await one_request(session, base_url, crng, chosen, max_tokens))
                except Exception as exc:  # a bug in a client must show, not hide the others' results
                    report.outcomes.append(Outcome("crash", "?", "?", False, problem=repr(exc)))

        await asyncio.gather(*(client(i) for i in range(requests)))
    report.seconds += time.monotonic() - started
    return report


def scrape(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (all engines) whose labels include `labels`; 0.0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def settle(base_url: str, timeout: float = 60.0, idle_usage: float = 0.0) -> tuple[bool, str]:
    """Wait until nothing runs or waits and KV usage is back to `idle_usage`; (settled, last state)."""
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(base_url)
        state = {k: metric(text, f"ferrox:{k}") for k in ("num_requests_running", "num_requests_waiting",
                                                         "kv_cache_usage_perc")}
        if state["num_requests_running"] == 0 and state["num_requests_waiting"] == 0 and \
                state["kv_cache_usage_perc"] <= idle_usage:
            return True, str(state)
        if time.monotonic() > deadline:
            return False, str(state)
        time.sleep(0.25)


async def greedy_answers(base_url: str, model: str, max_tokens: int = 16) -> list[str]:
    """Temperature-0 answers to fixed prompts, one at a time (completions and chat)."""
    answers: list[str] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        for prompt in GREEDY_PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            async with session.post(base_url + "/v1/completions", json=body) as resp:
                answers.append((await resp.json())["choices"][0]["text"])
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0}
            async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
                answers.append((await resp.json())["choices"][0]["message"]["content"])
    return answers


# aiohttp's "Error handling request" traceback when a handler writes to a client that has just gone:
# a race between the write and the handler's cancellation. server.py's error middleware now turns it
# into a quiet 499; still counted apart (not as a failure) should aiohttp raise it from elsewhere.
DISCONNECT_RACE = "ClientConnectionResetError: Cannot write to closing transport"


def server_errors(log: list[str]) -> tuple[list[str], int]:
    """(5xx access-log lines and tracebacks, with the lines that follow, in a server's output;
    the number of tracebacks that are only the known DISCONNECT_RACE)."""
    found, races = [], 0
    for i, line in enumerate(log):
        if re.search(r'" 5\d\d ', line) or "internal error" in line:
            found.append(line)
        elif line.startswith("Traceback") and not _in_traceback(log, i):
            # The whole (possibly chained) traceback runs to the next timestamped log line; its last
            # line is the exception that escaped.
            end = next((j for j in range(i + 1, len(log)) if _LOG_LINE.match(log[j])), len(log))
            last = next((ln for ln in reversed(log[i:end]) if ln.strip()), "")
            if last.endswith(DISCONNECT_RACE):
                races += 1
            else:
                found.append("\n".join(log[max(0, i - 2):end]))
    return found, races


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:")


def _in_traceback(log: list[str], i: int) -> bool:
    """Whether line i continues a traceback begun above it (a chained exception's second part)."""
    for j in range(i - 1, -1, -1):
        if _LOG_LINE.match(log[j]):
            return False
        if log[j].startswith("Traceback"):
            return True
    return False


def summarize(report: StormReport) -> str:
    by = report.counts()
    lines = [f"requests: {len(report.outcomes)} in {report.seconds:.1f} s "
             f"({len(report.outcomes) / max(report.seconds, 1e-9):.1f} req/s)",
             "behaviours: " + ", ".join(f"{k}={v}" for k, v in sorted(by.items())),
             "statuses: " + ", ".join(f"{k}={v}" for k, v in sorted(Counter(str(o.status) for o in
                                                                            report.outcomes).items())),
             f"problems: {len(report.problems)}"]
    lines += [f"  {o.behaviour} {o.api} {o.feature} stream={o.stream}: {o.problem}" for o in report.problems[:20]]
    return "\n".join(lines)


# ---- soak --------------------------------------------------------------------------------------------


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds and threads of one process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "threads": int(status["Threads"]),
            "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def core_pids(server_pid: int) -> list[int]:
    """The engine-core processes: the API server's children (one per data-parallel rank), less
    multiprocessing's resource tracker."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) != server_pid:
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"resource_tracker" not in f.read():
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return sorted(pids)


async def soak(base_url: str, server_pid: int, args: argparse.Namespace) -> tuple[list[dict[str, Any]], StormReport]:
    """Back-to-back storms for --soak-minutes while a sampler records each process every --sample-seconds."""
    samples: list[dict[str, Any]] = []
    total = StormReport()
    end = time.monotonic() + args.soak_minutes * 60
    started = time.monotonic()

    async def sampler() -> None:
        while True:
            row: dict[str, Any] = {"minute": round((time.monotonic() - started) / 60, 2),
                                   "kv_usage": metric(scrape(base_url), "ferrox:kv_cache_usage_perc"),
                                   "requests": len(total.outcomes), "server": proc_sample(server_pid)}
            for i, pid in enumerate(core_pids(server_pid)):
                row[f"core{i}"] = proc_sample(pid)
            samples.append(row)
            print("sample", json.dumps(row), flush=True)
            await asyncio.sleep(args.sample_seconds)

    task = asyncio.ensure_future(sampler())
    seed = args.seed
    while time.monotonic() < end:
        await run_storm(base_url, requests=args.requests, concurrency=args.concurrency, seed=seed,
                        max_tokens=args.max_tokens, into=total)
        seed += 1
    task.cancel()
    return samples, total


def growth(samples: list[dict[str, Any]], warmup_minutes: float) -> dict[str, float]:
    """Percent change of each sampled quantity from the first sample after warm-up to the last."""
    after = [s for s in samples if s["minute"] >= warmup_minutes] or samples
    first, last = after[0], after[-1]
    out = {}
    for proc in (k for k in first if isinstance(first[k], dict)):
        for key, value in first[proc].items():
            if proc in last and value:
                out[f"{proc}.{key}"] = 100.0 * (last[proc][key] - value) / value
    return out


# ---- command line ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running server (default: start `ferrox serve` here)")
    parser.add_argument("--requests", type=int, default=2000, help="requests per storm")
    parser.add_argument("--concurrency", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-memory", default="48MiB", help="for the server started here")
    # float32 by default: see tests/server/test_chaos.py (bfloat16 greedy ties flip with prefix-cache hits).
    parser.add_argument("--serve-args", default="--dtype float32", help="more flags for the server started here")
    parser.add_argument("--soak-minutes", type=float, default=0.0)
    parser.add_argument("--sample-seconds", type=float, default=60.0)
    parser.add_argument("--warmup-minutes", type=float, default=5.0)
    args = parser.parse_args()

    srv = None
    base_url = args.base_url
    if base_url is None:
        sys.path.insert(0, str(ROOT))
        from tests.server.server_proc import ServerProcess

        srv = ServerProcess("--kv-cache-memory", args.kv_cache_memory, *args.serve_args.split())
        base_url = srv.base_url
    try:
        return asyncio.run(_run(base_url, srv, args))
    finally:
        if srv is not None:
            srv.stop()


async def _run(base_url: str, srv: Any, args: argparse.Namespace) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
    idle = metric(scrape(base_url), "ferrox:kv_cache_usage_perc")
    before = await greedy_answers(base_url, model)
    preempt0 = metric(scrape(base_url), "ferrox:num_preemptions_total")
    samples: list[dict[str, Any]] = []
    if args.soak_minutes > 0:
        if srv is None:
            print("--soak-minutes samples the server's processes: start it here (no --base-url)")
            return 2
        samples, report = await soak(base_url, srv.proc.pid, args)
    else:
        report = await run_storm(base_url, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                                 max_tokens=args.max_tokens, model=model)
    settled, state = settle(base_url, idle_usage=idle)
    after = await greedy_answers(base_url, model)
    failures = [o.problem for o in report.problems]
    if not settled:
        failures.append(f"server did not settle: {state}")
    if after != before:
        failures.append(f"greedy answers changed: {before} -> {after}")
    errors, races = server_errors(srv.log) if srv is not None else ([], 0)
    failures += errors[:5]
    print()
    if samples:
        for proc_key, pct in sorted(growth(samples, args.warmup_minutes).items()):
            print(f"growth after warm-up {proc_key}: {pct:+.1f}%")
    print(summarize(report))
    print(f"preemptions: {metric(scrape(base_url), 'ferrox:num_preemptions_total') - preempt0:.0f}")
    print(f"settled: {settled} {state}")
    print(f"greedy answers unchanged: {after == before}")
    print(f"server 5xx/tracebacks: {len(errors)} (and {races} of the known disconnect race)")
    for line in failures[:10]:
        print("  failure:", str(line)[:4000])
    print(f"RESULT: {'PASS' if not failures else 'FAIL'} ({len(failures)} failures)")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
