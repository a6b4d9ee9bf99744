"""Live `ferrox serve` of tiny vision-language checkpoints, one family after another, on the device (or the CPU):
LLaVA (a CLIP tower over a Llama, a SigLIP tower over a Qwen2; Pixtral-12B's layout, a Pixtral tower), LLaVA-NeXT
(anyres tiles) and LLaVA-OneVision (anyres_max), Gemma 3 (bidirectional image attention: those steps take the
torch attention), Idefics3 (SmolVLM's tiling), Qwen2-VL / Qwen2.5-VL (images at their own sizes, multimodal rotary
positions), Qwen3-VL (interleaved rotary, DeepStack rows added inside the language model; dense and MoE), Qwen3.5 /
Qwen3.6 (Qwen3-VL's tower without DeepStack over the hybrid Gated DeltaNet language model, interleaved rotary over a
partial rotary; dense and MoE), Mistral 3 (Pixtral's row-break tokens inside each image), InternVL (tiles, pixel
shuffle; the -hf and the remote-code layouts), Gemma 4 (images at their own aspect ratio; bidirectional on the sliding
layers, those images computed whole in a step, or causal with E2B's per-layer embeddings, cut across steps).

Each serves 24 concurrent chat requests with data-URL images (eight different images, one or two a prompt),
Anthropic image blocks and Responses input_image parts beside them, each answer compared with the offline LLM's on
the same images on the same device; a bad image must be a 400 and change nothing else. 0 errors and 0 mismatches
expected. Arguments: family-name prefixes (all families when none). FERROX_LIVE_DTYPE=bfloat16 serves in bf16
(mismatches then printed, not failed); FERROX_LIVE_EXTRA adds serve flags (e.g. "--mm-processor-cache-type shm")."""
from __future__ import annotations

import base64
import concurrent.futures as cf
import io
import json
import os
import shlex
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.helpers.mtp_layer import add_mtp_layer  # noqa: E402
from tests.helpers.tiny_gemma4 import make_tiny_gemma4  # noqa: E402
from tests.helpers.tiny_internvl import make_tiny_internvl, make_tiny_internvl_chat  # noqa: E402
from tests.helpers.tiny_llava_onevision import make_tiny_llava_onevision  # noqa: E402
from tests.helpers.tiny_models import (  # noqa: E402
    make_tiny_gemma3_vision,
    make_tiny_idefics3,
    make_tiny_llava,
    make_tiny_llava_next,
    make_tiny_llava_pixtral,
    make_tiny_mistral3,
    make_tiny_qwen2_vl,
)
from tests.helpers.tiny_qwen3_5 import (  # noqa: E402
    make_tiny_qwen3_5_moe_multimodal,
    make_tiny_qwen3_5_multimodal,
)
from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl, make_tiny_qwen3_vl_moe  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def images() -> list[tuple[object, str]]:
    from PIL import Image

    rng = np.random.default_rng(7)
    out = []
    for k in range(8):
        img = Image.fromarray(rng.integers(0, 255, (40 + 9 * k, 70 - 4 * k, 3), dtype=np.uint8))
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append((img, base64.b64encode(buf.getvalue()).decode()))
    return out


def _with_mtp(folder: str) -> str:
    add_mtp_layer(folder, embed_gain=0.5)
    return folder


