"""Live `ferrox serve` of a tiny audio family's folder, FAMILY one or more of `gemma4` (tests/helpers/tiny_gemma4.py
audio=True), `qwen2-audio` (tests/helpers/tiny_qwen2_audio.py; no images there) and `voxtral`
(tests/helpers/tiny_voxtral.py, tokenizer_mode mistral; no images there), every family when none is named:
16 concurrent chat requests carrying audio (three different clips: a wav as an input_audio part, an mp3 as input_audio,
a flac as an audio_url data URL; some beside an image), each answer compared with the offline LLM's on the same
parts on the same device, clips cut across chunked-prefill steps (--max-num-batched-tokens 64: the image's 60
tokens attend both ways and are computed whole, a clip's 25 to 63 tokens are causal and cut at a step's end); bad
base64 and a payload that is not audio must be 400s naming the field and change nothing else. Then
/v1/audio/transcriptions of a 2.5 s wav and (Qwen2-Audio, Voxtral) a 35 s one, cut into two clips at its quiet moment
(Voxtral: kept whole, two 30 s windows, as vLLM does), each text equal to the offline LLM's answers to the family's
speech prompt (multimodal/transcription_prompts.py) on the same clips, joined. 0 errors and 0 mismatches expected. Needs PyAV (`av`) where it runs: the device image has none, so
carry its wheel.

    python benches/live/serve_audio.py [FAMILY ...] [--device cuda] [--dtype float32|bfloat16]
"""
from __future__ import annotations

import argparse
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
from tests.helpers.tiny_qwen2_audio import make_tiny_qwen2_audio  # noqa: E402
from tests.helpers.tiny_voxtral import make_tiny_voxtral  # noqa: E402
from tests.server.server_proc import ServerProcess  # noqa: E402

RATE = 16_000
# family -> (its tiny folder's builder, whether its chats also carry an image, its max_model_len: the tiny Gemma 4
# has 512 positions, too few for a 30 s clip's 750 audio tokens, so it does not transcribe the long recording;
# Voxtral's clips are 375 tokens a 30 s window)
FAMILIES = {
    "gemma4": (lambda folder: make_tiny_gemma4(folder, audio=True, bidirectional="vision", per_layer=True, kv_shared=2),
               True, 512),
    "qwen2-audio": (lambda folder: make_tiny_qwen2_audio(folder), False, 1024),
    "voxtral": (lambda folder: make_tiny_voxtral(folder), False, 2048),
}


