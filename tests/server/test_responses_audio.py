"""Audio on POST /v1/responses (`input_audio` parts, OpenAI's ResponseInputAudioParam, and vLLM's `audio_url`) on a
live `ferrox serve` of a tiny random Qwen2-Audio (tests/helpers/tiny_qwen2_audio.py) that keeps responses, against
the same server's /v1/chat/completions on the same clip, greedy:

- the Responses answer (plain, streamed, and with the clip as an audio_url data URL) is the chat answer, with the
  same prompt token count;
- a stored response's input_items show the audio part as sent, and previous_response_id continues the
  conversation with the clip in it (the chat answer to the whole conversation);
- 400s naming the Responses field (input[i].content[j]..., counted as the client sent them: instructions first,
  a text message before): bad base64, a non-audio payload, an unknown format, a missing one, a bad audio_url,
  more clips than --limit-mm-per-prompt, an image; the server keeps serving;
- the session's SmolLM2 (text only) refuses an audio part by name;
- the Anthropic Messages API has no audio block: one sent there is refused naming its type."""

from __future__ import annotations

import base64
import json
import urllib.request

import numpy as np
import pytest

from tests.helpers.audio_clips import wav_bytes
from tests.helpers.tiny_qwen2_audio import make_tiny_qwen2_audio
from tests.server.server_proc import ServerProcess, openai_client
from tests.server.server_proc import post_json as post

pytest.importorskip("av")
openai = pytest.importorskip("openai")

RATE = 16_000
MAX_TOKENS = 8
QUESTION = "What is it?"


def _clip(seconds: float, hz: float, seed: int) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    noise = 0.1 * np.random.default_rng(seed).standard_normal(len(t))
    return (0.5 * np.sin(2 * np.pi * hz * t) + noise).astype(np.float32)


WAV = base64.b64encode(wav_bytes(_clip(1.2, 440, 1))).decode()


def _input_audio(data: str = WAV, fmt: str | None = "wav") -> dict:
    body = {"data": data} if fmt is None else {"data": data, "format": fmt}
    return {"type": "input_audio", "input_audio": body}


def _user(*parts: dict, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [*parts, {"type": "input_text", "text": text}]}