def main() -> int:
    from ferrox import LLM, SamplingParams

    only = sys.argv[1:]  # family-name filters, so two halves can share one device in parallel
    # FERROX_LIVE_DTYPE=bfloat16: the dtype people serve in. Batched bf16 sums may round differently from the
    # offline run's, so there mismatches are counted and printed but only errors fail.
    dtype = os.environ.get("FERROX_LIVE_DTYPE", "float32")
    exact_only = dtype == "float32"
    bad = 0
    tmp = Path(tempfile.mkdtemp())
    pics = images()
    for name, folder, extra in (("llava-clip-llama", make_tiny_llava(tmp / "a"), []),
                                ("llava-siglip-qwen2", make_tiny_llava(tmp / "b", text="qwen2", vision="siglip"), []),
                                ("gemma3-vision", make_tiny_gemma3_vision(tmp / "c"), ["--max-model-len", "512"]),
                                ("idefics3-tiles", make_tiny_idefics3(tmp / "d"), []),
                                ("qwen2-vl", make_tiny_qwen2_vl(tmp / "e"), []),
                                ("qwen2.5-vl", make_tiny_qwen2_vl(tmp / "f", version="qwen2_5_vl"), []),
                                ("mistral3-pixtral", make_tiny_mistral3(tmp / "g"), []),
                                ("llava-next-anyres", make_tiny_llava_next(tmp / "h"), []),
                                ("llava-pixtral", make_tiny_llava_pixtral(tmp / "i"), []),
                                ("qwen3-vl-deepstack", make_tiny_qwen3_vl(tmp / "j"), []),
                                ("internvl-tiles", make_tiny_internvl(tmp / "k"), []),
                                ("internvl-chat-remote", make_tiny_internvl_chat(tmp / "l")[1], []),
                                ("qwen3-vl-moe", make_tiny_qwen3_vl_moe(tmp / "m"), []),
                                ("llava-onevision", make_tiny_llava_onevision(tmp / "n"), []),
                                ("qwen3_5-vl", make_tiny_qwen3_5_multimodal(tmp / "o"), ["--max-model-len", "256"]),
                                ("qwen3_5-moe-vl", make_tiny_qwen3_5_moe_multimodal(tmp / "p"),
                                 ["--max-model-len", "256"]),
                                # (drafting with the checkpoint's MTP layer: the answers stay those without drafts)
                                ("mtp-qwen3_5-vl", _with_mtp(make_tiny_qwen3_5_multimodal(tmp / "q")),
                                 ["--max-model-len", "256", "--speculative-config",
                                  '{"method":"mtp","num_speculative_tokens":2}']),
                                # (an image's 44-70 tokens attend both ways: a step budget that holds one whole)
                                ("gemma4-vision-bidirectional", make_tiny_gemma4(
                                    tmp / "r", images=True, bidirectional="vision", standardize=True, clipped=True),
                                 ["--max-model-len", "512", "--max-num-batched-tokens", "160"]),
                                ("gemma4-vision-per-layer", make_tiny_gemma4(
                                    tmp / "s", images=True, per_layer=True, kv_shared=2), ["--max-model-len", "512"])):
        if only and not any(name.startswith(o) for o in only):
            continue
        cases = [[k % 8] for k in range(16)] + [[k % 8, (k + 3) % 8] for k in range(8)]

        def messages(ids: list[int]) -> list[dict]:
            parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + pics[i][1]}} for i in ids]
            return [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}]

        reference = LLM(model=folder, dtype=dtype, kv_cache_memory=128 << 20)
        expected = [o.outputs[0].text for o in reference.chat([messages(c) for c in cases],
                                                               SamplingParams(max_tokens=12, temperature=0),
                                                               use_tqdm=False)]
        del reference
        srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", dtype, "--max-num-batched-tokens",
                            "24", *extra, *shlex.split(os.environ.get("FERROX_LIVE_EXTRA", "")),
                            startup_timeout=300)  # a small budget: images cut across chunked-prefill steps
        errors = mismatches = 0
        with cf.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(post, srv.base_url, "/v1/chat/completions",
                                   {"model": "m", "messages": messages(c), "max_tokens": 12, "temperature": 0})
                       for c in cases]
            futures.append(pool.submit(post, srv.base_url, "/v1/messages", {
                "model": "m", "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": pics[0][1]}},
                    {"type": "text", "text": "What is this?"}]}]}))
            futures.append(pool.submit(post, srv.base_url, "/v1/responses", {
                "model": "m", "max_output_tokens": 12, "temperature": 0, "input": [{"role": "user", "content": [
                    {"type": "input_image", "image_url": "data:image/png;base64," + pics[0][1]},
                    {"type": "input_text", "text": "What is this?"}]}]}))
            futures.append(pool.submit(post, srv.base_url, "/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
                    "url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 4}))
            results = [f.result() for f in futures]
        for k, (status, body) in enumerate(results[:len(cases)]):
            if status != 200:
                errors += 1
                print(name, "error", status, body)
            elif body["choices"][0]["message"]["content"] != expected[k]:
                mismatches += 1
                print(name, "mismatch", cases[k], body["choices"][0]["message"]["content"], "!=", expected[k])
        anthropic, responses, broken = results[len(cases):]
        extra_ok = (anthropic[0] == 200 and responses[0] == 200 and broken[0] == 400 and (not exact_only or (
            anthropic[1]["content"][0]["text"] == expected[0]
            and responses[1]["output"][-1]["content"][0]["text"] == expected[0])))
        code = srv.stop()
        log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
        print(f"{name}: {len(cases)} chat requests, {errors} errors, {mismatches} mismatches, anthropic/responses/"
              f"bad-image as expected {extra_ok}, exit {code}, error log lines {len(log_errors)} {log_errors[:3]}")
        bad += errors + (mismatches if exact_only else 0) + (not extra_ok) + (code != 0) + len(log_errors)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
