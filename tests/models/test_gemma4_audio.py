"""Gemma 4 with audio (Gemma4ForConditionalGeneration's audio tower) against transformers, float32 on CPU: a tiny
random checkpoint (tests/helpers/tiny_gemma4.py audio=True: a two-layer conformer over 128 mel bins, its
projections clipped; the six-layer language model with per-layer embeddings, KV-sharing layers and
use_bidirectional_attention "vision").

- features: transformers' Gemma4AudioFeatureExtractor on a batch of clips of different lengths (padded, masked),
  each clip's valid frames against ferrox's, and the soft-token counts against Gemma4Processor's;
- the tower and embedder: transformers' get_audio_features on that padded batch, clip by clip;
- greedy tokens through the real engine (one clip, two clips, a clip beside an image, a chat with an input_audio
  wav part and with an audio_url part, a prompt already expanded) equal transformers' generate, with a
  max_num_batched_tokens small enough that each clip is cut over prefill chunks; a second clip of the same length
  (the same placeholder ids) does not reuse the first one's KV blocks, a repeat does;
- refusals by name: undecodable bytes, a file that is not audio, an empty clip, one past 30 s, an unknown format,
  more clips than --limit-mm-per-prompt allows;
- two tensor-parallel ranks (gloo, the clips split among them) give one rank's tokens;
- a live `ferrox serve`: a chat with input_audio gets 200 and the offline tokens, bad base64 and a non-audio payload
  400s naming the field, and the server keeps serving.
On a GPU: the tower at the released shape (Gemma4AudioConfig's defaults) against transformers' on CUDA, and the tiny
model's clips through the CUDA engine (float32 and bfloat16)."""

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
from tests.helpers.tiny_gemma4 import make_tiny_gemma4
from tests.models.conftest import cut_at_eos

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
RATE = 16_000
EOS = [tiny_models.EOS_TOKEN_ID]


def _clip(samples: int, hz: float, seed: int = 0) -> np.ndarray:
    """A sine with noise, float32 in [-1, 1) on the int16 grid (a wav of it decodes to the same samples)."""
    t = np.arange(samples) / RATE
    rng = np.random.default_rng(seed)
    x = 0.5 * np.sin(2 * np.pi * hz * t) + 0.2 * rng.standard_normal(samples)
    return (np.clip(np.round(x * 32767), -32768, 32767) / 32768).astype(np.float32)


CLIPS = [_clip(16_000, 300, 1), _clip(24_321, 900, 2), _clip(16_000, 1200, 3)]  # 25, 38 and 25 soft tokens



@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = make_tiny_gemma4(tmp_path_factory.mktemp("gemma4a"), audio=True, per_layer=True, kv_shared=2,
                              bidirectional="vision", seed=7)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    # 16 tokens a step: every clip (25, 38 soft tokens) is cut over prefill chunks.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
              max_num_batched_tokens=16, limit_mm_per_prompt={"image": 2, "audio": 2})
    yield folder, hf, llm
    llm.engine.shutdown()


def _extractor(folder):
    return transformers.Gemma4AudioFeatureExtractor.from_pretrained(folder)


def _hf(hf, folder, ids, clips, images=()):
    """transformers' greedy tokens for a prompt (ids as ferrox expanded them), its clips and images (an image's tokens
    attending both ways, as mm_token_type_ids marks them; audio tokens causal)."""
    extra = {}
    if clips:
        features = _extractor(folder)(list(clips), return_tensors="pt")
        extra.update(input_features=features["input_features"], input_features_mask=features["input_features_mask"])
    t = torch.tensor([ids])
    if images:
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        pixels = Gemma4ImageProcessorPil.from_pretrained(folder)(list(images), return_tensors="pt")
        extra.update(pixel_values=pixels["pixel_values"], image_position_ids=pixels["image_position_ids"],
                     mm_token_type_ids=(t == hf.config.image_token_id).long())
    with torch.no_grad():
        out = hf.generate(input_ids=t, max_new_tokens=GREEDY.max_tokens, do_sample=False, **extra)
    return out[0, len(ids):].tolist()


