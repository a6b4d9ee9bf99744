"""Gemma 4 videos against transformers, float32 on CPU: the tiny random checkpoint of test_gemma4_vision.py
(tests/helpers/tiny_gemma4.py: 4-pixel patches pooled 3x3, 70 soft tokens a frame; E2B's per-layer embeddings and
KV-sharing layers, use_bidirectional_attention "vision").

- the processor: Gemma4Processor's prompt ids (per frame its mm:ss timestamp, begin-of-image, its soft tokens,
  end-of-image) and Gemma4VideoProcessor's patches beside an image, for frames as given (their source indices and
  frame rate: timestamps past a minute) and for a whole video sampled again at mm_processor_kwargs num_frames with
  max_soft_tokens 140;
- greedy tokens through the real engine (a video alone, a video beside an image, the expanded ids sent back)
  equal transformers' generate given pixel_values_videos and mm_token_type_ids (each frame's tokens attending to
  each other both ways on the sliding layers);
- refused by name: mm_processor_kwargs fps, placeholders that do not match the videos, more videos than
  --limit-mm-per-prompt.
On a GPU: a video beside an image through the CUDA engine.
The video token follows a newline in every prompt: ferrox tokenizes the first timestamp on its own, as vLLM's
token-level replacement does (gemma4_video.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers import tiny_models
from tests.helpers.tiny_gemma4 import make_tiny_gemma4
from tests.models.conftest import cut_at_eos

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("torchvision")  # transformers' video processor runs on torchvision

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _frames(count: int, seed: int, height: int = 24, width: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (count, height, width, 3), dtype=np.uint8)


def _image():
    return PIL.fromarray(_frames(1, 9, 30, 100)[0])


# Three frames picked from a 0.4 fps source at 0, 75 and 150 seconds (vLLM's metadata).
CLIP = (_frames(3, 2), {"fps": 0.4, "total_num_frames": 90, "frames_indices": [0, 30, 60]})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = make_tiny_gemma4(tmp_path_factory.mktemp("gemma4video"), images=True, per_layer=True, kv_shared=2,
                              bidirectional="vision", standardize=True, clipped=True, seed=7)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20,
              limit_mm_per_prompt={"image": 2, "video": 1})
    yield folder, hf, llm
    llm.engine.shutdown()


def _hf_processed(folder, prompt, data, **kwargs):
    """transformers' Gemma4Processor on the prompt's text, image and video (frames, or (frames, metadata))."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    from transformers.video_utils import VideoMetadata

    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=Gemma4ImageProcessorPil.from_pretrained(folder),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        video_processor=transformers.Gemma4VideoProcessor.from_pretrained(folder))
    frames, metadata = data["video"] if isinstance(data["video"], tuple) else (data["video"], None)
    resample = bool(metadata and metadata.get("do_sample_frames"))
    theirs = [VideoMetadata(**{k: v for k, v in metadata.items() if k != "do_sample_frames"})] if metadata else None
    images = {"images": [[data["image"]]]} if "image" in data else {}
    return processor(text=[prompt], videos=[frames], video_metadata=theirs, do_sample_frames=resample,
                     return_tensors="pt", **images, **kwargs)


def _ours(llm, prompt, data, **kwargs):
    from ferrox.engine.input_processor import attach_images, process_prompt

    request = {"prompt": prompt, "multi_modal_data": data, "mm_processor_kwargs": kwargs}
    return attach_images(process_prompt(llm.get_tokenizer(), request), llm.engine.image_prompts, "prompt")


