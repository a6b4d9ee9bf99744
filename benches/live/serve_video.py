"""Live `ferrox serve` of tiny Qwen2-VL, Qwen2.5-VL and Gemma 4 folders taking videos: 16 concurrent chat requests
with `video_url` data URLs (three different clips, webm and mp4, some beside an image), each answer compared with
the offline LLM's on the same clips on the same device, videos cut across chunked-prefill steps
(--max-num-batched-tokens 24; Gemma 4's frames attend both ways on its sliding layers, so each is computed whole:
a budget of 160, and 4 frames a clip through --media-io-kwargs within its 512 positions); a broken video must be a
400 and change nothing else. 0 errors and 0 mismatches expected. Arguments: family-name prefixes (all when none).
Needs PyAV (`av`) where it runs: the device image has none, so carry its wheel."""
from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.tiny_gemma4 import make_tiny_gemma4  # noqa: E402
from tests.helpers.tiny_qwen2_vl_video import make_tiny_qwen2_vl_video, write_video  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def clips(tmp: Path) -> list[str]:
    """Three data URLs: clips of different lengths, sizes and containers."""
    rng = np.random.default_rng(5)
    out = []
    for k, (count, h, w, codec, suffix) in enumerate(((6, 48, 64, "libvpx-vp9", "webm"),
                                                      (11, 40, 56, "libvpx-vp9", "webm"),
                                                      (4, 64, 48, "mpeg4", "mp4"))):
        frames = rng.integers(0, 255, (count, h, w, 3), dtype=np.uint8)
        data = Path(write_video(str(tmp / f"clip{k}.{suffix}"), frames, fps=4, codec=codec)).read_bytes()
        out.append(f"data:video/{suffix};base64," + base64.b64encode(data).decode())
    return out


def image_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> int:
    from ferrox import LLM, SamplingParams

    tmp = Path(tempfile.mkdtemp())
    urls, picture = clips(tmp), image_url()
    cases = [(k % 3, k % 4 == 3) for k in range(16)]  # (clip, with an image)

    def messages(clip: int, with_image: bool) -> list[dict]:
        parts = [{"type": "video_url", "video_url": {"url": urls[clip]}}]
        if with_image:
            parts.append({"type": "image_url", "image_url": {"url": picture}})
        return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]}]

    only = sys.argv[1:]  # family-name filters
    bad = 0
    four_frames = {"video": {"num_frames": 4}}
    for name, build, serve_args, media_io in (
            ("qwen2-vl", lambda d: make_tiny_qwen2_vl_video(d, version="qwen2_vl"), [], None),
            ("qwen2.5-vl", lambda d: make_tiny_qwen2_vl_video(d, version="qwen2_5_vl"), [], None),
            ("gemma4-video", lambda d: make_tiny_gemma4(d, images=True, bidirectional="vision", per_layer=True,
                                                        kv_shared=2, standardize=True, clipped=True),
             ["--max-num-batched-tokens", "160", "--max-model-len", "512", "--media-io-kwargs",
              json.dumps(four_frames)], four_frames)):
        if only and not any(name.startswith(o) for o in only):
            continue
        folder = build(tmp / name)
        limits = {"video": 1, "image": 1}
        reference = LLM(model=folder, dtype="float32", kv_cache_memory=128 << 20, limit_mm_per_prompt=limits,
                        media_io_kwargs=media_io)
        expected = [o.outputs[0].text for o in reference.chat([messages(*c) for c in cases],
                                                               SamplingParams(max_tokens=12, temperature=0),
                                                               use_tqdm=False)]
        del reference
        srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", "float32", "--max-num-batched-tokens",
                            "24", "--limit-mm-per-prompt", json.dumps(limits), *serve_args, startup_timeout=300)
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(post, srv.base_url, {"model": "m", "messages": messages(*c), "max_tokens": 12,
                                                        "temperature": 0}) for c in cases]
            futures.append(pool.submit(post, srv.base_url, {"model": "m", "max_tokens": 4, "messages": [
                {"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]}))
            results = [f.result() for f in futures]
        errors = sum(status != 200 for status, _ in results[:-1])
        mismatches = sum(status == 200 and body["choices"][0]["message"]["content"] != want
                         for (status, body), want in zip(results[:-1], expected, strict=True))
        broken_ok = results[-1][0] == 400
        code = srv.stop()
        log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
        print(f"{name}: {len(cases)} video chats, {errors} errors, {mismatches} mismatches, broken video a 400 "
              f"{broken_ok}, exit {code}, error log lines {len(log_errors)} {log_errors[:3]}")
        bad += errors + mismatches + (not broken_ok) + (code != 0) + len(log_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