def _processor(folder):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return transformers.Gemma4Processor(
        feature_extractor=_extractor(folder), image_processor=Gemma4ImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder), video_processor=transformers.Gemma4VideoProcessor())


def _tokens(out) -> list[int]:
    return cut_at_eos(list(out.outputs[0].token_ids), EOS)


def test_features_and_tower_match_transformers(gemma):
    """One padded batch of three clips of different lengths through transformers' extractor and tower; ferrox's per
    clip: the valid frames exactly, the rows within float32 rounding, the counts Gemma4Processor's."""
    from ferrox.multimodal.gemma4_audio_processing import Gemma4AudioFeatureExtractor

    folder, hf, llm = gemma
    model = llm.engine.runner.model
    ours = Gemma4AudioFeatureExtractor.from_model_dir(folder)
    clips = [*CLIPS, _clip(161, 50), _clip(4_001, 60)]
    ref = _extractor(folder)(clips, return_tensors="pt")
    processor = _processor(folder)
    with torch.no_grad():
        out = hf.model.get_audio_features(ref["input_features"], ref["input_features_mask"])
        for k, clip in enumerate(clips):
            features = ours.features(clip)
            valid = int(ref["input_features_mask"][k].sum())
            assert features.shape == (valid, 128)
            np.testing.assert_array_equal(features, ref["input_features"][k][:valid].numpy())
            want = out.pooler_output[k][out.attention_mask[k]]
            assert ours.tokens(valid) == want.shape[0] == processor._compute_audio_num_tokens(clip, RATE)
            got = model.embed_audio(model.audio_tower(torch.from_numpy(features)))
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_greedy_matches_transformers_with_audio(gemma):
    """One clip, two clips, and the two-clip prompt given as the ids it expands to (kept as they are), each clip cut
    over 16-token prefill steps; a clip beside an image (whose 60 tokens attend both ways: computed in one step, so
    on an engine of the default budget, where the clip after it is cut at the step's end)."""
    folder, hf, llm = gemma
    cases = [("Listen <|audio|> what?", [CLIPS[0]]), ("Two <|audio|> and <|audio|> done", CLIPS[:2])]
    prompts = [{"prompt": p, "multi_modal_data": {"audio": [(c, RATE) for c in clips]}} for p, clips in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (_, clips), out in zip(cases, outs, strict=True):
        assert _tokens(out) == _hf(hf, folder, out.prompt_token_ids, clips)
    image = PIL.fromarray(np.random.default_rng(3).integers(0, 255, (30, 100, 3), dtype=np.uint8))
    wide = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
               max_num_batched_tokens=64)
    try:
        mixed = wide.generate({"prompt": "See <|image|> hear <|audio|> ok",
                               "multi_modal_data": {"image": image, "audio": CLIPS[1]}}, GREEDY, use_tqdm=False)[0]
    finally:
        wide.engine.shutdown()
    assert _tokens(mixed) == _hf(hf, folder, mixed.prompt_token_ids, [CLIPS[1]], [image])
    assert outs[0].prompt_token_ids.count(hf.config.audio_token_id) == 25
    # The prompt's expansion is Gemma4Processor's: begin-of-audio, the clip's soft tokens, end-of-audio.
    want = _processor(folder)(text=[cases[1][0]], audio=CLIPS[:2], return_tensors="np")["input_ids"][0].tolist()
    assert outs[1].prompt_token_ids == want
    again = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"audio": CLIPS[:2]}},
                         GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == outs[1].prompt_token_ids
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_clips_keep_their_cache_blocks_apart(gemma):
    """Two clips of one length give the same prompt ids: the second must not reuse the first's KV blocks (the clip's
    hash is in the block hashes), and each answers as transformers does; a repeat of the second reuses its own."""
    folder, hf, llm = gemma
    prompt = "Hear this one: <|audio|> and say"
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": (CLIPS[0], RATE)}}, GREEDY,
                         use_tqdm=False)[0]
    second = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": CLIPS[2]}}, GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids == second.prompt_token_ids
    assert _tokens(second) == _hf(hf, folder, second.prompt_token_ids, [CLIPS[2]]) != _tokens(first)
    start = second.prompt_token_ids.index(hf.config.audio_token_id)
    assert second.num_cached_tokens <= start
    repeat = llm.generate({"prompt": prompt, "multi_modal_data": {"audio": CLIPS[2]}}, GREEDY, use_tqdm=False)[0]
    assert repeat.num_cached_tokens > start and list(repeat.outputs[0].token_ids) == list(second.outputs[0].token_ids)