def _chat_user(*parts: dict, text: str = QUESTION) -> dict:
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(the Qwen2-Audio server, keeping responses, one clip a prompt,). (A model without audio: the session's
    SmolLM2; a vision-only model refuses through the same chat-part check, tested on the chat route.)"""
    srv = ServerProcess(make_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2a")), "--served-model-name", "qa",
                        "--dtype", "float32", "--limit-mm-per-prompt", '{"audio": 1}',
                        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    try:
        yield (srv,)
    finally:
        assert srv.stop() == 0, "\n".join(srv.log[-30:])


@pytest.fixture(scope="module")
def client(servers):
    with openai_client(servers[0]) as c:
        yield c


def _chat_text(client, messages: list[dict]) -> tuple[str, int]:
    out = client.chat.completions.create(model="qa", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    return out.choices[0].message.content or "", out.usage.prompt_tokens


def test_responses_audio_answers_as_chat(client):
    want, prompt_tokens = _chat_text(client, [_chat_user(_input_audio())])
    got = client.responses.create(model="qa", input=[_user(_input_audio())], max_output_tokens=MAX_TOKENS,
                                  temperature=0, store=False)
    assert got.status in ("completed", "incomplete") and got.output_text == want
    assert got.usage.input_tokens == prompt_tokens and got.usage.output_tokens > 0
    # vLLM's audio_url part (a data URL here), which its Responses route takes as its chat route does.
    url = {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + WAV}}
    by_url = client.responses.create(model="qa", input=[_user(url)], max_output_tokens=MAX_TOKENS, temperature=0,
                                     store=False)
    assert by_url.output_text == want
    stream = client.responses.create(model="qa", input=[_user(_input_audio())], max_output_tokens=MAX_TOKENS,
                                     temperature=0, store=False, stream=True)
    events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want


def test_stored_input_items_keep_the_audio_and_chaining_replays_it(client, servers):
    first = client.responses.create(model="qa", input=[_user(_input_audio())], max_output_tokens=MAX_TOKENS,
                                    temperature=0)
    with urllib.request.urlopen(f"{servers[0].base_url}/v1/responses/{first.id}/input_items?order=asc",
                                timeout=60) as resp:
        items = json.loads(resp.read())["data"]
    assert [(item["type"], item["role"]) for item in items] == [("message", "user")]
    assert items[0]["content"] == [_input_audio(), {"type": "input_text", "text": QUESTION}]
    follow = "Say it again."
    second = client.responses.create(model="qa", input=follow, previous_response_id=first.id,
                                     max_output_tokens=MAX_TOKENS, temperature=0)
    want, prompt_tokens = _chat_text(client, [_chat_user(_input_audio()),
                                              {"role": "assistant", "content": first.output_text},
                                              {"role": "user", "content": follow}])
    assert second.output_text == want and second.usage.input_tokens == prompt_tokens
    # A clip in the stored conversation counts toward the next prompt's --limit-mm-per-prompt (1 here).
    status, body = post(servers[0].base_url, {"model": "qa", "input": [_user(_input_audio())],
                                              "previous_response_id": second.id, "max_output_tokens": 2},
                        "/v1/responses")
    assert status == 400 and "2 audio clips, at most 1" in body["error"]["message"], body


@pytest.mark.parametrize(("part", "message"), [
    (_input_audio("%%%not base64"), "input[1].content[0].input_audio.data: not valid base64"),
    (_input_audio(base64.b64encode(b"plain text, no audio in here" * 8).decode()),
     "input[1].content[0].input_audio.data: not decodable audio"),
    (_input_audio(fmt="aiff"), "input[1].content[0].input_audio.format: 'aiff' is not an audio format"),
    (_input_audio(fmt=None), "input[1].content[0].input_audio.format: missing"),
    ({"type": "input_audio", "input_audio": WAV}, "input[1].content[0].input_audio: must be an object"),
    ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,@@@"}}, "input[1].content[0].audio_url.url: "),
    ({"type": "input_image", "image_url": "data:image/png;base64,AAAA"}, "takes no images"),
], ids=["base64", "not-audio", "format", "no-format", "not-object", "audio-url", "image"])
def test_bad_audio_is_a_400_naming_the_field(servers, part, message):
    """Instructions (the chat's system message) and a text message come before the part: the error counts input
    items as the client sent them."""
    base_url = servers[0].base_url
    body = {"model": "qa", "instructions": "Be brief.", "max_output_tokens": 2, "store": False,
            "input": [{"role": "user", "content": "Listen."}, _user(part)]}
    status, err = post(base_url, body, "/v1/responses")
    assert status == 400 and err["error"]["param"] == "input", err
    assert message in err["error"]["message"], err
    status, out = post(base_url, {**body, "input": [_user(_input_audio())]}, "/v1/responses")
    assert status == 200 and out["status"] in ("completed", "incomplete"), out  # the server serves on


def test_more_clips_than_the_limit(servers):
    status, err = post(servers[0].base_url, {"model": "qa", "store": False, "max_output_tokens": 2,
                                             "input": [_user(_input_audio(), _input_audio())]}, "/v1/responses")
    assert status == 400 and "2 audio clips, at most 1" in err["error"]["message"], err


def test_models_without_audio_refuse_it_by_name(servers, base_url):
    """The text-only SmolLM2 refuses the part by name, as its chat route does."""
    for url, model in ((base_url, "smol"),):
        for part in (_input_audio(), {"type": "audio_url", "audio_url": "data:audio/wav;base64," + WAV}):
            status, err = post(url, {"model": model, "max_output_tokens": 2, "input": [_user(part)]}, "/v1/responses")
            assert status == 400 and err["error"]["param"] == "input", err
            assert err["error"]["message"].startswith(
                f"input[0].content[0]: content part type {part['type']!r} is not supported by "), err
            assert "takes no audio inputs" in err["error"]["message"], err


def test_anthropic_messages_refuse_an_audio_block_by_name(servers):
    """Anthropic's Messages API defines no audio block: one sent (OpenAI's shape, or an `audio` type) is a 400
    naming its type, even on a model that takes audio."""
    for block in (_input_audio(), {"type": "audio", "source": {"type": "base64", "media_type": "audio/wav",
                                                               "data": WAV}}):
        body = {"model": "qa", "max_tokens": 2, "messages": [{"role": "user", "content": [block]}]}
        status, err = post(servers[0].base_url, body, "/v1/messages")
        assert status == 400 and err["type"] == "error", err
        assert f"content block type {block['type']!r} is not supported" in err["error"]["message"], err
