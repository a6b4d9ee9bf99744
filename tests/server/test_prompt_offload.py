"""Prompt processing off the event loop, and an API server without torch.

Chat rendering and encoding run in the engine's prompt threads: requests with a 200k-character
prompt (tokenized, rejected as too long) arrive together with short streaming requests and
/health probes, and everything answers correctly. Errors raised in those threads still reach
the client as before (status, message and param naming the field).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiohttp
import pytest
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

from tests.server.conftest import BODY_LIMIT, MAX_MODEL_LEN
from tests.server.server_proc import ROOT

LONG_CHARS = 200_000
_WORDS = ["alpha", "Zürich", "bravo", "42", "東京", "charlie,", "delta.", "echo\n", "foxtrot", "golf"]


def long_text() -> str:
    """~200k characters of varied words (multi-byte ones too), well past MAX_MODEL_LEN tokens."""
    parts, size, i = [], 0, 0
    while size < LONG_CHARS:
        word = f"{_WORDS[i % len(_WORDS)]}{i % 997} "
        parts.append(word)
        size += len(word)
        i += 1
    return "".join(parts)[:LONG_CHARS]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))  # the embedded model the session server serves


async def _json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    """(concatenated text, parsed events) of an SSE stream; the last event must be [DONE]."""
    events: list[Any] = []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert events and events[-1] == "[DONE]", events[-3:]
    text = ""
    for event in events[:-1]:
        for choice in event.get("choices", []):
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text, events[:-1]


SHORT_CHAT = {"messages": [{"role": "user", "content": "Name three colors."}], "temperature": 0,
              "max_tokens": 8, "ignore_eos": True, "stream_options": {"include_usage": True}}
SHORT_COMPLETION = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 8, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}


def test_long_prompts_do_not_disturb_short_requests(base_url, tokenizer):
    text = long_text()
    assert len(json.dumps({"prompt": text})) < BODY_LIMIT  # aiohttp sends non-ASCII as \u escapes
    expected_ids = tokenizer.backend.encode(text, add_special_tokens=True).ids  # the plain (GIL-holding) call
    assert len(expected_ids) > MAX_MODEL_LEN
    chat_url, completion_url = base_url + "/v1/chat/completions", base_url + "/v1/completions"

    async def health_probes(session: aiohttp.ClientSession, stop: asyncio.Event) -> list[int]:
        statuses = []
        while not stop.is_set():
            async with session.get(base_url + "/health") as resp:
                statuses.append(resp.status)
            await asyncio.sleep(0.01)
        return statuses

    async def run() -> tuple[Any, ...]:
        async with aiohttp.ClientSession() as session:
            # The short requests alone first: what they must answer under load too.
            solo_chat = await _stream(session, chat_url, SHORT_CHAT)
            solo_completion = await _stream(session, completion_url, SHORT_COMPLETION)
            stop = asyncio.Event()
            probes = asyncio.create_task(health_probes(session, stop))
            loaded = await asyncio.gather(
                _json(session, base_url + "/tokenize", {"prompt": text}),
                _json(session, completion_url, {"prompt": text, "max_tokens": 4}),
                _json(session, chat_url, {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
                _json(session, base_url + "/v1/messages",
                      {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
                *[_stream(session, chat_url, SHORT_CHAT) for _ in range(3)],
                *[_stream(session, completion_url, SHORT_COMPLETION) for _ in range(2)],
            )
            stop.set()
            return solo_chat, solo_completion, loaded, await probes

    solo_chat, solo_completion, loaded, health = asyncio.run(run())
    (tok_status, tok_body), (cmpl_status, cmpl_body), (chat_status, chat_body), (msg_status, msg_body) = loaded[:4]
    assert tok_status == 200, tok_body
    assert tok_body["tokens"] == expected_ids and tok_body["count"] == len(expected_ids)
    # Too long for the model: rejected, naming the field, after tokenizing in the prompt threads.
    assert cmpl_status == 400 and cmpl_body["error"]["param"] == "prompt", cmpl_body
    assert cmpl_body["error"]["code"] == "context_length_exceeded"
    assert chat_status == 400 and chat_body["error"]["param"] == "messages", chat_body
    assert msg_status == 400 and msg_body["type"] == "error", msg_body
    for text_out, events in loaded[4:7]:
        assert text_out == solo_chat[0]
        assert events[-1]["usage"]["completion_tokens"] == 8
    for text_out, events in loaded[7:]:
        assert text_out == solo_completion[0]
        assert events[-1]["usage"]["completion_tokens"] == 8
    assert health and all(status == 200 for status in health)


def test_prompt_errors_still_name_the_field(base_url):
    async def run() -> list[tuple[int, Any]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                _json(session, base_url + "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"}),
                # A template variable clashing with the call's own arguments fails while rendering.
                _json(session, base_url + "/tokenize",
                      {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}}),
                _json(session, base_url + "/v1/completions", {"prompt": "", "max_tokens": 2}),
                _json(session, base_url + "/v1/completions", {"prompt": [10**7], "max_tokens": 2}),
                _json(session, base_url + "/detokenize", {"tokens": [1, 10**7]}),
            )

    bad_template, bad_kwargs, empty, out_of_vocab, detok = asyncio.run(run())
    for status, body in (bad_template, bad_kwargs):
        assert status == 400 and body["error"]["param"] == "messages", body
        assert body["error"]["message"].startswith("chat template:")
    assert empty[0] == 400 and empty[1]["error"]["param"] == "prompt", empty
    assert empty[1]["error"]["message"] == "prompt: must not be empty"
    assert out_of_vocab[0] == 400 and out_of_vocab[1]["error"]["param"] == "prompt", out_of_vocab
    assert "outside the vocabulary" in out_of_vocab[1]["error"]["message"]
    assert detok[0] == 400 and detok[1]["error"]["param"] == "tokens", detok


def test_chunked_body_over_limit_is_413(base_url):
    """No Content-Length: aiohttp stops reading at the limit; still an OpenAI-shaped 413."""

    async def chunks():
        body = json.dumps({"prompt": "x" * (BODY_LIMIT + 10)}).encode()
        for start in range(0, len(body), 64 << 10):
            yield body[start:start + (64 << 10)]

    async def run() -> tuple[int, Any]:
        async with aiohttp.ClientSession() as session:
            async with session.post(base_url + "/v1/completions", data=chunks(),
                                    headers={"Content-Type": "application/json"}) as resp:
                return resp.status, await resp.json(content_type=None)

    status, body = asyncio.run(run())
    assert status == 413, body
    assert body["error"]["code"] == "request_too_large" and str(BODY_LIMIT) in body["error"]["message"]


def _mapped_files(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/maps")
def test_api_server_process_does_not_load_torch(server):
    """The server process only tokenizes: torch's library is mapped in the core process alone."""
    assert server.core_pid is not None
    assert "libtorch" in _mapped_files(server.core_pid)  # the probe sees torch where it is loaded
    assert "libtorch" not in _mapped_files(server.proc.pid)