def test_chat_parts_match_the_offline_clip(gemma):
    folder, hf, llm = gemma
    b64 = base64.b64encode(wav_bytes(CLIPS[1])).decode()
    want = None
    for part in ({"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                 {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}}):
        out = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}], GREEDY,
                       use_tqdm=False)[0]
        assert "<|audio|>" in out.prompt
        want = want or _hf(hf, folder, out.prompt_token_ids, [CLIPS[1]])
        assert _tokens(out) == want


def test_clip_sources(tmp_path):
    """A wav file under --allowed-local-media-path (refused outside it), a clip at 8 kHz resampled to 16 kHz, a stereo
    array averaged to mono, int16 PCM scaled as a decoder scales it."""
    from ferrox.multimodal.audio import MediaError, to_audio

    (tmp_path / "clip.wav").write_bytes(wav_bytes(CLIPS[0]))
    got = to_audio(str(tmp_path / "clip.wav"), RATE, allowed_local_media_path=str(tmp_path))
    np.testing.assert_array_equal(got.samples, CLIPS[0])
    with pytest.raises(MediaError, match="allowed-local-media-path"):
        to_audio(str(tmp_path / "clip.wav"), RATE)
    slow = to_audio((CLIPS[0][::2], 8_000), RATE)
    assert abs(len(slow.samples) - 16_000) <= 32 and slow.rate == RATE
    both = to_audio(np.stack([CLIPS[0], -CLIPS[0]]), RATE)
    np.testing.assert_allclose(both.samples, 0.0, atol=1e-7)
    np.testing.assert_array_equal(to_audio(np.round(CLIPS[0] * 32768).astype(np.int16), RATE).samples, CLIPS[0])


def test_audio_refusals_by_name(gemma):
    _, _, llm = gemma

    def chat(body):
        return llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": body}]}], GREEDY,
                        use_tqdm=False)

    wav = base64.b64encode(wav_bytes(CLIPS[0])).decode()
    png = io.BytesIO()
    PIL.new("RGB", (8, 8)).save(png, format="PNG")
    cases = [({"data": "@@@", "format": "wav"}, r"input_audio\.data: not valid base64"),
             ({"data": base64.b64encode(png.getvalue()).decode(), "format": "wav"},
              r"input_audio\.data: not decodable audio"),
             ({"data": wav, "format": "xyz"}, r"input_audio\.format: 'xyz' is not an audio format"),
             ({"data": wav}, r"input_audio\.format: missing")]
    for body, pattern in cases:
        with pytest.raises(InvalidArgumentError, match=r"messages\[0\]\.content\[0\]\." + pattern):
            chat(body)
    for clip, pattern in [(np.zeros(0, np.float32), "empty audio"), (np.zeros(31 * RATE, np.float32),
                                                                      "a 31.00 s clip is longer than the 30 s")]:
        with pytest.raises(InvalidArgumentError, match=r"prompts\[0\]: audio 0: " + pattern):
            llm.generate({"prompt": "<|audio|>", "multi_modal_data": {"audio": clip}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"3 audio clips, at most 2 .*--limit-mm-per-prompt"):
        llm.generate({"prompt": "<|audio|>" * 3, "multi_modal_data": {"audio": CLIPS}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"1 audio placeholder\(s\) .* for 2 audio clip"):
        llm.generate({"prompt": "<|audio|>", "multi_modal_data": {"audio": CLIPS[:2]}}, GREEDY)


def test_limits_of_zero_leave_the_audio_tower_out(gemma):
    """--language-model-only (every limit 0): neither tower is built and a clip is refused as under limit 0; images and
    videos at 0 alone keep the encoders (audio may still come: vLLM's rule) and a clip answers as the whole model; audio
    at 0 alone leaves the audio tower out."""
    folder, _, llm = gemma
    prompt = {"prompt": "Listen <|audio|> what?", "multi_modal_data": {"audio": CLIPS[0]}}
    text = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
               language_model_only=True)
    heard = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
                limit_mm_per_prompt={"image": 0, "video": 0})
    deaf = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
               limit_mm_per_prompt={"audio": 0})
    try:
        # audio 0 alone: the audio tower is not built (vLLM's rule), the vision side is
        model = deaf.engine.runner.model
        assert not model.takes_audio and getattr(model, "audio_tower", None) is None and model.takes_images
        with pytest.raises(InvalidArgumentError, match="1 audio clips, at most 0"):
            deaf.generate(prompt, GREEDY)
        assert not text.engine.runner.model.takes_audio
        assert not any(p.is_meta for p in text.engine.runner.model.parameters())
        with pytest.raises(InvalidArgumentError, match="1 audio clips, at most 0"):
            text.generate(prompt, GREEDY)
        assert heard.engine.runner.model.takes_audio
        assert _tokens(heard.generate(prompt, GREEDY, use_tqdm=False)[0]) == _tokens(
            llm.generate(prompt, GREEDY, use_tqdm=False)[0])
    finally:
        text.engine.shutdown()
        heard.engine.shutdown()
        deaf.engine.shutdown()


