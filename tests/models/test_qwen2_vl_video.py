"""Qwen2-VL and Qwen2.5-VL videos against transformers, on tiny random checkpoints (tests/helpers/
tiny_qwen2_vl_video.py): the video processor's patches and grids, second_per_grid_ts, greedy tokens identical
to transformers' generate on the same ids and pixel_values_videos (a video alone, a video beside an image,
a chunked prefill cutting the video), and the rotary positions against get_rope_index on a prompt whose video
spans more frames than its side (its temporal positions reach past the text after it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_qwen2_vl_video import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, make_tiny_qwen2_vl_video

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("torchvision")  # transformers' video processor runs on torchvision

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def _frames(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (count, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    import transformers

    folder = make_tiny_qwen2_vl_video(tmp_path_factory.mktemp(request.param), version=request.param)
    cls = (transformers.Qwen2VLForConditionalGeneration if request.param == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    hf = cls.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=2048)
    return folder, hf, llm


def _processed(llm, prompt, data):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": data}),
                         llm.engine.image_prompts, "prompt")


def _hf_inputs(hf, processed):
    """transformers' inputs for ferrox's expanded prompt: its items' patches, grids and seconds, by modality."""
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
        if hf.config.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor([it.second_per_grid_ts for it in videos])
    return inputs


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_video_patches_match_transformers(qwen):
    from transformers import AutoVideoProcessor
    from transformers.video_utils import VideoMetadata

    folder, hf, llm = qwen
    theirs = AutoVideoProcessor.from_pretrained(folder)
    frames = _frames(5, 40, 70)  # an odd count: the last frame repeats to fill the last temporal patch
    metadata = {"fps": 6.0, "total_num_frames": 15, "frames_indices": [0, 3, 7, 10, 14]}
    processed = _processed(llm, "a " + VIDEO_PLACEHOLDER + " b", {"video": (frames, metadata)})
    (item,) = processed.mm_items
    want = theirs(videos=[frames], return_tensors="pt", cap_pixels_per_frame=False)
    assert np.array_equal(item.pixel_values().numpy(), want["pixel_values_videos"].numpy())
    assert item.grid == want["video_grid_thw"][0].tolist() and item.modality == "video"
    assert processed.prompt_token_ids.count(hf.config.video_token_id) == item.length
    if hf.config.model_type == "qwen2_5_vl":  # Qwen2_5_VLProcessor: temporal_patch_size / the sampled fps
        assert item.second_per_grid_ts == pytest.approx(2 / VideoMetadata(**metadata).sampled_fps)
    else:
        assert item.second_per_grid_ts is None


@pytest.mark.parametrize("budget", [2048, 7], ids=["whole", "chunked-7"])
def test_greedy_matches_transformers(qwen, budget):
    folder, hf, _ = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    image = PIL.fromarray(_frames(1, 60, 90, seed=3)[0])
    cases = [("Hello " + VIDEO_PLACEHOLDER + " What happens?", {"video": _frames(4, 40, 60, seed=1)}),
             ("See " + IMAGE_PLACEHOLDER + " then " + VIDEO_PLACEHOLDER + " ok",
              {"image": image, "video": [PIL.fromarray(f) for f in _frames(3, 50, 40, seed=2)]})]
    outs = llm.generate([{"prompt": p, "multi_modal_data": d} for p, d in cases], GREEDY, use_tqdm=False)
    for (prompt, data), out in zip(cases, outs, strict=True):
        processed = _processed(llm, prompt, data)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)


def test_rotary_positions_match_get_rope_index(qwen):
    from ferrox.worker.mrope import mrope_positions

    _, hf, llm = qwen
    image = PIL.fromarray(_frames(1, 30, 30, seed=4)[0])
    # 12 frames at 1 fps: 6 temporal patches over a 2x2 merged grid, so the frames outrun the text after them
    video = (_frames(12, 28, 28, seed=5), {"fps": 1.0})
    processed = _processed(llm, "a " + VIDEO_PLACEHOLDER + " b " + IMAGE_PLACEHOLDER + " c",
                           {"image": [image], "video": [video]})
    inputs = _hf_inputs(hf, processed)
    extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else {}
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                          inputs["video_grid_thw"], **extra)
    tps = hf.config.vision_config.tokens_per_second if hf.config.model_type == "qwen2_5_vl" else None
    got, got_delta = mrope_positions(len(processed.prompt_token_ids), processed.mm_items, 2, tps)
    assert np.array_equal(got, want[:, 0].numpy()) and got_delta == int(delta)


@pytest.mark.gpu
def test_video_on_cuda(qwen):
    folder, hf, _ = qwen
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM(model=folder, dtype="float32", device="cuda")
    prompt, data = "Hi " + VIDEO_PLACEHOLDER + " what?", {"video": _frames(4, 40, 60, seed=6)}
    out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    processed = _processed(llm, prompt, data)
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)
