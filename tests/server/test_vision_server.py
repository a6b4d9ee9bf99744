"""Images over HTTP (`ferrox serve` of a tiny LLaVA): the openai client's chat messages with image_url
parts (a data URL, and an http URL the server fetches), streamed and not, the same tokens as the offline
LLM on the same images; Anthropic's image blocks and the Responses API's input_image parts take the same
path; bad images are 400s naming the part, and the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import numpy as np
import pytest
from ferrox import LLM, SamplingParams

from tests.helpers.tiny_models import make_tiny_llava
from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as _post

openai = pytest.importorskip("openai")
PIL = pytest.importorskip("PIL.Image")


def _image():
    return PIL.fromarray(np.random.default_rng(3).integers(0, 255, (60, 80, 3), dtype=np.uint8))


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    folder = make_tiny_llava(tmp_path_factory.mktemp("llava"))
    png = _png(_image())

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = png if self.path == "/cat.png" else b"not an image"
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    media = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    reference = LLM(model=folder, dtype="float32", device="cpu")
    srv = ServerProcess(folder, "--served-model-name", "llava", "--dtype", "float32", "--limit-mm-per-prompt",
                        '{"image": 2}')
    try:
        yield srv, reference, png, f"http://127.0.0.1:{media.server_address[1]}"
    finally:
        srv.stop()
        media.shutdown()


def _messages(url: str, n: int = 1) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(n)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]


def test_chat_with_images_matches_offline(vision_server):
    srv, reference, png, media_url = vision_server
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    expected = reference.chat(_messages(data_url), SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x")
    for url in (data_url, media_url + "/cat.png"):
        out = client.chat.completions.create(model="llava", messages=_messages(url), max_tokens=8, temperature=0,
                                             logprobs=True, extra_body={"return_tokens_as_token_ids": True})
        ids = [int(t.token.split(":")[1]) for t in out.choices[0].logprobs.content]
        assert ids == list(expected.outputs[0].token_ids)
        assert out.usage.prompt_tokens == len(expected.prompt_token_ids)  # the image's 16 tokens counted
    stream = client.chat.completions.create(model="llava", messages=_messages(data_url), max_tokens=8,
                                            temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == expected.outputs[0].text


def test_bad_images_are_400s_naming_the_part(vision_server):
    srv, _, png, media_url = vision_server
    cases = [
        (_messages("data:image/png;base64,@@@"), r"messages\[0\].content\[0\].image_url.url"),
        (_messages(media_url + "/junk"), r"messages\[0\].content\[0\].image_url.url"),
        (_messages("file:///etc/passwd"), "allowed-local-media-path"),
        (_messages("ftp://example.com/x.png"), "ftp"),
        (_messages("data:image/png;base64," + base64.b64encode(png).decode(), n=3), "at most 2"),
        ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "input_audio"),
    ]
    for messages, pattern in cases:
        status, body = _post(srv.base_url, {"model": "llava", "messages": messages, "max_tokens": 2})
        assert status == 400, body
        import re

        assert re.search(pattern, body["error"]["message"]), body
    status, body = _post(srv.base_url, {"model": "llava", "messages": _messages(media_url + "/cat.png"),
                                        "max_tokens": 2})
    assert status == 200, body


def test_anthropic_and_responses_images(vision_server):
    srv, reference, png, media_url = vision_server
    b64 = base64.b64encode(png).decode()
    expected = reference.chat(_messages("data:image/png;base64," + b64), SamplingParams(max_tokens=8, temperature=0),
                              use_tqdm=False)[0].outputs[0].text
    anthropic_body = {"model": "llava", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "What is this?"}]}]}
    status, body = _post(srv.base_url, anthropic_body, "/v1/messages")
    assert status == 200, body
    assert body["content"][0]["text"] == expected
    url_body = {**anthropic_body, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": media_url + "/cat.png"}},
        {"type": "text", "text": "What is this?"}]}]}
    status, body = _post(srv.base_url, url_body, "/v1/messages")
    assert status == 200 and body["content"][0]["text"] == expected, body
    responses_body = {"model": "llava", "max_output_tokens": 8, "temperature": 0, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64," + b64},
        {"type": "input_text", "text": "What is this?"}]}]}
    status, body = _post(srv.base_url, responses_body, "/v1/responses")
    assert status == 200, body
    assert body["output"][-1]["content"][0]["text"] == expected
    bad = {**responses_body, "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}
    status, body = _post(srv.base_url, bad, "/v1/responses")
    assert status == 400 and "file_id" in body["error"]["message"], body


def test_tokenize_counts_the_image_tokens(vision_server):
    srv, reference, png, _ = vision_server
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    expected = reference.chat(_messages(url), SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    status, body = _post(srv.base_url, {"model": "llava", "messages": _messages(url)}, "/tokenize")
    assert status == 200, body
    assert body["tokens"] == list(expected) and body["count"] == len(expected)
