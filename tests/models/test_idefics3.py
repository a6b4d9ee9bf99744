"""Idefics3 / SmolVLM (Idefics3ForConditionalGeneration, SmolVLMForConditionalGeneration) against transformers:
a tiny random checkpoint (a 36-pixel tower of 6x6 patches, pixel shuffle by 2: 9 rows a tile, over a Llama),
the prompt's `<image>` expanded to exactly the ids Idefics3Processor makes (tiles in rows and columns with
their `<row_r_col_c>` tokens, the global tile), the tiles' pixels equal to its image processor's, and greedy
tokens identical to transformers' generate given the processor's pixel_values and pixel_attention_mask:
one and two images a prompt, tiles cut across chunked-prefill steps, without image splitting, SmolVLM's
class, LLM.chat's image part, and the errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers.tiny_models import make_tiny_idefics3

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _images():
    """Grids after the 72-pixel resize: 1x2 (wide), 2x2 (near square), 2x1 (tall); RGBA for the last."""
    rng = np.random.default_rng(0)
    shapes = ((40, 90, 3), (20, 25, 3), (83, 31, 4))
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in shapes]


def _no_split_copy(folder, dest) -> str:
    """The checkpoint with do_image_splitting false in both processor files (one 36-pixel tile an image)."""
    shutil.copytree(folder, dest)
    with open(os.path.join(dest, "preprocessor_config.json"), encoding="utf-8") as f:
        pre = json.load(f)
    pre["do_image_splitting"] = False
    with open(os.path.join(dest, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(pre, f)
    with open(os.path.join(dest, "processor_config.json"), encoding="utf-8") as f:
        proc = json.load(f)
    proc["image_processor"]["do_image_splitting"] = False
    with open(os.path.join(dest, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump(proc, f)
    return str(dest)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    from transformers import Idefics3ForConditionalGeneration

    folder = make_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "model")
    hf = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_seqs=4)
    return folder, hf, llm


def _processed(folder, text, images):
    """Idefics3Processor's ids, pixel_values and pixel_attention_mask for one prompt."""
    from transformers import Idefics3Processor

    processor = Idefics3Processor.from_pretrained(folder, use_fast=False)  # the PIL one ferrox reproduces
    return processor(text=[text], images=[list(images)], return_tensors="pt")


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _cases(images):
    cases = [[images[0]], [images[1], images[2]]]
    texts = ["Hello <image> what is this?", "Compare<image>and <image>: which?"]
    return cases, texts


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked-8"])
def test_greedy_matches_transformers(idefics3, budget):
    folder, hf, llm = idefics3
    if budget != 2048:  # 8 < 9 rows a tile: every tile is cut across steps
        llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    cases, texts = _cases(_images())
    outs = llm.generate([{"prompt": t, "multi_modal_data": {"image": imgs}} for t, imgs in zip(texts, cases, strict=True)],
                        GREEDY, use_tqdm=False)
    for imgs, text, out in zip(cases, texts, outs, strict=True):
        inputs = _processed(folder, text, imgs)
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()  # Idefics3Processor's ids exactly
        tokens = list(out.outputs[0].token_ids)
        assert tokens == _hf_greedy(hf, inputs)
    # The images matter: other pixels give other tokens.
    swapped = llm.generate({"prompt": texts[1], "multi_modal_data": {"image": cases[1][::-1]}}, GREEDY,
                           use_tqdm=False)[0]
    assert list(swapped.outputs[0].token_ids) != list(outs[1].outputs[0].token_ids)


def test_tiles_match_the_image_processor(idefics3):
    """Each tile is one item: a run of 9 image tokens and its pixels, equal to transformers' tile for tile."""
    folder, _, llm = idefics3
    images = _images()
    ids = llm.get_tokenizer().encode("A<image>B<image>C<image>")
    expanded, items = llm.engine.image_prompts.expand(ids, images, "test")
    inputs = _processed(folder, "A<image>B<image>C<image>", images)
    assert expanded == inputs["input_ids"][0].tolist()
    assert len(items) == 3 + 5 + 3  # 1x2, 2x2, 2x1 tiles, each with its global tile
    pixels = np.stack([item.pixel_values().numpy() for item in items])
    np.testing.assert_array_equal(pixels, inputs["pixel_values"][0].numpy())
    image_token = llm.engine.image_prompts.image_token_id
    for item in items:
        assert item.length == 9 and expanded[item.offset:item.end] == [image_token] * 9
    assert len({item.hash for item in items}) == len(items)


