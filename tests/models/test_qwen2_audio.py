"""Qwen2-Audio (Qwen2AudioForConditionalGeneration) against transformers, float32 on CPU: a tiny random checkpoint
(tests/helpers/tiny_qwen2_audio.py: a two-layer Whisper-style encoder over 128 mel bins with the released 30 s
window, a two-layer Qwen2).

- features: ferrox's log-mel frames against transformers' WhisperFeatureExtractor (its numpy path to a float32 ulp;
  its default torch path, a float32 STFT, within 1e-4), the token counts against Qwen2AudioProcessor's;
- the encoder and projector: transformers' audio tower over the padded 30 s window with the processor's mask, clip
  by clip, against ferrox's over the kept frames;
- greedy tokens through the real engine (one clip, two clips, 16-token prefill steps so each clip is cut over
  chunks; a prompt already expanded) equal transformers' generate on Qwen2AudioProcessor's inputs, and the prompt
  ids are the processor's; two clips of one length keep their KV blocks apart;
- a chat with an input_audio part through LLM.chat and a live `ferrox serve` (200, the offline tokens; a bad part a
  400 naming the field);
- refusals by name: images, videos, a clip past 30 s, one too short, more clips than --limit-mm-per-prompt;
  --language-model-only builds no encoder and refuses clips.
On a GPU: the tiny model's clips through the CUDA engine in float32 and bfloat16 against transformers there."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers import tiny_models
from tests.helpers.audio_clips import wav_bytes
from tests.helpers.tiny_qwen2_audio import make_tiny_qwen2_audio
from tests.models.conftest import cut_at_eos

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
RATE = 16_000
EOS = [tiny_models.EOS_TOKEN_ID]
ONE = "<|audio_bos|><|AUDIO|><|audio_eos|>What is it?"
TWO = "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>\nAudio 2: <|audio_bos|><|AUDIO|><|audio_eos|>\nCompare."


def _clip(samples: int, hz: float, seed: int = 0) -> np.ndarray:
    """A sine with noise on the int16 grid (a wav of it decodes to the same samples)."""
    t = np.arange(samples) / RATE
    x = 0.5 * np.sin(2 * np.pi * hz * t) + 0.2 * np.random.default_rng(seed).standard_normal(samples)
    return (np.clip(np.round(x * 32767), -32768, 32767) / 32768).astype(np.float32)


CLIPS = [_clip(16_000, 300, 1), _clip(24_321, 900, 2), _clip(16_000, 1200, 3)]  # 25, 38 and 25 audio tokens



@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = make_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2audio"), seed=5)
    hf = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder))
    # 16 tokens a step: every clip (25, 38 tokens) is cut over prefill chunks.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=16, limit_mm_per_prompt={"audio": 2})
    yield folder, hf, processor, llm
    llm.engine.shutdown()


def _inputs(processor, text, clips):
    return processor(text=[text], audio=list(clips), sampling_rate=RATE, return_tensors="pt")


def _hf(hf, processor, ids, clips):
    """transformers' greedy tokens for a prompt (ids as ferrox expanded them) and its clips, the features and mask
    as Qwen2AudioProcessor makes them."""
    features = processor.feature_extractor(list(clips), sampling_rate=RATE, return_attention_mask=True,
                                           padding="max_length", return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          input_features=features["input_features"],
                          feature_attention_mask=features["attention_mask"], max_new_tokens=GREEDY.max_tokens,
                          do_sample=False)
    return out[0, len(ids):].tolist()


def _tokens(out) -> list[int]:
    return cut_at_eos(list(out.outputs[0].token_ids), EOS)


def test_features_and_encoder_match_transformers(qwen):
    """Five clips (1 s, 1.5 s, the shortest that gives a token, exactly 30 s, a sample under it): the kept frames
    against the extractor's, the counts against the processor's, the encoder and projector rows against
    transformers' tower run over the padded window with the processor's mask."""
    from ferrox.multimodal.qwen2_audio_processing import WhisperFeatureExtractor
    from transformers.masking_utils import create_bidirectional_mask

    folder, hf, processor, llm = qwen
    model = llm.engine.runner.model
    ours = WhisperFeatureExtractor.from_model_dir(folder)
    clips = [*CLIPS[:2], _clip(321, 50), _clip(30 * RATE, 440, 4), _clip(30 * RATE - 1, 220, 5)]
    ref = processor.feature_extractor(clips, sampling_rate=RATE, return_attention_mask=True, padding="max_length",
                                      return_tensors="pt")
    counts = _inputs(processor, "<|AUDIO|>" * len(clips), clips)["input_ids"][0].tolist().count(
        hf.config.audio_token_id)
    tower = hf.model.audio_tower
    with torch.no_grad():
        positions, tokens = tower._get_feat_extract_output_lengths(ref["attention_mask"].sum(-1))
        valid = (torch.arange(1500)[None, :] < positions[:, None]).long()
        mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(len(clips), 1500, 1),
                                         attention_mask=valid)
        rows = hf.model.multi_modal_projector(tower(ref["input_features"], attention_mask=mask).last_hidden_state)
        total = 0
        for k, clip in enumerate(clips):
            features = ours.features(clip)
            window = np.zeros(30 * RATE, np.float32)
            window[:len(clip)] = clip
            exact = processor.feature_extractor._np_extract_fbank_features(window[None], "cpu")[0].T
            np.testing.assert_allclose(features, exact[:len(features)], atol=3e-7, rtol=0)
            np.testing.assert_allclose(features, ref["input_features"][k].numpy().T[:len(features)], atol=1e-4, rtol=0)
            assert ours.tokens(len(clip)) == int(tokens[k])
            total += int(tokens[k])
            got = model.multi_modal_projector(model.audio_tower(torch.from_numpy(features)))
            torch.testing.assert_close(got, rows[k, :int(tokens[k])], atol=2e-5, rtol=1e-5)
        assert total == counts


def test_greedy_matches_transformers_with_audio(qwen):
    """One clip and two clips, each cut over 16-token prefill steps: the prompt ids are Qwen2AudioProcessor's and the
    tokens transformers' generate; the two-clip prompt given as its expanded ids stays as it is."""
    folder, hf, processor, llm = qwen
    cases = [(ONE, CLIPS[:1]), (TWO, CLIPS[:2])]
    prompts = [{"prompt": p, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} for p, clips in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, clips), out in zip(cases, outs, strict=True):
        assert out.prompt_token_ids == _inputs(processor, text, clips)["input_ids"][0].tolist()
        assert _tokens(out) == _hf(hf, processor, out.prompt_token_ids, clips)
    assert outs[0].prompt_token_ids.count(hf.config.audio_token_id) == 25
    again = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"audio": CLIPS[:2]}},
                         GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == outs[1].prompt_token_ids
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_clips_keep_their_cache_blocks_apart(qwen):
    """Two clips of one length give the same prompt ids: the second must not reuse the first's KV blocks; a repeat of
    the second reuses its own."""
    folder, hf, processor, llm = qwen
    first = llm.generate({"prompt": ONE, "multi_modal_data": {"audio": CLIPS[0]}}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt": ONE, "multi_modal_data": {"audio": CLIPS[2]}}, GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == second.prompt_token_ids
    assert _tokens(second) == _hf(hf, processor, second.prompt_token_ids, [CLIPS[2]]) != _tokens(first)
    start = second.prompt_token_ids.index(hf.config.audio_token_id)
    assert second.num_cached_tokens <= start
    repeat = llm.generate({"prompt": ONE, "multi_modal_data": {"audio": CLIPS[2]}}, GREEDY, use_tqdm=False)[0]
    assert repeat.num_cached_tokens > start and list(repeat.outputs[0].token_ids) == list(second.outputs[0].token_ids)


def _chat(b64: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                                         {"type": "text", "text": "What is it?"}]}]


