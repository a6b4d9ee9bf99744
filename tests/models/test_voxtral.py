"""Voxtral (VoxtralForConditionalGeneration) against transformers, float32 on CPU: a tiny random checkpoint in the
hub's Hugging Face layout (tests/helpers/tiny_voxtral.py: a two-layer Whisper encoder over 128 mel bins with the
released 30 s window and four-row projector groups, a two-layer Llama, a v7 tekken.json with Voxtral's audio
settings), served with tokenizer_mode mistral (auto picks it: no tokenizer.json).

- features: ferrox's log-mel windows against transformers' WhisperFeatureExtractor as VoxtralProcessor calls it
  (padded to whole 30 s windows; its numpy path to a float32 ulp, its default torch path within 1e-4), the counts
  against mistral_common's AudioEncoder, the encoder and projector rows against transformers' get_audio_features;
- greedy tokens and logprobs (within 1e-3) through the real engine, 128-token prefill steps cutting each clip's
  375 or 750 [AUDIO] tokens, against transformers' generate, for a 1 s clip and a 31 s one (two windows); the chat
  (LLM.chat with an input_audio part) gives mistral_common's ids (its audio token rule) and the offline prompt's
  tokens;
- /v1/audio/transcriptions on a live `ferrox serve` equals the offline LLM on the family's prompt (mistral_common's
  transcription request: [INST][BEGIN_AUDIO][AUDIO][/INST]lang:en[TRANSCRIBE]); translations and languages outside
  Voxtral's nine refused by name;
- refusals by name: images, a placeholder count that differs from the clips', a run of the wrong length;
- a config.json whose text_config leaves fields out reads VoxtralConfig's text defaults (rope_theta 1e8).
On a GPU: the clips through the CUDA engine in float32 and bfloat16 against transformers there."""

from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers.audio_clips import wav_bytes
from tests.helpers.tiny_voxtral import AUDIO_TOKEN_ID, BEGIN_AUDIO_ID, TRANSCRIBE_ID, make_tiny_voxtral
from tests.models.conftest import cut_at_eos

transformers = pytest.importorskip("transformers")

RATE = 16_000
EOS = [2]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


def _clip(samples: int, hz: float, seed: int) -> np.ndarray:
    """A sine with noise on the int16 grid (a wav of it decodes to the same samples)."""
    t = np.arange(samples) / RATE
    x = 0.5 * np.sin(2 * np.pi * hz * t) + 0.2 * np.random.default_rng(seed).standard_normal(samples)
    return (np.clip(np.round(x * 32767), -32768, 32767) / 32768).astype(np.float32)


SHORT, LONG = _clip(RATE, 300, 1), _clip(31 * RATE, 900, 2)  # one window (375 tokens), two (750)



def _chat(clip: np.ndarray, text: str = "What is it?") -> list[dict]:
    b64 = base64.b64encode(wav_bytes(clip)).decode()
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def voxtral(tmp_path_factory):
    from tests.server.server_proc import ServerProcess

    folder = make_tiny_voxtral(tmp_path_factory.mktemp("voxtral"), seed=3)
    started: list[ServerProcess] = []
    # The server starts while the offline engine and transformers load (their start-up costs overlap).
    starter = threading.Thread(target=lambda: started.append(ServerProcess(
        folder, "--served-model-name", "vx", "--dtype", "float32", "--max-model-len", "2048")))
    starter.start()
    # 128 tokens a step: each clip's 375 / 750 [AUDIO] tokens are cut over prefill chunks.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=2048, kv_cache_memory=32 << 20,
              max_num_batched_tokens=128, limit_mm_per_prompt={"audio": 2})
    hf = transformers.VoxtralForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    starter.join()
    try:
        assert started, "ferrox serve did not start (its log is in the thread's exception above)"
        yield folder, hf, extractor, llm, started[0]
    finally:
        llm.engine.shutdown()
        if started:
            assert started[0].stop() == 0, "\n".join(started[0].log[-30:])


def _hf_features(extractor, clip: np.ndarray) -> torch.Tensor:
    """VoxtralProcessor's input_features of one clip: [windows, 128, 3000]."""
    feats = extractor(clip, sampling_rate=RATE, padding=True, truncation=False, pad_to_multiple_of=30 * RATE,
                      return_tensors="pt")["input_features"]
    return feats.reshape(extractor.feature_size, -1, 3000).transpose(0, 1)


