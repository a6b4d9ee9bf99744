"""/v1/audio/transcriptions and /v1/audio/translations on a live `ferrox serve` of a tiny random Qwen2-Audio
(tests/helpers/tiny_qwen2_audio.py), against the offline LLM on the same folder fed the prompt its family builds
(written out here as Qwen's ASR form) with the same decoded clip, greedy:

- the openai client's transcription (json: the text and vLLM's duration usage; text: the bare text) and a stream
  (`transcription.chunk` events, their deltas the same text, the usage after them), a translation;
- a 35 s recording cut at its quiet moment into two clips: the text is the offline answers of the two clips joined;
- refusals by name, the server serving on: no file, an unknown language, an unknown form field, a field given
  twice, a text prompt, srt, stream options without a stream, undecodable bytes, a file past
  VLLM_MAX_AUDIO_CLIP_FILESIZE_MB, a JSON body; a text-only model (the session's SmolLM2) answers 400 naming
  `model`.
Also the Gemma 4 prompt (vLLM's Gemma 3n form in the model's chat turns) with its clip expanded, on a tiny Gemma 4
audio folder's prompt rules, and /openapi.json listing both routes with multipart bodies."""

from __future__ import annotations

import json
import math
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from ferrox import LLM, SamplingParams
from ferrox.multimodal.audio import decode_audio
from ferrox.multimodal.audio_chunks import split_audio
from ferrox.multimodal.transcription_prompts import SpeechTask, speech_family, speech_prompt

from tests.helpers.audio_clips import wav_bytes
from tests.helpers.tiny_qwen2_audio import make_tiny_qwen2_audio
from tests.server.server_proc import ServerProcess, openai_client

pytest.importorskip("av")

RATE = 16_000
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
ASR = "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and recognize the speech:"



def _speech(seconds: float, seed: int) -> np.ndarray:
    """Tones with noise, quieter every few hundred ms (a recording with pauses to cut at)."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    envelope = 0.2 + 0.8 * (np.sin(2 * np.pi * 1.7 * t) > -0.3)
    return (envelope * (0.4 * np.sin(2 * np.pi * 440 * t) + 0.1 * rng.standard_normal(len(t)))).astype(np.float32)


def _form(fields: list[tuple[str, str | bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body: a bytes value goes as a file part."""
    boundary = "ferrox-test-boundary"
    out = b""
    for name, value in fields:
        if isinstance(value, bytes):
            out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="clip.wav"\r\n'
                    "Content-Type: audio/wav\r\n\r\n").encode() + value + b"\r\n"
        else:
            out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def _post(base_url: str, fields: list[tuple[str, str | bytes]], path: str = "/v1/audio/transcriptions",
          body: bytes | None = None, content_type: str | None = None) -> tuple[int, bytes]:
    if body is None:
        body, content_type = _form(fields)
    req = urllib.request.Request(base_url + path, data=body, headers={"Content-Type": content_type or ""})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def qwen_audio(tmp_path_factory):
    folder = make_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2a"))
    started: list[ServerProcess] = []
    # The server starts while the offline engine loads (two processes: the start-up costs overlap).
    starter = threading.Thread(target=lambda: started.append(ServerProcess(
        folder, "--served-model-name", "qa", "--dtype", "float32", env={"VLLM_MAX_AUDIO_CLIP_FILESIZE_MB": "2"})))
    starter.start()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=64 << 20)
    starter.join()
    try:
        assert started, "ferrox serve did not start (its log is in the thread's exception above)"
        yield started[0], llm
    finally:
        llm.engine.shutdown()
        if started:
            assert started[0].stop() == 0, "\n".join(started[0].log[-30:])