@pytest.mark.parametrize("resample", [False, True], ids=["as-given", "sampled-again"])
def test_processor_matches_transformers(gemma, resample):
    """sampled-again: a whole 7-frame 0.5 fps video (vLLM's do_sample_frames) thinned to num_frames 3, frames and
    image at max_soft_tokens 140."""
    folder, hf, llm = gemma
    if resample:
        video = (_frames(7, 1), {"fps": 0.5, "total_num_frames": 7, "frames_indices": list(range(7)),
                                 "do_sample_frames": True})
        kwargs = {"num_frames": 3, "max_soft_tokens": 140}
    else:
        video, kwargs = CLIP, {}
    prompt = "See <|image|> then\n<|video|> ok"
    data = {"image": _image(), "video": video}
    got = _ours(llm, prompt, data, **kwargs)
    want = _hf_processed(folder, prompt, data, **kwargs)
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    frames = [item for item in got.mm_items if item.modality == "video"]
    assert len(frames) == 3 == want["pixel_values_videos"].shape[0]
    for item, pixels, positions in zip(frames, want["pixel_values_videos"], want["video_position_ids"], strict=True):
        rows, cols = item.grid
        assert item.length == rows * cols // 9 and int((positions != -1).all(-1).sum()) == rows * cols
        assert torch.equal(item.pixel_values(), pixels[:rows * cols])
    # each frame's item is its run of video tokens (its timestamp, begin and end of image are text)
    runs = [p for item in frames for p in range(item.offset, item.end)]
    assert runs == [i for i, t in enumerate(got.prompt_token_ids) if t == hf.config.video_token_id]


def _hf_greedy(hf, folder, ids, prompt, data):
    inputs = _hf_processed(folder, prompt, data)
    t = torch.tensor([ids])
    kinds = (t == hf.config.image_token_id).long() + 2 * (t == hf.config.video_token_id).long()
    pixels = {k: inputs[k] for k in ("pixel_values", "image_position_ids", "pixel_values_videos", "video_position_ids",
                                     "num_frames_per_video") if k in inputs}
    with torch.no_grad():
        out = hf.generate(input_ids=t, mm_token_type_ids=kinds, max_new_tokens=GREEDY.max_tokens, do_sample=False,
                          **pixels)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(gemma):
    """A video alone (frames without metadata: 24 fps, as transformers assumes) and a video beside an image; the
    second's expanded ids sent back are kept as they are."""
    folder, hf, llm = gemma
    cases = [("Watch:\n<|video|> what happens?", {"video": _frames(2, 4, 36, 24)}),
             ("See <|image|> then\n<|video|> ok", {"image": _image(), "video": CLIP})]
    outs = llm.generate([{"prompt": p, "multi_modal_data": d} for p, d in cases], GREEDY, use_tqdm=False)
    eos = [tiny_models.EOS_TOKEN_ID]
    for (prompt, data), out in zip(cases, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), eos) == _hf_greedy(hf, folder, out.prompt_token_ids,
                                                                             prompt, data)
    again = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": cases[1][1]}, GREEDY,
                         use_tqdm=False)[0]
    assert again.prompt_token_ids == outs[1].prompt_token_ids
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)


def test_refusals_by_name(gemma):
    _, _, llm = gemma
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs\.fps: .*max_soft_tokens, num_frames"):
        llm.generate({"prompt": "\n<|video|>", "multi_modal_data": {"video": CLIP}, "mm_processor_kwargs": {"fps": 1}},
                     GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"2 video token\(s\) do not match 1 video\(s\)"):
        llm.generate({"prompt": "\n<|video|> and <|video|>", "multi_modal_data": {"video": CLIP}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="2 videos, at most 1"):
        llm.generate({"prompt": "\n<|video|><|video|>", "multi_modal_data": {"video": [CLIP, CLIP]}}, GREEDY)


@pytest.mark.gpu
def test_video_on_cuda_matches_transformers(gemma):
    """A video beside an image through the CUDA engine (float32): each frame's steps leave the Triton kernels for
    the torch attention on the sliding layers, as an image's do."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf, _ = gemma
    llm = LLM(model=folder, dtype="float32", device="cuda", max_model_len=512)
    prompt, data = "See <|image|> then\n<|video|> ok", {"image": _image(), "video": CLIP}
    try:
        out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == _hf_greedy(
        hf, folder, out.prompt_token_ids, prompt, data)