def _hf_generate(hf, extractor, ids: list[int], clips: list[np.ndarray]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs for a prompt (ids as ferrox expanded them) and its clips."""
    features = torch.cat([_hf_features(extractor, c) for c in clips])
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          input_features=features, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def _mistral_common_ids(llm, messages: list[dict], clips: list[np.ndarray]) -> list[int]:
    """mistral_common's encode_chat_completion of the chat, each audio chunk's tokens by its AudioEncoder's rule
    for the clip (padded to whole windows: [BEGIN_AUDIO] and the count of [AUDIO]); ferrox's decoding stands in
    for soundfile, which mistral_common would decode the wav with."""
    import copy

    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    from mistral_common.tokens.tokenizers.audio import AudioEncoding

    mistral = llm.get_tokenizer().mistral
    real = mistral.instruct_tokenizer.audio_encoder
    pending = list(clips)

    class Counted:
        audio_config, special_ids = real.audio_config, real.special_ids

        def __call__(self, chunk):
            return AudioEncoding(real._encode_audio_tokens(len(real.pad(pending.pop(0), RATE))), None)

    instruct = copy.copy(mistral.instruct_tokenizer)
    instruct.audio_encoder = Counted()
    counted = copy.copy(mistral)
    counted.instruct_tokenizer = instruct
    return list(counted.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens)


def test_features_and_encoder_match_transformers(voxtral):
    """Four clips (1 s, exactly 30 s, 31 s, 321 samples): the log-mel windows against the extractor's, the counts
    against mistral_common's, the encoder and projector rows against transformers' get_audio_features."""
    from ferrox.multimodal.voxtral_processing import VoxtralFeatureExtractor

    _, hf, extractor, llm, _ = voxtral
    model = llm.engine.runner.model
    ours = llm.engine.image_prompts.audio_processor
    assert isinstance(ours, VoxtralFeatureExtractor)
    real = llm.get_tokenizer().mistral.instruct_tokenizer.audio_encoder
    for clip in [SHORT, _clip(30 * RATE, 440, 4), LONG, _clip(321, 50, 5)]:
        features = ours.features(clip)
        ref = _hf_features(extractor, clip)
        windows = ref.shape[0]
        assert features.shape == (windows * 3000, 128)
        padded = np.zeros(windows * 30 * RATE, np.float32)
        padded[:len(clip)] = clip
        exact = extractor._np_extract_fbank_features(padded[None], "cpu")[0].T
        np.testing.assert_allclose(features, exact, atol=3e-7, rtol=0)
        np.testing.assert_allclose(features, ref.transpose(1, 2).reshape(-1, 128).numpy(), atol=1e-4, rtol=0)
        count = ours.tokens(len(clip))
        assert [BEGIN_AUDIO_ID] + [AUDIO_TOKEN_ID] * count == real._encode_audio_tokens(len(real.pad(clip, RATE)))
        assert count == 375 * windows
        with torch.no_grad():
            want = hf.get_audio_features(ref).pooler_output
            got = model.multi_modal_projector(model.audio_tower(torch.from_numpy(features)))
        assert got.shape == (count, 64)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_chat_greedy_and_logprobs_match_transformers(voxtral):
    """A chat with a 1 s clip and one with a 31 s clip (two windows), each cut over 128-token prefill steps: the ids
    are mistral_common's, the tokens transformers' generate with logprobs within 1e-3, and the offline prompt
    (its ids with one [BEGIN_AUDIO][AUDIO], or already expanded) answers the same."""
    _, hf, extractor, llm, _ = voxtral
    chats = [_chat(SHORT), _chat(LONG, "Transcribe it.")]
    outs = llm.chat(chats, GREEDY, use_tqdm=False)
    for messages, clip, out in zip(chats, [SHORT, LONG], outs, strict=True):
        assert out.prompt_token_ids == _mistral_common_ids(llm, messages, [clip])
        assert out.prompt_token_ids.count(AUDIO_TOKEN_ID) == ferrox_count(llm, clip)
        tokens, logprobs = _hf_generate(hf, extractor, out.prompt_token_ids, [clip])
        got = list(out.outputs[0].token_ids)
        assert cut_at_eos(got, EOS) == cut_at_eos(tokens, EOS)
        ours = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(got)]
        np.testing.assert_allclose(ours, logprobs[:len(ours)], atol=1e-3, rtol=0)
    short_ids = outs[0].prompt_token_ids
    start = short_ids.index(AUDIO_TOKEN_ID)
    placeholder = short_ids[:start + 1] + short_ids[start + 375:]
    again = llm.generate([{"prompt_token_ids": placeholder, "multi_modal_data": {"audio": (SHORT, RATE)}},
                          {"prompt_token_ids": short_ids, "multi_modal_data": {"audio": SHORT}}], GREEDY,
                         use_tqdm=False)
    for out in again:
        assert out.prompt_token_ids == short_ids
        assert list(out.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


def ferrox_count(llm, clip: np.ndarray) -> int:
    return llm.engine.image_prompts.audio_processor.tokens(len(clip))


def test_transcription_server_matches_offline(voxtral):
    """/v1/audio/transcriptions with language en: the offline LLM's answer to the family's prompt (mistral_common's
    transcription request) for the decoded clip; a translation and a language outside Voxtral's nine refused by
    name, the server serving on."""
    from ferrox.multimodal.audio import decode_audio
    from ferrox.multimodal.transcription_prompts import SpeechTask, speech_prompt

    from tests.server.server_proc import openai_client
    from tests.server.test_transcription import _post

    _, _, _, llm, srv = voxtral
    wav = wav_bytes(_clip(2 * RATE, 500, 6))
    clip = decode_audio(wav, RATE).samples
    prompt = speech_prompt(llm.engine.image_prompts, SpeechTask("transcribe", "en"), llm.get_tokenizer())
    lang = llm.get_tokenizer().encode("lang:en", add_special_tokens=False)
    assert prompt.token_ids == [1, 3, BEGIN_AUDIO_ID, AUDIO_TOKEN_ID, 4, *lang, TRANSCRIBE_ID]
    assert prompt.text == "<s>[INST][BEGIN_AUDIO][AUDIO][/INST]lang:en[TRANSCRIBE]"
    want = llm.generate({"prompt_token_ids": prompt.token_ids, "multi_modal_data": {"audio": (clip, RATE)}},
                        SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    assert want.prompt_token_ids.count(AUDIO_TOKEN_ID) == 375
    with openai_client(srv) as client:
        got = client.audio.transcriptions.create(model="vx", file=("clip.wav", wav), language="en", temperature=0,
                                                 extra_body={"max_completion_tokens": 6})
    assert got.text == want.outputs[0].text
    for path, fields, param, words in [
            ("/v1/audio/translations", [("file", wav), ("language", "en")], "model", "Voxtral transcribes only"),
            ("/v1/audio/transcriptions", [("file", wav), ("language", "ja")], "language",
             "unsupported language 'ja': Voxtral takes")]:
        status, raw = _post(srv.base_url, fields, path)
        error = json.loads(raw)["error"]
        assert status == 400 and error["param"] == param and words in error["message"], error
    status, raw = _post(srv.base_url, [("file", wav), ("max_completion_tokens", "2")])
    assert status == 200, raw


def test_refusals_by_name(voxtral):
    from PIL import Image

    _, _, _, llm, _ = voxtral
    ids = [1, 3, BEGIN_AUDIO_ID, AUDIO_TOKEN_ID, 4]
    with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]: 1 image\(s\): Voxtral takes no images"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": Image.new("RGB", (8, 8))}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"1 audio placeholder\(s\) \(\[BEGIN_AUDIO\]\[AUDIO\]\) for 2"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": [SHORT, SHORT]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"audio 0: a run of 3 \[AUDIO\] tokens; the clip gives 375"):
        llm.generate({"prompt_token_ids": [1, 3, BEGIN_AUDIO_ID] + [AUDIO_TOKEN_ID] * 3 + [4],
                      "multi_modal_data": {"audio": SHORT}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"audio 0: its \[AUDIO\] does not follow \[BEGIN_AUDIO\]"):
        llm.generate({"prompt_token_ids": [1, 3, AUDIO_TOKEN_ID, 4], "multi_modal_data": {"audio": SHORT}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"audio 0: empty audio"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"audio": np.zeros(0, np.float32)}}, GREEDY)


def test_text_config_defaults_are_voxtral_config_s():
    """A config.json whose text_config leaves fields out gets VoxtralConfig's text defaults (Voxtral-Mini's Llama,
    rope_theta 1e8), as transformers reads it, not LlamaConfig's."""
    from ferrox.loader.model_config import spec_from_hf_config

    config = {"architectures": ["VoxtralForConditionalGeneration"], "model_type": "voxtral", "audio_token_id": 24,
              "audio_config": {"model_type": "voxtral_encoder"}, "text_config": {"model_type": "llama"}}
    spec = spec_from_hf_config(config, "config.json")
    want = transformers.VoxtralConfig(**{k: v for k, v in config.items() if k != "architectures"}).text_config
    assert (spec.rope_theta, spec.hidden_size, spec.head_dim, spec.vocab_size, spec.num_layers) == (
        want.rope_parameters["rope_theta"], want.hidden_size, want.head_dim, want.vocab_size, want.num_hidden_layers)


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_audio_on_cuda_matches_transformers(voxtral, dtype):
    """The 31 s clip's chat through the CUDA engine, cut over prefill chunks, against transformers on the same
    device and dtype (bfloat16: the first four tokens, where the tiny model's margins hold)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, _, extractor, _, _ = voxtral
    hf = transformers.VoxtralForConditionalGeneration.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    llm = LLM(model=folder, dtype="float32" if dtype == torch.float32 else "bfloat16", device="cuda",
              max_model_len=2048, max_num_batched_tokens=128)
    try:
        out = llm.chat(_chat(LONG), GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids], device="cuda"),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                          input_features=_hf_features(extractor, LONG).to("cuda", dtype),
                          max_new_tokens=GREEDY.max_tokens, do_sample=False)
    want, got = cut_at_eos(ref[0, len(ids):].tolist(), EOS), cut_at_eos(list(out.outputs[0].token_ids), EOS)
    assert got == want if dtype == torch.float32 else got[:4] == want[:4]