def test_without_image_splitting(idefics3, tmp_path):
    folder, hf, _ = idefics3
    folder = _no_split_copy(folder, tmp_path / "nosplit")
    llm = LLM(model=folder, dtype="float32", device="cpu")
    cases, texts = _cases(_images())
    for imgs, text in zip(cases, texts, strict=True):
        out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, GREEDY, use_tqdm=False)[0]
        inputs = _processed(folder, text, imgs)
        assert inputs["pixel_values"].shape[1] == len(imgs)  # one tile an image
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, inputs)


def test_smolvlm_matches_transformers(tmp_path):
    from transformers import SmolVLMForConditionalGeneration

    folder = make_tiny_idefics3(tmp_path / "smolvlm", architecture="SmolVLMForConditionalGeneration", seed=1)
    hf = SmolVLMForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu")
    cases, texts = _cases(_images())
    out = llm.generate({"prompt": texts[1], "multi_modal_data": {"image": cases[1]}}, GREEDY, use_tqdm=False)[0]
    inputs = _processed(folder, texts[1], cases[1])  # SmolVLMProcessor's rule is Idefics3Processor's
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, inputs)


def test_chat_with_an_image_part(idefics3):
    folder, hf, llm = idefics3
    image = _images()[0]
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert "<image>What is this?" in chat.prompt
    inputs = _processed(folder, chat.prompt, [image])
    assert chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(chat.outputs[0].token_ids) == _hf_greedy(hf, inputs)


def test_errors(idefics3, tmp_path):
    folder, _, llm = idefics3
    images = _images()
    with pytest.raises(InvalidArgumentError, match=r"1 image placeholder\(s\) \('<image>'\) for 2 image"):
        llm.generate({"prompt": "one <image> only", "multi_modal_data": {"image": images[:2]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="0 image placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": images[:1]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"9 image placeholder\(s\)"):  # already expanded: refused
        llm.generate({"prompt": "x" + "<image>" * 9, "multi_modal_data": {"image": images[:1]}}, GREEDY)
    # Two placeholders side by side are two images (a chat template may write them so).
    two = llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": images[:2]}}, GREEDY,
                       use_tqdm=False)[0]
    assert len(two.prompt_token_ids) > 2


def test_tiles_other_than_the_tower_size_are_refused(idefics3, tmp_path):
    from ferrox.errors import UnsupportedModelError
    from ferrox.multimodal.processing import image_prompts_for_model

    folder, _, llm = idefics3
    dest = tmp_path / "tile48"
    shutil.copytree(folder, dest)
    with open(dest / "preprocessor_config.json", encoding="utf-8") as f:
        pre = json.load(f)
    pre["max_image_size"] = {"longest_edge": 48}
    with open(dest / "preprocessor_config.json", "w", encoding="utf-8") as f:
        json.dump(pre, f)
    with open(dest / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    with pytest.raises(UnsupportedModelError, match="max_image_size.longest_edge 48"):
        image_prompts_for_model(str(dest), config, llm.get_tokenizer())


@pytest.mark.parametrize("side", [6, 19])
def test_tower_matches_transformers(side):
    """The tower alone against Idefics3VisionTransformer, side 19 included: there transformers' float32
    bucketing puts some patches on a neighbour's position, which the tower must reproduce."""
    from ferrox.models.vision.idefics3_vision import Idefics3VisionTower, _bucketed_positions
    from transformers.models.idefics3.configuration_idefics3 import Idefics3VisionConfig
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionTransformer

    config = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  image_size=2 * side, patch_size=2)
    torch.manual_seed(0)
    ref = Idefics3VisionTransformer(Idefics3VisionConfig(**config)).eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0.0, 0.3)
    tower = Idefics3VisionTower(config, dtype=torch.float32, device="cpu")
    tower.load_weights(ref.state_dict().items())
    pixels = torch.randn(2, 3, 2 * side, 2 * side)
    with torch.no_grad():
        torch.testing.assert_close(tower(pixels), ref(pixel_values=pixels).last_hidden_state, rtol=1e-5, atol=1e-5)
    identity = torch.equal(_bucketed_positions(side, side, side), torch.arange(side * side))
    assert identity == (side == 6)
