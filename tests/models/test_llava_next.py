"""LLaVA-NeXT (LlavaNextForConditionalGeneration) against transformers on tiny random checkpoints (a CLIP tower of
28-pixel tiles over a Llama, and over a Mistral with chunked prefill): tiles bit-equal to transformers' PIL
LlavaNextImageProcessor, each `<image>` expanded to LlavaNextProcessor's count for its size, and greedy tokens
identical to transformers' generate over the same ids, pixels and image sizes, for one and two images of
different aspect ratios (so different tile grids and unpadding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers.tiny_models import make_tiny_llava_next

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
# (height, width): wide (a 1x2 grid, rows unpadded), tall (2x1, columns unpadded), near square (2x2), very tall (3x1).
SIZES = [(30, 70), (50, 40), (45, 47), (90, 20)]


def _image(height: int, width: int, seed: int = 0):
    rng = np.random.default_rng(seed + height * 1000 + width)
    return PIL.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def _hf_processor(folder):
    from transformers import AutoTokenizer, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    return LlavaNextProcessor(LlavaNextImageProcessorPil.from_pretrained(folder), AutoTokenizer.from_pretrained(folder),
                              patch_size=7, vision_feature_select_strategy="default", num_additional_image_tokens=1)


@pytest.fixture(scope="module", params=[("llama", 2048), ("mistral", 8)], ids=["llama", "mistral-chunked"])
def llava_next(request, tmp_path_factory):
    from transformers import LlavaNextForConditionalGeneration

    text, budget = request.param
    folder = make_tiny_llava_next(tmp_path_factory.mktemp(f"llava-next-{text}"), text=text)
    hf = LlavaNextForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    # budget 8: each image's rows are computed across many chunked-prefill steps.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    return folder, hf, llm


def test_tiles_match_transformers(tmp_path):
    from ferrox.multimodal.llava_next_processing import AnyresLayout, LlavaNextImageProcessor
    from transformers import LlavaNextConfig

    folder = make_tiny_llava_next(tmp_path / "m")
    layout = AnyresLayout.from_config(LlavaNextConfig.from_pretrained(folder).to_dict())
    ours = LlavaNextImageProcessor.from_model_dir(folder, layout)
    hf = _hf_processor(folder)
    assert ours is not None
    for height, width in [*SIZES, (28, 28), (100, 33), (17, 60)]:
        image = _image(height, width)
        pixels, size = ours(image)
        theirs = hf.image_processor([image], return_tensors="np")
        assert size == (height, width) and list(theirs["image_sizes"][0]) == [height, width]
        np.testing.assert_array_equal(pixels, theirs["pixel_values"][0])
        # The placeholder count: LlavaNextProcessor's rule (less the dropped class token).
        count = hf._get_number_of_features(height, width, 28, 28) - 1
        assert ours.tokens(size) == count, (height, width)


def _hf_greedy(hf, processor, ids, images, n=8):
    batch = processor.image_processor(images, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=batch["pixel_values"],
                          image_sizes=batch["image_sizes"], max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(llava_next):
    folder, hf, llm = llava_next
    processor = _hf_processor(folder)
    wide, tall = _image(*SIZES[0]), _image(*SIZES[1])
    cases = [[wide], [tall], [wide, tall], [tall, wide]]
    prompts = ["Hello " + " and ".join("<image>" for _ in imgs) + "\nWhat is this?" for imgs in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in zip(prompts, cases,
                                                                                                  strict=True)],
                        GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        ids = out.prompt_token_ids
        want = processor(text=prompt, images=imgs)["input_ids"][0]
        assert ids == list(want)
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processor, ids, imgs)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_placeholder_rules(llava_next):
    _, hf, llm = llava_next
    image = _image(*SIZES[2])
    single = llm.generate({"prompt": "<image>", "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)[0]
    count = sum(t == hf.config.image_token_id for t in single.prompt_token_ids)
    expanded = llm.generate({"prompt": "<image>" * count, "multi_modal_data": {"image": image}}, GREEDY,
                            use_tqdm=False)[0]
    assert expanded.prompt_token_ids == single.prompt_token_ids
    assert expanded.outputs[0].token_ids == single.outputs[0].token_ids
    with pytest.raises(InvalidArgumentError, match="image token"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": [image, image]}}, GREEDY)
