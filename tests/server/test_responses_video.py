"""Videos on POST /v1/responses (vLLM's `video_url` part, the url an object or a plain string) on a live `ferrox serve`
of the tiny random Qwen2.5-VL of tests/multimodal/test_video_inputs.py (its clip, written with PyAV), keeping
responses, with --media-io-kwargs keeping 4 of the clip's 6 frames, against the same server's /v1/chat/completions
on the same video, greedy:

- the Responses answer (either url form) is the chat answer with the same prompt token count, which is a 4-frame
  clip's (--media-io-kwargs applied on both routes);
- a stored response's input_items show the video part as sent; a continuation adding a second video goes past
  --limit-mm-per-prompt, as two videos in one request do;
- 400s naming the Responses field (input[i].content[j].video_url..., counted as the client sent them: instructions
  first, a text message before): undecodable bytes, a bad data URL, a missing url, too many videos; the server
  keeps serving;
- the session's text-only SmolLM2 refuses the part by name."""

from __future__ import annotations

import base64
import json
import urllib.request

import pytest

from tests.helpers.tiny_qwen2_vl_video import make_tiny_qwen2_vl_video, write_video
from tests.multimodal.test_video_inputs import _colours, _data_url
from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as post

pytest.importorskip("av")

MAX_TOKENS = 6
QUESTION = "What happens?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(the server, the 6-frame clip's data URL, a 4-frame clip's): the server samples 4 frames a video."""
    root = tmp_path_factory.mktemp("responses_video")
    folder = make_tiny_qwen2_vl_video(root / "qwen2_5_vl", version="qwen2_5_vl")
    clips = [_data_url(open(write_video(str(root / f"clip{n}.webm"), _colours(n), fps=4), "rb").read())
             for n in (6, 4)]
    srv = ServerProcess(folder, "--served-model-name", "qwen", "--dtype", "float32", "--limit-mm-per-prompt",
                        '{"video": 1}', "--media-io-kwargs", '{"video": {"num_frames": 4}}',
                        env={"VLLM_ENABLE_RESPONSES_API_STORE": "1"})
    try:
        yield srv, clips[0], clips[1]
    finally:
        assert srv.stop() == 0, "\n".join(srv.log[-30:])


def _video(url: str, as_object: bool = True) -> dict:
    return {"type": "video_url", "video_url": {"url": url} if as_object else url}


def _user(*parts: dict) -> dict:
    return {"role": "user", "content": [*parts, {"type": "input_text", "text": QUESTION}]}


def _chat(base_url: str, messages: list[dict]) -> tuple[str, int]:
    status, out = post(base_url, {"model": "qwen", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert status == 200, out
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens"]


def _chat_user(url: str) -> dict:
    return {"role": "user", "content": [_video(url), {"type": "text", "text": QUESTION}]}


def _respond(base_url: str, body: dict) -> dict:
    status, out = post(base_url, {"model": "qwen", "max_output_tokens": MAX_TOKENS, "temperature": 0, **body},
                       "/v1/responses")
    assert status == 200 and out["status"] in ("completed", "incomplete"), out
    return out


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])


def test_responses_video_answers_as_chat(setup):
    srv, clip, four_frames = setup
    want, prompt_tokens = _chat(srv.base_url, [_chat_user(clip)])
    assert _chat(srv.base_url, [_chat_user(four_frames)])[1] == prompt_tokens  # --media-io-kwargs kept 4 frames
    for as_object in (True, False):
        got = _respond(srv.base_url, {"input": [_user(_video(clip, as_object))], "store": False})
        assert _text(got) == want, (as_object, got)
        assert got["usage"]["input_tokens"] == prompt_tokens and got["usage"]["output_tokens"] > 0, got


def test_stored_input_items_keep_the_video_and_the_limit_counts_history(setup):
    srv, clip, _ = setup
    part = _video(clip, as_object=False)
    first = _respond(srv.base_url, {"input": [_user(part)]})
    with urllib.request.urlopen(f"{srv.base_url}/v1/responses/{first['id']}/input_items?order=asc",
                                timeout=60) as resp:
        items = json.loads(resp.read())["data"]
    assert [item["content"] for item in items] == [[part, {"type": "input_text", "text": QUESTION}]]
    # The stored conversation's video counts toward the next prompt's --limit-mm-per-prompt (1 here).
    status, err = post(srv.base_url, {"model": "qwen", "input": [_user(_video(clip))], "max_output_tokens": 2,
                                      "previous_response_id": first["id"]}, "/v1/responses")
    assert status == 400 and "2 videos, at most 1" in err["error"]["message"], err


NOT_A_VIDEO = "data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()


@pytest.mark.parametrize(("parts", "message"), [
    ([_video(NOT_A_VIDEO)], "input[1].content[0].video_url.url: not a decodable video"),
    ([_video("data:video/mp4;base64,@@@", as_object=False)], "input[1].content[0].video_url.url: "),
    ([{"type": "video_url", "video_url": {}}], "input[1].content[0].video_url.url: a video part needs a url"),
    ([_video(NOT_A_VIDEO), _video(NOT_A_VIDEO)], "input[1].content[0]: 2 videos, at most 1"),
], ids=["undecodable", "bad-data-url", "no-url", "too-many"])
def test_bad_video_is_a_400_naming_the_field(setup, parts, message):
    """Instructions (the chat's system message) and a text message come before the part: the error counts input
    items as the client sent them."""
    srv, clip, _ = setup
    body = {"model": "qwen", "instructions": "Be brief.", "max_output_tokens": 2, "store": False,
            "input": [{"role": "user", "content": "Watch."}, _user(*parts)]}
    status, err = post(srv.base_url, body, "/v1/responses")
    assert status == 400 and err["error"]["param"] == "input", err
    assert message in err["error"]["message"], err
    _respond(srv.base_url, {"input": [_user(_video(clip))], "store": False, "max_output_tokens": 2})  # serves on


def test_text_only_model_refuses_a_video_by_name(setup, base_url):
    _, clip, _ = setup
    status, err = post(base_url, {"model": "smol", "max_output_tokens": 2, "input": [_user(_video(clip))]},
                       "/v1/responses")
    assert status == 400 and err["error"]["param"] == "input", err
    assert err["error"]["message"].startswith("input[0].content[0]: smol takes no "), err
