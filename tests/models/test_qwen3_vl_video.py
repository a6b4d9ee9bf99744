"""Qwen3-VL videos against transformers on a tiny random checkpoint (tests/helpers/tiny_qwen3_vl.py, video=True):
prompt ids (each temporal patch's `<t seconds>` text, then its pads wrapped in vision start / end), patches and
grids identical to transformers' Qwen3VLProcessor, for frames as given and for a whole short video sampled again
at the processor's fps; greedy tokens identical to transformers' generate on the same ids / pixel_values_videos /
video_grid_thw (a video alone, beside an image, a chunked prefill cutting the video and its DeepStack rows); the
rotary positions against get_rope_index (one block per frame); LLM.chat with a `video_url` data URL equal to its
decoded frames offline; what vLLM refuses, refused by name."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_qwen3_vl import (
    PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    make_tiny_qwen3_vl,
    make_tiny_qwen3_vl_moe,
)

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("torchvision")  # transformers' video processor runs on torchvision
pytest.importorskip("av")

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (count, height, width, 3), dtype=np.uint8)


def _clip(count: int, seed: int = 0) -> tuple[np.ndarray, dict]:
    """`count` frames picked from a 3x longer 6 fps video, with vLLM's metadata."""
    return _frames(count, 40, 70, seed), {"fps": 6.0, "total_num_frames": 3 * count,
                                           "frames_indices": list(range(0, 3 * count, 3))}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    folder = make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video"), video=True)
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=2048)
    return folder, hf, llm


def _processed(llm, prompt, data):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": data}),
                         llm.engine.image_prompts, "prompt")


def _hf_inputs(hf, processed):
    ids = torch.tensor([processed.prompt_token_ids])
    images = [it for it in processed.mm_items if it.modality == "image"]
    videos = [it for it in processed.mm_items if it.modality == "video"]
    kinds = (ids == hf.config.image_token_id).int() + 2 * (ids == hf.config.video_token_id).int()
    inputs = dict(input_ids=ids, mm_token_type_ids=kinds)
    if images:
        inputs.update(pixel_values=torch.cat([it.pixel_values() for it in images]),
                      image_grid_thw=torch.tensor([it.grid for it in images]))
    if videos:
        inputs.update(pixel_values_videos=torch.cat([it.pixel_values() for it in videos]),
                      video_grid_thw=torch.tensor([it.grid for it in videos]))
    return inputs


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _hf_processor(folder):
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor, Qwen3VLVideoProcessor

    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                            tokenizer=AutoTokenizer.from_pretrained(folder),
                            video_processor=Qwen3VLVideoProcessor.from_pretrained(folder))


@pytest.mark.parametrize("resample", [False, True], ids=["as-given", "sampled-at-fps"])
def test_prompt_and_pixels_match_transformers_processor(qwen, resample):
    """as-given: 5 frames (odd: the last temporal patch repeats the last frame and its timestamp) beside an image;
    sampled-at-fps: a whole 20-frame 5 fps video (vLLM's do_sample_frames) that the processor thins to 2 fps (8)."""
    from transformers.video_utils import VideoMetadata

    folder, hf, llm = qwen
    image = PIL.fromarray(_frames(1, 60, 90, seed=3)[0])
    if resample:
        frames = _frames(20, 50, 40, seed=1)
        metadata = {"fps": 5.0, "total_num_frames": 20, "frames_indices": list(range(20)), "do_sample_frames": True}
    else:
        frames, metadata = _clip(5)
    prompt = "See " + PLACEHOLDER + " then " + VIDEO_PLACEHOLDER + " ok"
    got = _processed(llm, prompt, {"image": image, "video": (frames, metadata)})
    theirs = {k: v for k, v in metadata.items() if k != "do_sample_frames"}
    want = _hf_processor(folder)(text=[prompt], images=[image], videos=[frames],
                                 video_metadata=[VideoMetadata(**theirs)], do_sample_frames=resample,
                                 cap_pixels_per_frame=False, return_tensors="pt")
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    image_item, video_item = got.mm_items
    assert video_item.modality == "video" and video_item.grid == want["video_grid_thw"][0].tolist()
    assert video_item.grid[0] == (4 if resample else 3)
    assert np.array_equal(video_item.pixel_values().numpy(), want["pixel_values_videos"].numpy())
    assert image_item.grid == want["image_grid_thw"][0].tolist()
    # the item's run: every frame's timestamp text and wrapper; its embed positions: the pads alone
    pads = [video_item.offset + p for p in video_item.embed_positions]
    video_id = hf.config.video_token_id
    assert pads == [i for i, t in enumerate(got.prompt_token_ids) if t == video_id]


