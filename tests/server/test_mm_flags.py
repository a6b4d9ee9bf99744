"""vLLM's multimodal serve flags on a live server (a tiny Qwen2-VL): --trust-request-mm-kwargs left off, so a
request's non-empty mm_processor_kwargs / media_io_kwargs are a 400 naming the field and the flag (chat
completions and /tokenize; an empty one is no request for them); --language-model-only on, so text is served
and an image part is refused as under a limit of 0. (With the flag, a request's kwargs work as before:
tests/multimodal/test_request_processor_kwargs.py, test_video_inputs.py.)"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as post

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_qwen2_vl

    folder = make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen"))
    srv = ServerProcess(folder, "--served-model-name", "qwen", "--dtype", "float32", "--language-model-only")
    yield srv
    srv.stop()


def _image_url() -> str:
    buf = io.BytesIO()
    PIL.fromarray(np.random.default_rng(2).integers(0, 255, (40, 56, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


TEXT = [{"role": "user", "content": "What is this?"}]
BODY = {"model": "qwen", "messages": TEXT, "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize(("field", "value", "path"), [
    ("mm_processor_kwargs", {"max_pixels": 56 * 56}, "/v1/chat/completions"),
    ("media_io_kwargs", {"video": {"num_frames": 4}}, "/v1/chat/completions"),
    ("mm_processor_kwargs", {"max_pixels": 56 * 56}, "/tokenize"),
])
def test_request_kwargs_need_the_flag(server, field, value, path):
    status, err = post(server.base_url, {**BODY, field: value}, path)
    assert status == 400 and err["error"]["param"] == field, err
    assert "--trust-request-mm-kwargs" in err["error"]["message"] and field in err["error"]["message"], err


def test_empty_kwargs_and_text_are_served(server):
    status, out = post(server.base_url, {**BODY, "mm_processor_kwargs": {}, "media_io_kwargs": None})
    assert status == 200 and out["usage"]["completion_tokens"] == 3, out
    status, out = post(server.base_url, {"model": "qwen", "messages": TEXT, "mm_processor_kwargs": {}}, "/tokenize")
    assert status == 200 and out["count"] > 0, out


def test_language_model_only_refuses_an_image(server):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _image_url()}},
                                             {"type": "text", "text": "What is this?"}]}]
    status, err = post(server.base_url, {**BODY, "messages": messages})
    assert status == 400 and err["error"]["param"] == "messages", err
    assert "1 images, at most 0 may be given in one prompt" in err["error"]["message"], err
