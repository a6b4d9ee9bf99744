"""LLaVA-OneVision (LlavaOnevisionForConditionalGeneration) against transformers on a tiny random checkpoint (a SigLIP
tower of 35-pixel tiles, 7-pixel patches, over a Qwen2; pinpoints up to 2x2 and 3x1 tiles; anyres_max_2, so a 2x2
or 3x1 grid's feature map is scaled down): tiles bit-equal to the PIL LlavaOnevisionImageProcessor and video frames
to its video processor, prompt ids equal to LlavaOnevisionProcessor's, and greedy tokens identical to
transformers' generate for one image (scaled down or not), two images of different sizes, a text-only prompt, a
video, and an image with a video, with chunked prefill cutting the images."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError, UnsupportedModelError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_llava_onevision import make_tiny_llava_onevision

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
# (height, width) -> grid, unpadded map -> scaled map: wide 1x2, 5x10 (kept); near square 2x2, 10x10 -> 7x7;
# very tall 3x1, 15x3 (kept); tall 2x2, 10x8 (columns unpadded) -> 7x6.
SIZES = [(38, 88), (56, 59), (112, 25), (62, 50)]


def _image(height: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed + height * 1000 + width)
    return PIL.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    from transformers import AutoProcessor, LlavaOnevisionForConditionalGeneration

    folder = make_tiny_llava_onevision(tmp_path_factory.mktemp("llava-onevision"))
    hf = LlavaOnevisionForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder, use_fast=False)  # the PIL image processor
    # budget 16: each image's rows are computed across several chunked-prefill steps.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
    return folder, hf, processor, llm


def test_tiles_and_counts_match_transformers(onevision):
    from ferrox.multimodal.llava_onevision_processing import LlavaOnevisionImageProcessor, onevision_layout

    folder, hf, processor, _ = onevision
    layout = onevision_layout(hf.config.to_dict())
    ours = LlavaOnevisionImageProcessor.from_model_dir(folder, layout)
    assert ours is not None and layout.max_tiles == 2
    scaled = 0
    for height, width in [*SIZES, (35, 35), (125, 41), (21, 75), (105, 38)]:
        image = _image(height, width)
        pixels, size = ours(image)
        theirs = processor.image_processor([image], return_tensors="np")
        assert size == (height, width) and list(theirs["image_sizes"][0]) == [height, width]
        np.testing.assert_array_equal(pixels, theirs["pixel_values"][0][:len(pixels)])
        assert not theirs["pixel_values"][0][len(pixels):].any()  # (transformers pads a batch with zero tiles)
        assert ours.tokens(size) == processor._get_number_of_features(height, width, 35, 35), (height, width)
        rows, cols = (n * layout.patches for n in layout.grid(height, width))
        scaled += ours.tokens(size) < layout.patches**2 + min(rows * (cols + 1), cols * (rows + 1))
    assert scaled >= 2  # the anyres_max scaling was exercised


def _hf_greedy(hf, processor, ids, images, n=8):
    kwargs = {}
    if images:
        batch = processor.image_processor(images, return_tensors="pt")
        kwargs = {"pixel_values": batch["pixel_values"], "image_sizes": batch["image_sizes"],
                  "batch_num_images": batch["batch_num_images"]}
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(onevision):
    _, hf, processor, llm = onevision
    wide, square, tall = (_image(*SIZES[k]) for k in range(3))
    cases = [[wide], [square], [tall, wide], []]
    prompts = ["Hello " + " and ".join("<image>" for _ in imgs) + "\nWhat is this?" for imgs in cases]
    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p
                for p, imgs in zip(prompts, cases, strict=True)]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        ids = out.prompt_token_ids
        want = processor(text=prompt, images=imgs or None)["input_ids"][0]
        assert ids == list(want)
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processor, ids, imgs), prompt
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def _frames(count: int, height: int, width: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed + count).integers(0, 255, (count, height, width, 3), dtype=np.uint8)


def test_video_pixels_match_transformers(onevision):
    """Frames of the tower's size (kept) and of another (resized by torch as torchvision does)."""
    from ferrox.multimodal.llava_onevision_video import LlavaOnevisionVideoProcessor
    from ferrox.multimodal.video import Video

    folder, _, processor, _ = onevision
    ours = LlavaOnevisionVideoProcessor.from_model_dir(folder, 35, 5)
    assert ours is not None
    for frames in (_frames(3, 35, 35), _frames(2, 40, 50)):
        pixels, grid = ours(Video(frames))
        theirs = processor.video_processor([frames], return_tensors="np")["pixel_values_videos"][0]
        np.testing.assert_allclose(pixels, theirs, rtol=0, atol=1e-6)
        assert ours.tokens(grid) == len(frames) * 9 + 1  # 5x5 maps pooled to 3x3, one newline