def test_tensor_parallel_audio_matches_one_rank(gemma):
    """Two ranks (gloo), --mm-encoder-tp-mode data: the audio tower whole on each, each of the step's clips encoded by
    one rank and the rows all-gathered (under 'weights' the audio tower is whole on each rank and runs every clip,
    the path one rank takes). The same tokens as one rank."""
    folder, _, llm = gemma
    prompt = {"prompt": "Two <|audio|> and <|audio|> done", "multi_modal_data": {"audio": CLIPS[:2]}}
    want = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    tp = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=8 << 20,
             max_num_batched_tokens=16, tensor_parallel_size=2, mm_encoder_tp_mode="data")
    try:
        got = tp.generate(prompt, GREEDY, use_tqdm=False)[0]
    finally:
        tp.engine.shutdown()
    assert list(got.outputs[0].token_ids) == list(want.outputs[0].token_ids)


def test_live_server_chat_with_input_audio(gemma):
    """`ferrox serve` of the tiny checkpoint: input_audio and audio_url chats answer 200 with the offline tokens; bad
    base64 and a non-audio payload are 400s naming the field; the server keeps serving."""
    from tests.server.server_proc import ServerProcess
    from tests.server.server_proc import post_json as post

    folder, _, llm = gemma
    b64 = base64.b64encode(wav_bytes(CLIPS[0])).decode()
    messages = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}},
                                             {"type": "text", "text": "What is it?"}]}]
    expected = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    srv = ServerProcess(folder, "--served-model-name", "g4a", "--dtype", "float32", "--max-model-len", "512")
    try:
        body = {"model": "g4a", "max_tokens": 8, "temperature": 0, "return_token_ids": True}
        status, out = post(srv.base_url, {**body, "messages": messages})
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids)
        assert out["choices"][0]["message"]["content"] == expected.outputs[0].text
        assert out["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
        bad = [({"data": "%%%not base64", "format": "wav"}, "input_audio.data: not valid base64"),
               ({"data": base64.b64encode(b"plain text, no audio here at all").decode(), "format": "mp3"},
                "input_audio.data: not decodable audio")]
        for part, pattern in bad:
            status, err = post(srv.base_url, {**body, "messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": part}]}]})
            assert status == 400 and f"messages[0].content[0].{pattern}" in err["error"]["message"], err
        url = [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64," + b64}},
                                            {"type": "text", "text": "What is it?"}]}]
        status, out = post(srv.base_url, {**body, "messages": url})
        assert status == 200 and out["choices"][0]["token_ids"] == list(expected.outputs[0].token_ids), out
    finally:
        srv.stop()