def test_chat_with_input_audio_matches_the_offline_clip(qwen):
    folder, hf, processor, llm = qwen
    out = llm.chat(_chat(base64.b64encode(wav_bytes(CLIPS[1])).decode()), GREEDY, use_tqdm=False)[0]
    assert "Audio 1: <|audio_bos|><|AUDIO|><|audio_eos|>" in out.prompt
    assert _tokens(out) == _hf(hf, processor, out.prompt_token_ids, [CLIPS[1]])


def test_refusals_by_name(qwen):
    from PIL import Image

    _, _, _, llm = qwen
    image = Image.new("RGB", (8, 8))
    with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]: 1 image\(s\): Qwen2-Audio takes no images"):
        llm.generate({"prompt": "<|AUDIO|>", "multi_modal_data": {"image": image}}, GREEDY)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]: 1 image\(s\): Qwen2-Audio takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"Qwen2-Audio takes no video inputs"):
        llm.generate({"prompt": "x", "multi_modal_data": {"video": [np.zeros((2, 8, 8, 3), np.uint8)]}}, GREEDY)
    for clip, pattern in [(np.zeros(0, np.float32), "empty audio"),
                          (np.zeros(30 * RATE + 1, np.float32), "a 30.00 s clip is longer than the 30 s Qwen2-Audio"),
                          (np.zeros(320, np.float32), "a 320-sample clip is too short for one audio token")]:
        with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]: audio 0: " + pattern):
            llm.generate({"prompt": "<|AUDIO|>", "multi_modal_data": {"audio": clip}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"3 audio clips, at most 2 .*--limit-mm-per-prompt"):
        llm.generate({"prompt": "<|AUDIO|>" * 3, "multi_modal_data": {"audio": CLIPS}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"1 audio placeholder\(s\) .* for 2 audio clip"):
        llm.generate({"prompt": "<|AUDIO|>", "multi_modal_data": {"audio": CLIPS[:2]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"input_audio\.data: not valid base64"):
        llm.chat(_chat("@@@"), GREEDY)


@pytest.mark.parametrize("flag", [{"language_model_only": True}, {"limit_mm_per_prompt": {"audio": 0}}],
                         ids=["language-model-only", "audio-limit-0"])
def test_language_model_only_leaves_the_encoder_out(qwen, flag):
    """--language-model-only, or --limit-mm-per-prompt audio 0 (its one modality): the encoder and projector are not
    built, a clip is refused as under limit 0, and text answers as the whole model's."""
    folder, _, _, llm = qwen
    text = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20, **flag)
    try:
        model = text.engine.runner.model
        assert not model.takes_audio and not any(p.is_meta for p in model.parameters())
        with pytest.raises(InvalidArgumentError, match="1 audio clips, at most 0"):
            text.generate({"prompt": ONE, "multi_modal_data": {"audio": CLIPS[0]}}, GREEDY)
        got = text.generate("The quick brown fox", GREEDY, use_tqdm=False)[0]
    finally:
        text.engine.shutdown()
    assert list(got.outputs[0].token_ids) == list(llm.generate("The quick brown fox", GREEDY,
                                                               use_tqdm=False)[0].outputs[0].token_ids)


def test_live_server_chat_with_input_audio(qwen):
    """`ferrox serve`: an input_audio chat answers 200 with the offline tokens; bad base64 is a 400 naming the field,
    and the server keeps serving."""
    from tests.server.server_proc import ServerProcess
    from tests.server.server_proc import post_json as post

    folder, _, _, llm = qwen
    messages = _chat(base64.b64encode(wav_bytes(CLIPS[0])).decode())
    expected = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    srv = ServerProcess(folder, "--served-model-name", "q2a", "--dtype", "float32", "--max-model-len", "512")
    try:
        body = {"model": "q2a", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        status, err = post(srv.base_url, {**body, "messages": _chat("%%%not base64")})
        assert status == 400 and "messages[0].content[0].input_audio.data: not valid base64" in err["error"]["message"]
        status, out = post(srv.base_url, {**body, "messages": messages})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    finally:
        srv.stop()


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_audio_on_cuda_matches_transformers(qwen, dtype):
    """The tiny model's two clips through the CUDA engine, each cut over prefill chunks, against transformers on the
    same device and dtype (bfloat16: the first four tokens, where the tiny model's margins hold)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, _, processor, _ = qwen
    hf = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    llm = LLM(model=folder, dtype="float32" if dtype == torch.float32 else "bfloat16", device="cuda",
              max_model_len=512, max_num_batched_tokens=16)
    try:
        out = llm.generate({"prompt": TWO, "multi_modal_data": {"audio": CLIPS[:2]}}, GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    features = processor.feature_extractor(CLIPS[:2], sampling_rate=RATE, return_attention_mask=True,
                                           padding="max_length", return_tensors="pt")
    ids = out.prompt_token_ids
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([ids], device="cuda"),
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                          input_features=features["input_features"].to("cuda", dtype),
                          feature_attention_mask=features["attention_mask"].to("cuda"),
                          max_new_tokens=GREEDY.max_tokens, do_sample=False)
    want, got = ref[0, len(ids):].tolist(), _tokens(out)
    assert got == want if dtype == torch.float32 else got[:4] == want[:4]
