"""Qwen2-VL and Qwen2.5-VL against transformers: tiny random checkpoints (a Qwen2 rotating by multimodal
positions, mrope_section [2, 3, 3]; a two-block vision transformer merging 2x2 patches, windowed in 2.5),
images of different sizes (so different token counts), greedy tokens identical to transformers' generate on
the same ids, patches and grids; the rotary positions against transformers' get_rope_index; chunked prefill
cutting an image across steps, and the decode steps after it (positions shifted by the request's delta)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_models import make_tiny_qwen2_vl

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _images():
    rng = np.random.default_rng(2)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((60, 90, 3), (100, 50, 3),
                                                                                     (30, 30, 3))]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def qwen(request, tmp_path_factory):
    import transformers

    folder = make_tiny_qwen2_vl(tmp_path_factory.mktemp(request.param), version=request.param)
    cls = (transformers.Qwen2VLForConditionalGeneration if request.param == "qwen2_vl"
           else transformers.Qwen2_5_VLForConditionalGeneration)
    hf = cls.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _hf_inputs(hf, out):
    """transformers' inputs for ferrox's expanded prompt: the items' patches and grids, in order."""
    items = out.mm_items
    ids = torch.tensor([out.prompt_token_ids])
    return dict(input_ids=ids, pixel_values=torch.cat([it.pixel_values() for it in items]),
                image_grid_thw=torch.tensor([it.grid for it in items]),
                mm_token_type_ids=(ids == hf.config.image_token_id).int())


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _processed(llm, prompt, images):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": {"image": images}}),
                         llm.engine.image_prompts, "prompt")


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked-5"])
def test_greedy_matches_transformers(qwen, budget):
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    img = _images()
    cases = [[img[0]], [img[1]], [img[2], img[0]]]
    prompts = ["Hello " + " and ".join(PLACEHOLDER for _ in c) + " What is this?" for c in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": c}} for p, c in zip(prompts, cases, strict=True)],
                        GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        processed = _processed(llm, prompt, imgs)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)


def test_rotary_positions_match_get_rope_index(qwen):
    from ferrox.worker.mrope import mrope_positions

    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu")
    img = _images()
    processed = _processed(llm, "a " + PLACEHOLDER + " b c " + PLACEHOLDER + " d", [img[1], img[2]])
    inputs = _hf_inputs(hf, processed)
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"])
    got, got_delta = mrope_positions(len(processed.prompt_token_ids), processed.mm_items, 2)
    assert np.array_equal(got, want[:, 0].numpy()) and got_delta == int(delta)


def test_chat_image_part(qwen):
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu")
    img = _images()[0]
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                 {"type": "text", "text": "What is this?"}]}], GREEDY, use_tqdm=False)[0]
    assert PLACEHOLDER in out.prompt
    processed = _processed(llm, out.prompt, [img])
    assert out.prompt_token_ids == processed.prompt_token_ids
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))


@pytest.mark.gpu
def test_on_cuda_matches_transformers(qwen):
    """The tower, the [3, T] rotary positions of image steps (eager) and the shifted [T] ones of the decode
    steps after them (CUDA graphs, fused kernels) on the device, float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=8)
    img = _images()
    prompt = "Hello " + PLACEHOLDER + " and " + PLACEHOLDER + " What is this?"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img[:2]}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, _processed(llm, prompt, img[:2])))


def test_mm_processor_kwargs_bound_the_pixels(qwen, tmp_path):
    """vLLM's --mm-processor-kwargs: Qwen's max_pixels over the folder's, fewer image tokens, the same answer as
    transformers given the same patches; other keys (and any key for a family that takes none) refused by name."""
    from tests.helpers.tiny_models import make_tiny_llava

    folder, hf = qwen
    img = _images()[1]  # 100 x 50: 12 tokens under the folder's max_pixels
    prompt = "Hi " + PLACEHOLDER + " ok"
    small = LLM(model=folder, dtype="float32", device="cpu", mm_processor_kwargs={"max_pixels": 56 * 56})
    full = LLM(model=folder, dtype="float32", device="cpu")
    few, many = (_processed(llm, prompt, [img]) for llm in (small, full))
    assert few.mm_items[0].length < many.mm_items[0].length
    out = small.generate({"prompt": prompt, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, few))
    with pytest.raises(InvalidArgumentError, match="mm_processor_kwargs.fps"):
        LLM(model=folder, dtype="float32", device="cpu", mm_processor_kwargs={"fps": 2})
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs.max_pixels.*takes none"):
        LLM(model=make_tiny_llava(tmp_path / "llava"), dtype="float32", device="cpu",
            mm_processor_kwargs={"max_pixels": 100})
