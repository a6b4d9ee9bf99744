"""Video inputs end to end on a tiny Qwen2.5-VL: a real encoded file (written here with PyAV) decoded and
sampled as vLLM's loader does, through LLM.chat's `video_url` (data URL) and a live server's
/v1/chat/completions and /tokenize, the same tokens as the offline prompt with the decoded frames; errors
named: a broken video, too many videos, a video for a family that takes none (LLaVA; Qwen3-VL, whose videos
ferrox does not take yet), other modalities, beam search."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_qwen2_vl_video import VIDEO_PLACEHOLDER, make_tiny_qwen2_vl_video, write_video
from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as _post

av = pytest.importorskip("av")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _colours(count: int, height: int = 48, width: int = 64) -> np.ndarray:
    """Frames of flat colours that change every frame, with a gradient (a codec keeps them nearly exact)."""
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    ramp = np.linspace(0, 120, width, dtype=np.uint8)
    for i in range(count):
        frames[i] = ((i * 37) % 256, (i * 91 + 40) % 256, 200 - i * 3)
        frames[i, :, :, 0] = frames[i, :, :, 0] // 2 + ramp // 2
    return frames


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("video")
    folder = make_tiny_qwen2_vl_video(root / "qwen2_5_vl", version="qwen2_5_vl")
    data = open(write_video(str(root / "clip.webm"), _colours(6), fps=4), "rb").read()
    llm = LLM(model=folder, dtype="float32", device="cpu", limit_mm_per_prompt={"video": 1, "image": 1})
    return folder, llm, data


def _chat(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                         {"type": "text", "text": "What happens?"}]}]


def _data_url(data: bytes) -> str:
    return "data:video/webm;base64," + base64.b64encode(data).decode()


def test_decode_samples_as_vllm(tmp_path):
    from ferrox.multimodal.video import NUM_FRAMES, decode_video

    written = _colours(40)
    video = decode_video(open(write_video(str(tmp_path / "long.webm"), written, fps=10), "rb").read())
    want = np.linspace(0, 39, NUM_FRAMES, dtype=int).tolist()  # vLLM's uniform pick of 32 frames
    assert video.indices == want and video.total_frames == 40 and video.fps == 10
    assert video.frames.shape == (NUM_FRAMES, 48, 64, 3)
    assert np.abs(video.frames.astype(int) - written[want].astype(int)).mean() < 4  # the frames picked, decoded
    short = decode_video(open(write_video(str(tmp_path / "short.webm"), written[:5], fps=5), "rb").read())
    assert short.indices == [0, 1, 2, 3, 4]  # fewer frames than 32: all of them
    assert short.sampled_fps == 5


def test_media_io_kwargs_sample_as_vllms_loader(tmp_path):
    """--media-io-kwargs / a request's media_io_kwargs (media_io_config.py), as vLLM's default loader reads them:
    num_frames evenly spread (-1: every frame), fps caps the count at floor(duration * fps); bad keys named."""
    from ferrox.errors import InvalidArgumentError
    from ferrox.media_io_config import MediaIOOptions, parse_media_io_kwargs
    from ferrox.multimodal.video import decode_video

    data = open(write_video(str(tmp_path / "long.webm"), _colours(40), fps=10), "rb").read()  # 4 seconds
    for options, want in ((MediaIOOptions(num_frames=4), np.linspace(0, 39, 4, dtype=int).tolist()),
                          (MediaIOOptions(num_frames=-1), list(range(40))),
                          (MediaIOOptions(num_frames=-1, fps=2.0), np.linspace(0, 39, 8, dtype=int).tolist()),
                          (MediaIOOptions(num_frames=5, fps=2.0), np.linspace(0, 39, 5, dtype=int).tolist()),
                          (MediaIOOptions(fps=0.1), [0])):  # floor(0.4) frames: at least one
        video = decode_video(data, options)
        assert video.indices == want, options
        assert video.do_sample_frames == (len(want) == 40)  # kept whole: the processor samples it
    server = parse_media_io_kwargs({"video": {"num_frames": 8}, "image": {"image_mode": "RGB"}})
    assert parse_media_io_kwargs({"video": {"fps": 1}}, server) == MediaIOOptions(num_frames=8, fps=1.0)
    for raw, field in (({"audio": {}}, "media_io_kwargs.audio"), ({"video": {"frame_recovery": True}},
                                                                  "media_io_kwargs.video.frame_recovery"),
                       ({"video": {"num_frames": 2.5}}, "media_io_kwargs.video.num_frames"),
                       ({"image": {"image_mode": "L"}}, "media_io_kwargs.image.image_mode"), ([], "media_io_kwargs")):
        with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.")):
            parse_media_io_kwargs(raw)


def test_chat_video_url_matches_offline_frames(setup):
    from ferrox.multimodal.video import decode_video

    _, llm, data = setup
    out = llm.chat(_chat(_data_url(data)), GREEDY, use_tqdm=False)[0]
    assert VIDEO_PLACEHOLDER in out.prompt
    video = decode_video(data)
    metadata = {"fps": video.fps, "total_num_frames": video.total_frames, "frames_indices": video.indices}
    offline = llm.generate({"prompt": out.prompt, "multi_modal_data": {"video": (video.frames, metadata)}}, GREEDY,
                           use_tqdm=False)[0]
    assert out.prompt_token_ids == offline.prompt_token_ids
    assert list(out.outputs[0].token_ids) == list(offline.outputs[0].token_ids)
    assert_no_leaked_blocks(llm)


def test_errors_are_named(setup, tmp_path):
    from tests.helpers.tiny_models import make_tiny_llava

    _, llm, data = setup
    with pytest.raises(InvalidArgumentError, match="not a decodable video"):
        llm.chat(_chat("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode()), GREEDY)
    frames = _colours(2)
    with pytest.raises(InvalidArgumentError, match="2 videos, at most 1"):
        llm.generate({"prompt": VIDEO_PLACEHOLDER * 2, "multi_modal_data": {"video": [frames, frames]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="multi_modal_data.audio: only images and videos"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": b""}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="beam search takes no images or videos"):
        from ferrox.sampling_params import BeamSearchParams

        llm.beam_search([{"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": frames}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    llava = LLM(model=make_tiny_llava(tmp_path / "llava"), dtype="float32", device="cpu")
    with pytest.raises(InvalidArgumentError, match="takes no video inputs"):
        llava.generate({"prompt": "<image>", "multi_modal_data": {"video": frames}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].content\[0\]: .*takes no video inputs"):
        llava.chat(_chat(_data_url(data)), GREEDY)
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl

    qwen3 = LLM(model=make_tiny_qwen3_vl(tmp_path / "qwen3"), dtype="float32", device="cpu")
    with pytest.raises(InvalidArgumentError, match="Qwen3VLForConditionalGeneration takes no video inputs"):
        qwen3.generate({"prompt": "<|vision_start|><|video_pad|><|vision_end|>", "multi_modal_data": {"video": frames}},
                       GREEDY)
    assert_no_leaked_blocks(llm)


def test_server_video_url_matches_offline(setup):
    folder, llm, data = setup
    expected = llm.chat(_chat(_data_url(data)), GREEDY, use_tqdm=False)[0]
    srv = ServerProcess(folder, "--served-model-name", "qwen", "--dtype", "float32", "--limit-mm-per-prompt",
                        '{"video": 1}')
    try:
        body = {"model": "qwen", "messages": _chat(_data_url(data)), "max_tokens": GREEDY.max_tokens,
                "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True}
        status, out = _post(srv.base_url, body)
        assert status == 200, out
        ids = [int(t["token"].split(":")[1]) for t in out["choices"][0]["logprobs"]["content"]]
        assert ids == list(expected.outputs[0].token_ids)
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        status, tokens = _post(srv.base_url, {"model": "qwen", "messages": _chat(_data_url(data))}, "/tokenize")
        assert status == 200 and tokens["count"] == len(expected.prompt_token_ids), tokens
        status, err = _post(srv.base_url, {"model": "qwen", "messages": _chat("data:video/mp4;base64,AAAA"),
                                           "max_tokens": 2})
        assert status == 400 and "messages[0].content[0].video_url.url" in err["error"]["message"], err
        two = [{"role": "user", "content": _chat(_data_url(data))[0]["content"] * 2}]
        status, err = _post(srv.base_url, {"model": "qwen", "messages": two, "max_tokens": 2})
        assert status == 400 and "at most 1" in err["error"]["message"], err
    finally:
        srv.stop()


def test_server_media_io_kwargs(setup):
    """--media-io-kwargs keeps 2 of the clip's 6 frames (one temporal patch: fewer prompt tokens); a request's
    media_io_kwargs with num_frames -1 goes over it and gets the offline default's whole clip; a bad key is a
    400 naming it, with or without a video. (A request's own media_io_kwargs need --trust-request-mm-kwargs, as
    in vLLM.)"""
    folder, llm, data = setup
    expected = llm.chat(_chat(_data_url(data)), GREEDY, use_tqdm=False)[0]
    srv = ServerProcess(folder, "--served-model-name", "qwen", "--dtype", "float32", "--limit-mm-per-prompt",
                        '{"video": 1}', "--media-io-kwargs", '{"video": {"num_frames": 2}}', "--trust-request-mm-kwargs")
    try:
        body = {"model": "qwen", "messages": _chat(_data_url(data)), "max_tokens": GREEDY.max_tokens, "temperature": 0}
        status, fewer = _post(srv.base_url, body)
        assert status == 200 and fewer["usage"]["prompt_tokens"] < len(expected.prompt_token_ids), fewer
        status, whole = _post(srv.base_url, {**body, "media_io_kwargs": {"video": {"num_frames": -1}}})
        assert status == 200 and whole["usage"]["prompt_tokens"] == len(expected.prompt_token_ids), whole
        assert whole["choices"][0]["message"]["content"] == expected.outputs[0].text
        for messages in (body["messages"], [{"role": "user", "content": "hi"}]):
            status, err = _post(srv.base_url, {**body, "messages": messages,
                                               "media_io_kwargs": {"video": {"frame_recovery": True}}})
            assert status == 400 and "media_io_kwargs.video.frame_recovery" in err["error"]["message"], err
    finally:
        srv.stop()


def test_sources_timeout_and_size_cap(tmp_path, monkeypatch):
    """http(s) under VLLM_VIDEO_FETCH_TIMEOUT, local files only under --allowed-local-media-path, a size cap."""
    import http.server
    import threading
    import time

    from ferrox.multimodal.media import MediaError
    from ferrox.multimodal.video import to_video, video_fetch_timeout

    data = open(write_video(str(tmp_path / "clip.webm"), _colours(3), fps=3), "rb").read()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            if self.path == "/slow":
                time.sleep(1.5)
            try:
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the slow one's client has given up
                pass

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert video_fetch_timeout() == 30.0  # vLLM's default
        monkeypatch.setenv("VLLM_VIDEO_FETCH_TIMEOUT", "0.3")
        assert to_video(base + "/clip.webm").frames.shape[0] == 3
        with pytest.raises(MediaError, match=r"timed out after 0.3 s \(VLLM_VIDEO_FETCH_TIMEOUT\)"):
            to_video(base + "/slow")
        with pytest.raises(MediaError, match="larger than 100 bytes"):
            to_video(base + "/clip.webm", max_bytes=100)
    finally:
        server.shutdown()
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        to_video(str(tmp_path / "clip.webm"))
    assert to_video(str(tmp_path / "clip.webm"), allowed_local_media_path=str(tmp_path)).total_frames == 3
    with pytest.raises(MediaError, match="larger than 100 bytes"):
        to_video(data, max_bytes=100)