def post(base: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def encode(samples: np.ndarray, container: str, codec: str) -> bytes:
    """A mono 16 kHz clip encoded with PyAV (its encoder converts the float frame to the codec's sample format)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=RATE, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None, :], dtype=np.float32), format="flt",
                                           layout="mono")
        frame.sample_rate = RATE
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def parts() -> list[dict]:
    """Three audio parts of different lengths and containers."""
    rng = np.random.default_rng(5)
    out = []
    for k, (seconds, hz, container, codec) in enumerate(((1.0, 300, "wav", "pcm_s16le"), (1.6, 700, "mp3", "libmp3lame"),
                                                         (2.5, 1100, "flac", "flac"))):
        t = np.arange(int(seconds * RATE)) / RATE
        clip = (0.4 * np.sin(2 * np.pi * hz * t) + 0.1 * rng.standard_normal(len(t))).astype(np.float32)
        b64 = base64.b64encode(encode(clip, container, codec)).decode()
        if k == 2:
            out.append({"type": "audio_url", "audio_url": {"url": f"data:audio/{container};base64,{b64}"}})
        else:
            out.append({"type": "input_audio", "input_audio": {"data": b64, "format": container}})
    return out


def recording(seconds: float, seed: int) -> bytes:
    """A mono 16 kHz wav of tones with noise, quieter every few hundred ms (pauses a long one is cut at)."""
    t = np.arange(int(seconds * RATE)) / RATE
    envelope = 0.2 + 0.8 * (np.sin(2 * np.pi * 1.7 * t) > -0.3)
    clip = envelope * (0.4 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.random.default_rng(seed).standard_normal(len(t)))
    return encode(clip.astype(np.float32), "wav", "pcm_s16le")


def expected_transcriptions(reference, wavs: list[bytes], max_tokens: int) -> list[str]:
    """The offline answers to the family's transcription prompt ("en") on each recording's clips, joined as the
    server joins them."""
    from ferrox import SamplingParams
    from ferrox.multimodal.audio import decode_audio
    from ferrox.multimodal.audio_chunks import split_audio
    from ferrox.multimodal.transcription_prompts import SpeechTask, speech_family, speech_prompt

    rules, tokenizer = reference.engine.image_prompts, reference.engine.tokenizer
    prompt, family = speech_prompt(rules, SpeechTask("transcribe", "en"), tokenizer), speech_family(rules)
    texts = []
    for wav in wavs:
        clips = split_audio(decode_audio(wav, RATE).samples, rules.audio_processor.max_samples, RATE)
        outs = reference.generate([{"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"audio": (c, RATE)}}
                                   for c in clips], SamplingParams(max_tokens=max_tokens, temperature=0),
                                  use_tqdm=False)
        texts.append(" ".join(family.post_process(o.outputs[0].text) for o in outs))
    return texts


def transcribe(base: str, wav: bytes, max_tokens: int) -> tuple[int, dict]:
    """POST /v1/audio/transcriptions as a multipart form (file, model, language, max_completion_tokens)."""
    boundary = "ferrox-bench"
    fields = {"model": "m", "language": "en", "max_completion_tokens": str(max_tokens)}
    body = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
                    for k, v in fields.items())
    body += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             "Content-Type: audio/wav\r\n\r\n").encode() + wav + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(base + "/v1/audio/transcriptions", body,
                                 {"Content-Type": f"multipart/form-data; boundary={boundary}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def image_url() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(9).integers(0, 255, (30, 100, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("families", nargs="*", metavar="FAMILY", help=f"of {', '.join(FAMILIES)} (default: all)")
    args.add_argument("--device", default=None)
    args.add_argument("--dtype", default="float32")
    opts = args.parse_args()
    unknown = [f for f in opts.families if f not in FAMILIES]
    if unknown:
        args.error(f"unknown FAMILY {', '.join(unknown)} (families: {', '.join(FAMILIES)})")
    return max(run(family, opts) for family in opts.families or FAMILIES)


def run(family: str, opts: argparse.Namespace) -> int:
    from ferrox import LLM, SamplingParams

    build, images, max_len = FAMILIES[family]
    tmp = Path(tempfile.mkdtemp())
    clips, picture = parts(), image_url()
    cases = [(k % 3, images and k % 4 == 3) for k in range(16)]  # (clip, with an image)

    def messages(clip: int, with_image: bool) -> list[dict]:
        media = [clips[clip]] + ([{"type": "image_url", "image_url": {"url": picture}}] if with_image else [])
        return [{"role": "user", "content": [*media, {"type": "text", "text": "What is it?"}]}]

    folder = build(tmp / family)
    limits = {"image": 1, "audio": 1} if images else {"audio": 1}
    device = ["--device", opts.device] if opts.device else []
    reference = LLM(model=folder, dtype=opts.dtype, kv_cache_memory=128 << 20, limit_mm_per_prompt=limits,
                    max_model_len=max_len, max_num_batched_tokens=64, **({"device": opts.device} if opts.device else {}))
    expected = [o.outputs[0].text for o in reference.chat([messages(*c) for c in cases],
                                                           SamplingParams(max_tokens=12, temperature=0),
                                                           use_tqdm=False)]
    wavs = [recording(2.5, 1)] + ([recording(35.0, 2)] if max_len >= 1024 else [])
    transcripts = expected_transcriptions(reference, wavs, 12)
    reference.engine.shutdown()
    del reference
    srv = ServerProcess(folder, "--served-model-name", "m", "--dtype", opts.dtype, "--max-num-batched-tokens", "64",
                        "--max-model-len", str(max_len), "--limit-mm-per-prompt", json.dumps(limits), *device,
                        startup_timeout=300)
    broken = [{"data": "%%% not base64", "format": "wav"}, {"data": base64.b64encode(b"no audio here" * 40).decode(),
                                                            "format": "mp3"}]
    with cf.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(post, srv.base_url, {"model": "m", "messages": messages(*c), "max_tokens": 12,
                                                    "temperature": 0}) for c in cases]
        futures += [pool.submit(post, srv.base_url, {"model": "m", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": body}]}]}) for body in broken]
        results = [f.result() for f in futures]
    good, bad_parts = results[:len(cases)], results[len(cases):]
    errors = sum(status != 200 for status, _ in good)
    mismatches = sum(status == 200 and body["choices"][0]["message"]["content"] != want
                     for (status, body), want in zip(good, expected, strict=True))
    named = sum(status == 400 and "messages[0].content[0].input_audio.data" in body["error"]["message"]
                for status, body in bad_parts)
    heard = [transcribe(srv.base_url, wav, 12) for wav in wavs]
    errors += sum(status != 200 for status, _ in heard)
    mismatches += sum(status == 200 and body["text"] != want for (status, body), want in zip(heard, transcripts,
                                                                                              strict=True))
    code = srv.stop()
    log_errors = [ln for ln in srv.log if " ERROR " in ln or "Traceback" in ln]
    print(f"{family} ({opts.device or 'default device'}, {opts.dtype}): {len(cases)} audio chats and "
          f"{len(wavs)} transcriptions, {errors} errors, "
          f"{mismatches} mismatches, bad parts named in a 400 {named}/{len(broken)}, exit {code}, error log lines "
          f"{len(log_errors)} {log_errors[:3]}")
    return 1 if errors or mismatches or named != len(broken) or code != 0 or log_errors else 0


if __name__ == "__main__":
    sys.exit(main())