def _offline(llm, clips: list[np.ndarray], task: SpeechTask) -> tuple[str, list]:
    """The prompt the family builds, and the offline LLM's greedy answer to it for each clip."""
    prompt = speech_prompt(llm.engine.image_prompts, task, llm.engine.tokenizer)
    outs = llm.generate([{"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"audio": (clip, RATE)}}
                         for clip in clips], GREEDY, use_tqdm=False)
    return prompt.text, outs


def test_transcription_json_text_and_stream_match_offline(qwen_audio):
    srv, llm = qwen_audio
    wav = wav_bytes(_speech(2.3, seed=1))
    clip = decode_audio(wav, RATE).samples
    text, (want,) = _offline(llm, [clip], SpeechTask("transcribe", "en"))
    assert text == ASR + " <|en|>"  # Qwen's ASR form, the language as its tag
    with openai_client(srv) as client:
        got = client.audio.transcriptions.create(model="qa", file=("clip.wav", wav), language="en", temperature=0,
                                                 extra_body={"max_completion_tokens": MAX_TOKENS})
        assert got.text == want.outputs[0].text
        assert got.usage.type == "duration" and got.usage.seconds == 3  # ceil(2.3 s), as vLLM counts it
        plain = client.audio.transcriptions.create(model="qa", file=("clip.wav", wav), language="en",
                                                   response_format="text",
                                                   extra_body={"max_completion_tokens": MAX_TOKENS})
        assert plain == want.outputs[0].text
    status, raw = _post(srv.base_url, [("file", wav), ("model", "qa"), ("language", "en"), ("stream", "true"),
                                       ("stream_include_usage", "true"), ("stream_continuous_usage_stats", "true"),
                                       ("max_completion_tokens", str(MAX_TOKENS))])
    assert status == 200, raw
    lines = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    events = [json.loads(ln) for ln in lines[:-1]]
    assert {e["object"] for e in events} == {"transcription.chunk"}
    deltas = [e for e in events if e["choices"]]
    assert "".join(e["choices"][0]["delta"]["content"] for e in deltas) == want.outputs[0].text
    assert deltas[-1]["choices"][0]["finish_reason"] == want.outputs[0].finish_reason
    usage = {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": len(want.outputs[0].token_ids)}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == {
        **usage, "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]}
    assert deltas[-1]["usage"] == events[-1]["usage"]  # (continuous usage: every event says it so far)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (the openai client's translations.create says so)
def test_translation_matches_offline(qwen_audio):
    srv, llm = qwen_audio
    wav = wav_bytes(_speech(1.5, seed=2))
    text, (want,) = _offline(llm, [decode_audio(wav, RATE).samples], SpeechTask("translate", "en", "fr"))
    assert text == "<|audio_bos|><|AUDIO|><|audio_eos|>Detect the language and translate the speech into French: <|en|>"
    with openai_client(srv) as client:
        got = client.audio.translations.create(model="qa", file=("clip.wav", wav),
                                               extra_body={"language": "en", "to_language": "fr",
                                                           "max_completion_tokens": MAX_TOKENS})
    assert got.text == want.outputs[0].text
    assert not hasattr(got, "usage") or got.usage is None  # (vLLM's translations carry no usage)


def test_a_long_recording_is_cut_into_clips(qwen_audio):
    srv, llm = qwen_audio
    samples = _speech(35.0, seed=3)
    wav = wav_bytes(samples)
    decoded = decode_audio(wav, RATE).samples
    clips = split_audio(decoded, 30 * RATE, RATE)
    assert len(clips) == 2 and 29 * RATE <= len(clips[0]) < 30 * RATE
    _, outs = _offline(llm, clips, SpeechTask("transcribe"))
    status, raw = _post(srv.base_url, [("file", wav), ("max_completion_tokens", str(MAX_TOKENS))])
    assert status == 200, raw
    body = json.loads(raw)
    # (Qwen2-Audio without a language: a leading language tag, if the model wrote one, is dropped)
    family = speech_family(llm.engine.image_prompts)
    assert body["text"] == " ".join(family.post_process(o.outputs[0].text) for o in outs)
    assert body["usage"] == {"type": "duration", "seconds": math.ceil(len(decoded) / RATE)}
    assert family.post_process("<|en|>Hello there") == "Hello there" and family.post_process("Hi <|en|>") == "Hi <|en|>"
    # A stream: the clips' deltas in order, the second clip's first one after the same space.
    status, raw = _post(srv.base_url, [("file", wav), ("stream", "true"), ("max_completion_tokens", str(MAX_TOKENS))])
    events = [json.loads(ln[6:]) for ln in raw.decode().splitlines() if ln.startswith("data: {")]
    assert status == 200 and "".join(e["choices"][0]["delta"]["content"] for e in events) == " ".join(
        o.outputs[0].text for o in outs)
    assert [e["choices"][0].get("finish_reason") is not None for e in events].count(True) == 2  # (one per clip)


def test_refusals_name_the_field(qwen_audio, server):
    srv, _ = qwen_audio
    wav = wav_bytes(_speech(0.5, seed=4))
    cases = [
        ([("model", "qa")], "file", "missing"),
        ([("file", wav), ("language", "xx")], "language", "unsupported language 'xx'"),
        ([("file", wav), ("to_language", "fr")], "to_language", "translate"),
        ([("file", wav), ("speaker", "a")], "speaker", "not a field of /v1/audio/transcriptions"),
        ([("file", wav), ("seed", "1"), ("seed", "2")], "seed", "given 2 times"),
        ([("file", wav), ("prompt", "earlier words")], "prompt", "no place for a text prompt"),
        ([("file", wav), ("response_format", "srt")], "response_format", "'srt'"),
        ([("file", wav), ("timestamp_granularities[]", "word")], "timestamp_granularities", "verbose_json"),
        ([("file", wav), ("stream_include_usage", "true")], "stream_include_usage", "stream=True"),
        ([("file", wav), ("temperature", "warm")], "temperature", "number"),
        ([("file", b"RIFF not really a wave file")], "file", "not decodable audio"),
        ([("file", b"\0" * (2 << 20) + b"!")], "file", "Maximum file size exceeded"),
        ([("file", "text, not a file part")], "file", "file part"),
    ]
    for fields, param, words in cases:
        status, raw = _post(srv.base_url, fields)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and words in error["message"], (fields[-1][0], error)
    status, raw = _post(srv.base_url, [], body=json.dumps({"model": "qa"}).encode(), content_type="application/json")
    assert status == 400 and json.loads(raw)["error"]["param"] == "file", raw
    status, raw = _post(srv.base_url, [("file", wav), ("top_k", "5")], "/v1/audio/translations")
    assert status == 400 and json.loads(raw)["error"]["param"] == "top_k", raw  # (not a translation field)
    status, raw = _post(server.base_url, [("file", wav), ("model", "smol")])
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "model" and "does not support Transcriptions API" in error["message"]
    status, raw = _post(srv.base_url, [("file", wav), ("max_completion_tokens", "2")])  # still serving
    assert status == 200, raw


def test_gemma4_prompt_and_openapi(tmp_path, qwen_audio):
    """vLLM's Gemma 3n prompt in the tiny Gemma 4's chat turns (its test template: `<|im_start|>` turns), the clip's
    audio tokens expanded between begin- and end-of-audio; /openapi.json lists both routes' multipart forms."""
    from ferrox.loader.config_file import read_model_config
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer
    from ferrox.multimodal.audio import Audio
    from ferrox.multimodal.processing import image_prompts_for_model

    from tests.helpers.tiny_gemma4 import make_tiny_gemma4

    folder = make_tiny_gemma4(tmp_path / "g4", audio=True)
    tokenizer = load_tokenizer(resolve_model(folder, None))
    rules = image_prompts_for_model(folder, read_model_config(folder)[0], tokenizer)
    prompt = speech_prompt(rules, SpeechTask("translate", "de", "en"), tokenizer)
    assert prompt.text == ("<|im_start|>user\nTranslate this audio from German into English: <|audio|><|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert speech_prompt(rules, SpeechTask("transcribe"), tokenizer).text.startswith(
        "<|im_start|>user\nTranscribe this audio: <|audio|>")
    ids, items = rules.expand(prompt.token_ids, [Audio(_speech(1.0, seed=5), RATE)], "file", param="file")
    assert len(items) == 1 and ids.count(rules.audio_token_id) == items[0].length == 25
    srv, _ = qwen_audio
    with urllib.request.urlopen(srv.base_url + "/openapi.json", timeout=30) as resp:
        paths = json.loads(resp.read())["paths"]
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        assert "multipart/form-data" in paths[path]["post"]["requestBody"]["content"], paths[path]
