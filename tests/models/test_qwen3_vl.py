"""Qwen3-VL (dense) against transformers on a tiny random checkpoint (tests/helpers/tiny_qwen3_vl.py: a Qwen3
with interleaved multimodal RoPE, a three-block vision tower with a learned position table, DeepStack from
blocks 0 and 1 into text layers 0 and 1): greedy tokens identical to transformers' generate on the same ids,
patches and grids, whole and with chunked prefill cutting the images (the DeepStack rows must follow the image
rows across steps); prompt ids, patches and grids identical to transformers' Qwen3VLProcessor; the rotary
positions and the interleaved rotary itself against transformers'; a config ferrox cannot honour refused."""

from __future__ import annotations

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import UnsupportedModelError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_qwen3_vl import PLACEHOLDER, make_tiny_qwen3_vl

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _images():
    rng = np.random.default_rng(2)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((60, 90, 3), (100, 50, 3),
                                                                                     (30, 30, 3))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    folder = make_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))
    hf = transformers.Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _hf_inputs(hf, out):
    """transformers' inputs for ferrox's expanded prompt: the items' patches and grids, in order."""
    items = out.mm_items
    ids = torch.tensor([out.prompt_token_ids])
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int())
    if items:
        inputs.update(pixel_values=torch.cat([it.pixel_values() for it in items]),
                      image_grid_thw=torch.tensor([it.grid for it in items]))
    return inputs


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _processed(llm, prompt, images):
    from ferrox.engine.input_processor import attach_images, process_prompt

    data = {"image": images} if images else {}
    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": data}),
                         llm.engine.image_prompts, "prompt")


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked-5"])
def test_greedy_matches_transformers(qwen, budget):
    """One image, two of different sizes, and a text-only prompt in the same batch; with a budget of 5 tokens
    every image is cut across steps (its rows and DeepStack rows come a few at a time)."""
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    img = _images()
    cases = [[img[0]], [img[1]], [img[2], img[0]], []]
    prompts = ["Hello " + " and ".join(PLACEHOLDER for _ in c) + " What is this?" for c in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": c} if c else {}}
                         for p, c in zip(prompts, cases, strict=True)], GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        processed = _processed(llm, prompt, imgs)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))
    assert_no_leaked_blocks(llm)


def test_deepstack_decides_the_tokens(qwen):
    """The test above can fail on DeepStack: transformers without it answers otherwise on these images."""
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu")
    processed = _processed(llm, "Hello " + PLACEHOLDER + " What is this?", [_images()[0]])
    inputs = _hf_inputs(hf, processed)
    plain = copy.deepcopy(hf)
    plain.model.visual.deepstack_visual_indexes = []
    assert _hf_greedy(plain, inputs) != _hf_greedy(hf, inputs)


def _hf_processor(folder):
    """transformers' Qwen3VLProcessor on the folder. Its video processor needs torchvision, which images never
    use: built without one."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class ImagesOnly(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)
            return None

    return ImagesOnly(image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder),
                      tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=None)


def test_prompt_and_pixels_match_transformers_processor(qwen):
    folder, _ = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu")
    img = _images()
    prompt = "Hello " + PLACEHOLDER + " and " + PLACEHOLDER + " ok"
    want = _hf_processor(folder)(text=[prompt], images=[img[0], img[1]], return_tensors="pt")
    got = _processed(llm, prompt, [img[0], img[1]])
    assert got.prompt_token_ids == want["input_ids"][0].tolist()
    assert [it.grid for it in got.mm_items] == want["image_grid_thw"].tolist()
    torch.testing.assert_close(torch.cat([it.pixel_values() for it in got.mm_items]), want["pixel_values"],
                               rtol=0, atol=1e-6)


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


def test_interleaved_rotary_matches_transformers(qwen):
    """cos / sin of [3, T] positions against Qwen3VLTextRotaryEmbedding; Qwen2-VL's contiguous sections differ."""
    from ferrox.layers.rotary import MRotaryEmbedding

    _, hf = qwen
    positions = torch.randint(0, 50, (3, 1, 12))
    cos, sin = hf.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    head_dim = cos.shape[-1]
    rope = MRotaryEmbedding(head_dim, 10000.0, None, "cpu", section=[4, 2, 2], interleaved=True)
    got_cos, got_sin = rope.cos_sin(positions[:, 0], torch.float32)
    torch.testing.assert_close(got_cos[:, 0], cos[0])
    torch.testing.assert_close(got_sin[:, 0], sin[0])
    contiguous = MRotaryEmbedding(head_dim, 10000.0, None, "cpu", section=[4, 2, 2])
    assert not torch.allclose(contiguous.cos_sin(positions[:, 0], torch.float32)[0][:, 0], cos[0])


def test_chat_image_part(qwen):
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cpu")
    img = _images()[1]
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                 {"type": "text", "text": "What is this?"}]}], GREEDY, use_tqdm=False)[0]
    assert PLACEHOLDER in out.prompt
    processed = _processed(llm, out.prompt, [img])
    assert out.prompt_token_ids == processed.prompt_token_ids
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, processed))


def test_refuses_a_contiguous_mrope_layout(qwen, tmp_path):
    """mrope_interleaved false asks for a layout transformers does not apply to Qwen3-VL: refused by name."""
    folder, _ = qwen
    for name in os.listdir(folder):
        shutil.copy(os.path.join(folder, name), tmp_path / name)
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    config["text_config"]["rope_parameters"]["mrope_interleaved"] = False
    with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    with pytest.raises(UnsupportedModelError, match="mrope_interleaved"):
        LLM(model=str(tmp_path), dtype="float32", device="cpu")


@pytest.mark.gpu
def test_on_cuda_matches_transformers(qwen):
    """The tower, DeepStack, the [3, T] rotary positions of image steps (eager) and the shifted [T] ones of the
    decode steps after them (CUDA graphs, fused kernels) on the device, float32, images cut across steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=8)
    img = _images()
    prompt = "Hello " + PLACEHOLDER + " and " + PLACEHOLDER + " What is this?"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img[:2]}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _hf_inputs(hf, _processed(llm, prompt, img[:2])))