_NO_TORCH_SCRIPT = """
import sys
import ferrox.entrypoints.cli
import ferrox.entrypoints.openai.server
from ferrox.engine.output_processor import OutputProcessor
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer

for path in sys.argv[1:] or [None]:
    tok = load_tokenizer(resolve_model(path))
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert tok.encode(text, add_special_tokens=False)
    OutputProcessor(tok)
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
print("ok")
"""


def test_front_end_does_not_import_torch(tmp_path):
    """The front-end pieces (server modules, tokenizer loading for a GGUF and an HF folder, chat
    rendering, output processing) in a fresh interpreter: torch stays out of sys.modules."""
    from tests.helpers.tiny_models import make_tiny_llama

    folder = make_tiny_llama(tmp_path / "llama")
    for args in ([], [str(folder)]):
        result = subprocess.run([sys.executable, "-c", _NO_TORCH_SCRIPT, *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_front_end_prepares_images_without_torch(tmp_path):
    """A vision model's image rules (multimodal/processing.py: decoding, pixels, placeholder expansion) run in
    the API server process too: still without torch."""
    from tests.helpers.tiny_models import make_tiny_llava

    folder = make_tiny_llava(tmp_path / "llava")
    script = f"""
import sys, json, numpy as np
from PIL import Image
from ferrox.loader.source import resolve_model
from ferrox.loader.tokenizer import load_tokenizer
from ferrox.multimodal.processing import image_prompts_for_model
tok = load_tokenizer(resolve_model({str(folder)!r}))
rules = image_prompts_for_model({str(folder)!r}, json.load(open({str(folder)!r} + "/config.json")), tok)
ids, items = rules.expand(tok.encode("a <image> b"), [Image.new("RGB", (30, 20))], "prompt")
assert len(items) == 1 and items[0].length == 16
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
assert not loaded, loaded
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