# ---- GPU ----------------------------------------------------------------------------------------------
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def released_shape_tower_matches(device: str, dtype: torch.dtype) -> float:
    """Gemma4AudioConfig's defaults (1024 wide, 12 layers, clipped), random weights, a 30 s and a 7 s clip in one padded
    batch: ferrox's tower and embedder against transformers' Gemma4AudioModel and Gemma4MultimodalEmbedder (into a
    1536-wide text model). Returns the largest relative error (norm of the difference over the norm of
    transformers' rows), clip by clip."""
    from ferrox.models.vision.gemma4_audio import Gemma4AudioEmbedder, Gemma4AudioTower
    from ferrox.multimodal.gemma4_audio_processing import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4 import modeling_gemma4 as hf_gemma4

    torch.manual_seed(0)
    audio = transformers.Gemma4AudioConfig()
    text = transformers.Gemma4TextConfig(hidden_size=1536)
    hf_tower, hf_embedder = hf_gemma4.Gemma4AudioModel(audio), hf_gemma4.Gemma4MultimodalEmbedder(audio, text)
    with torch.no_grad():
        for name, buf in hf_tower.named_buffers():
            if name.endswith(("_min", "_max")):
                buf.fill_(-4.0 if name.endswith("_min") else 4.0)
    hf_tower, hf_embedder = hf_tower.to(device, dtype).eval(), hf_embedder.to(device, dtype).eval()
    tower = Gemma4AudioTower(audio.to_dict(), dtype=dtype, device=device)
    tower.load_weights((f"model.audio_tower.{n}", t) for n, t in hf_tower.state_dict().items())
    embedder = Gemma4AudioEmbedder(audio.output_proj_dims, text.hidden_size, audio.rms_norm_eps, dtype, device)
    embedder.embedding_projection.weight.data.copy_(hf_embedder.embedding_projection.weight)
    clips = [_clip(30 * RATE, 440, 5), _clip(7 * RATE + 123, 220, 6)]
    ref = transformers.Gemma4AudioFeatureExtractor()(clips, return_tensors="pt")
    ours = Gemma4AudioFeatureExtractor({})
    worst = 0.0
    with torch.no_grad():
        out = hf_tower(ref["input_features"].to(device, dtype), ref["input_features_mask"].to(device))
        rows = hf_embedder(out.last_hidden_state)
        for k, clip in enumerate(clips):
            want = rows[k][out.attention_mask[k]].float()
            got = embedder(tower(torch.from_numpy(ours.features(clip)).to(device, dtype))).float()
            assert got.shape == want.shape
            worst = max(worst, float((got - want).norm() / want.norm()))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_released_shape_audio_tower_on_cuda_matches_transformers(dtype, bound):
    _needs_cuda()
    assert released_shape_tower_matches("cuda", dtype) < bound


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_audio_on_cuda_matches_transformers(gemma, dtype):
    """The tiny model's clips through the CUDA engine, each cut over prefill chunks, against transformers on the
    same device and dtype (bfloat16: the first four tokens, where the tiny model's margins hold)."""
    _needs_cuda()
    folder, _, _ = gemma
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=dtype).to("cuda").eval()
    llm = LLM(model=folder, dtype="float32" if dtype == torch.float32 else "bfloat16", device="cuda",
              max_model_len=512, max_num_batched_tokens=16)
    try:
        out = llm.generate({"prompt": "Two <|audio|> and <|audio|> done", "multi_modal_data": {"audio": CLIPS[:2]}},
                           GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    features = _extractor(folder)(CLIPS[:2], return_tensors="pt")
    with torch.no_grad():
        ref = hf.generate(input_ids=torch.tensor([out.prompt_token_ids], device="cuda"),
                          input_features=features["input_features"].to("cuda", dtype),
                          input_features_mask=features["input_features_mask"].to("cuda"),
                          max_new_tokens=GREEDY.max_tokens, do_sample=False)
    want = ref[0, len(out.prompt_token_ids):].tolist()
    got = _tokens(out)
    if dtype == torch.float32:
        assert got == want
    else:
        assert got[:4] == want[:4]