def _hf_video_greedy(hf, processor, ids, images, videos, n=8):
    kwargs = dict(processor.video_processor(videos, return_tensors="pt"))
    if images:
        kwargs.update(processor.image_processor(images, return_tensors="pt"))
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False, **kwargs)
    return out[0, len(ids):].tolist()


def test_video_greedy_matches_transformers(onevision):
    """A video alone, and a video after an image in one prompt (chunked prefill cuts both)."""
    _, hf, processor, llm = onevision
    video, image = _frames(3, 40, 50), _image(*SIZES[0])
    cases = [("Clip: <video>\nWhat happens?", [], [video]), ("Look <image> then <video> ok?", [image], [video])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"video": v, **({"image": i} if i else {})}}
                         for p, i, v in cases], GREEDY, use_tqdm=False)
    for (prompt, images, videos), out in zip(cases, outs, strict=True):
        ids = out.prompt_token_ids
        assert ids == list(processor(text=prompt, images=images or None, videos=videos)["input_ids"][0])
        assert list(out.outputs[0].token_ids) == _hf_video_greedy(hf, processor, ids, images, videos), prompt
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize(("file", "field", "value", "match"), [
    ("config.json", "vision_aspect_ratio", "anyres", "vision_aspect_ratio 'anyres'"),
    ("processor_config.json", "num_image_tokens", 729, "num_image_tokens 729"),
])
def test_config_fields_refused(onevision, tmp_path, file, field, value, match):
    folder = str(tmp_path / "m")
    shutil.copytree(onevision[0], folder)
    with open(os.path.join(folder, file), encoding="utf-8") as f:
        config = json.load(f)
    config[field] = value
    with open(os.path.join(folder, file), "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=folder, dtype="float32", device="cpu")


def test_video_config_refuses_videos_only(onevision, tmp_path):
    """A video processor config ferrox cannot follow refuses videos by name; the folder's images still run."""
    folder = str(tmp_path / "m")
    shutil.copytree(onevision[0], folder)
    with open(os.path.join(folder, "video_preprocessor_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(folder, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "do_center_crop": True}, f)
    llm = LLM(model=folder, dtype="float32", device="cpu")
    with pytest.raises(InvalidArgumentError, match="no video inputs from this folder.*do_center_crop True"):
        llm.generate({"prompt": "<video>", "multi_modal_data": {"video": _frames(2, 35, 35)}}, GREEDY)
    image = _image(*SIZES[0])
    assert llm.generate({"prompt": "<image> hi", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)


@pytest.mark.gpu
def test_on_cuda_matches_transformers(onevision):
    """The tower, the projector, the bilinear scaling and pooling and the Qwen2 decode steps on the device,
    float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf, processor, _ = onevision
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=16)
    images = [_image(*SIZES[1]), _image(*SIZES[3])]
    prompt = "Hello <image> and <image>\nWhat is this?"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == list(processor(text=prompt, images=images)["input_ids"][0])
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processor, out.prompt_token_ids, images)
    video = _frames(3, 40, 50)
    out = llm.generate({"prompt": "Clip: <video> ok?", "multi_modal_data": {"video": video}}, GREEDY,
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_video_greedy(hf, processor, out.prompt_token_ids, [], [video])