@pytest.mark.parametrize("budget", [2048, 7], ids=["whole", "chunked-7"])
def test_greedy_matches_transformers(qwen, budget):
    folder, hf, _ = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    image = PIL.fromarray(_frames(1, 60, 90, seed=3)[0])
    cases = [("Hello " + VIDEO_PLACEHOLDER + " What happens?", {"video": _clip(4, seed=1)}),
             ("See " + PLACEHOLDER + " then " + VIDEO_PLACEHOLDER + " ok", {"image": image, "video": _clip(3, seed=2)})]
    outs = llm.generate([{"prompt": p, "multi_modal_data": d} for p, d in cases], GREEDY, use_tqdm=False)
    for (prompt, data), out in zip(cases, outs, strict=True):
        processed = _processed(llm, prompt, data)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)


def test_rotary_positions_match_get_rope_index(qwen):
    """Frames of 1x3 merged patches (not square: rows and columns told apart) over 3 temporal patches, each a
    block of its own after its timestamp text (Qwen2.5-VL's one-block rule would place them otherwise)."""
    from ferrox.worker.mrope import mrope_positions

    _, hf, llm = qwen
    image = PIL.fromarray(_frames(1, 30, 30, seed=4)[0])
    video = (_frames(6, 32, 96, seed=5), {"fps": 1.0, "total_num_frames": 6, "frames_indices": list(range(6))})
    processed = _processed(llm, "a " + VIDEO_PLACEHOLDER + " b " + PLACEHOLDER + " c",
                           {"image": [image], "video": [video]})
    inputs = _hf_inputs(hf, processed)
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                          inputs["video_grid_thw"].clone())
    got, got_delta = mrope_positions(len(processed.prompt_token_ids), processed.mm_items, 2)
    assert processed.mm_items[0].grid == [3, 2, 6]
    assert np.array_equal(got, want[:, 0].numpy()) and got_delta == int(delta)


def test_chat_video_url_matches_offline_frames(qwen, tmp_path):
    """A 6-frame webm: vLLM's loader keeps it whole and marks it for sampling, so the processor thins it to its
    fps (4 frames, min_frames)."""
    from ferrox.multimodal.video import decode_video

    from tests.helpers.tiny_qwen2_vl_video import write_video

    folder, hf, llm = qwen
    data = open(write_video(str(tmp_path / "clip.webm"), _frames(6, 48, 64, seed=7), fps=4), "rb").read()
    url = "data:video/webm;base64," + base64.b64encode(data).decode()
    out = llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "What happens?"}]}], GREEDY,
                   use_tqdm=False)[0]
    video = decode_video(data)
    metadata = {"fps": video.fps, "total_num_frames": video.total_frames, "frames_indices": video.indices,
                "do_sample_frames": True}
    processed = _processed(llm, out.prompt, {"video": (video.frames, metadata)})
    assert out.prompt_token_ids == processed.prompt_token_ids
    assert processed.mm_items[0].grid[0] == 2  # 4 frames of the 6, two temporal patches
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)


def test_moe_video_matches_transformers(tmp_path):
    """Qwen3-VL-MoE takes the same video path (Qwen3VLImages): a smoke test, a video cut by a chunked prefill."""
    import transformers

    folder = make_tiny_qwen3_vl_moe(tmp_path / "moe", video=True)
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=7)
    prompt, data = "Hello " + VIDEO_PLACEHOLDER + " What happens?", {"video": _clip(4, seed=8)}
    out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, _processed(llm, prompt, data)))
    assert_no_leaked_blocks(llm)


def test_refusals(qwen):
    _, _, llm = qwen
    frames, metadata = _clip(4)
    with pytest.raises(InvalidArgumentError, match="a video needs its metadata"):
        llm.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": frames}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="Qwen3-VL writes its frames' timestamps there"):
        llm.generate({"prompt": "<|video_pad|> hi", "multi_modal_data": {"video": (frames, metadata)}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="at least 2"):
        one = (frames[:1], {"fps": 2.0, "total_num_frames": 1, "frames_indices": [0]})
        llm.generate({"prompt": VIDEO_PLACEHOLDER, "multi_modal_data": {"video": one}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="must be the whole video"):
        llm.generate({"prompt": VIDEO_PLACEHOLDER,
                      "multi_modal_data": {"video": (frames, {**metadata, "do_sample_frames": True})}}, GREEDY)
    assert_no_leaked_blocks(llm)


@pytest.mark.gpu
def test_video_on_cuda(qwen):
    folder, hf, _ = qwen
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=8)
    prompt, data = "Hi " + VIDEO_PLACEHOLDER + " what?", {"video": _clip(4, seed=6)}
    out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    processed = _processed(llm, prompt, data)
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)
