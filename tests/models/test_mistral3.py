"""Mistral 3 (Mistral3ForConditionalGeneration) against transformers: a tiny random checkpoint (a Mistral, a
two-layer Pixtral tower, the projector merging 2x2 patches), images of different sizes (so different rows
layouts), greedy tokens identical to transformers' generate on the same ids and pixels; chunked prefill
cutting an image's layout across steps (only its `[IMG]` positions take image rows); the chat template's image
part; the tied head; and the errors. Pixtral-12B's layout (LLaVA over a Pixtral tower) the same way."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_models import make_tiny_llava_pixtral, make_tiny_mistral3

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
SMALL_KV = 32 << 20  # bytes: tiny prompts, and LLMs start quicker without the default 2 GiB cache


def _images():
    rng = np.random.default_rng(2)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((40, 24, 3), (70, 90, 3),
                                                                                     (9, 30, 3))]


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    import transformers

    folder = make_tiny_mistral3(tmp_path_factory.mktemp("mistral3"))
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


@pytest.fixture(scope="module")
def llm(mistral3):
    return LLM(model=mistral3[0], dtype="float32", device="cpu", kv_cache_memory=SMALL_KV)


def _processed(llm, prompt, images):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": {"image": images}}),
                         llm.engine.image_prompts, "prompt")


def _hf_greedy(hf, processed, *, blank: bool = False):
    """transformers' generate on ferrox's expanded ids and the items' pixels (padded to one batch, as
    PixtralImageProcessor does, with their sizes)."""
    pixels = [item.pixel_values() for item in processed.mm_items]
    batch = torch.zeros(len(pixels), 3, max(p.shape[1] for p in pixels), max(p.shape[2] for p in pixels))
    for k, p in enumerate(pixels):
        batch[k, :, :p.shape[1], :p.shape[2]] = 0 if blank else p
    ids = torch.tensor([processed.prompt_token_ids])
    with torch.no_grad():
        out = hf.generate(input_ids=ids, pixel_values=batch, image_sizes=torch.tensor([list(p.shape[1:]) for p in pixels]),
                          max_new_tokens=8, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked-5"])
def test_greedy_matches_transformers(mistral3, budget):
    folder, hf = mistral3
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, kv_cache_memory=SMALL_KV)
    img = _images()
    cases = [[img[0]], [img[1]], [img[2], img[0]]]
    prompts = ["Hello " + " and ".join("[IMG]" for _ in c) + " What is this?" for c in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": c}} for p, c in zip(prompts, cases, strict=True)],
                        GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        processed = _processed(llm, prompt, imgs)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert [item.grid for item in processed.mm_items] == [[[5, 3]], [[7, 8]], [[2, 4], [5, 3]]][cases.index(imgs)]
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processed)
    assert_no_leaked_blocks(llm)


def test_images_matter(mistral3, llm):
    """The reference itself answers differently without the image's pixels: the parity above tests them."""
    hf = mistral3[1]
    processed = _processed(llm, "Hello [IMG] and [IMG] What is this?", _images()[1:])
    assert _hf_greedy(hf, processed) != _hf_greedy(hf, processed, blank=True)


def test_chat_image_part(mistral3, llm):
    hf = mistral3[1]
    img = _images()[1]
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": img},
                                                 {"type": "text", "text": "What is this?"}]}], GREEDY, use_tqdm=False)[0]
    assert "[IMG]" in out.prompt
    processed = _processed(llm, out.prompt, [img])
    assert out.prompt_token_ids == processed.prompt_token_ids
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processed)


def test_tied_head(tmp_path):
    import transformers

    folder = make_tiny_mistral3(tmp_path / "tied", tie_word_embeddings=True, seed=1)
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=SMALL_KV)
    assert llm.engine.runner.model.lm_head is None  # the top-level config's tie_word_embeddings
    prompt = "Look: [IMG]!"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _images()[:1]}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _processed(llm, prompt, _images()[:1]))


def test_errors(mistral3, llm):
    img = _images()
    with pytest.raises(InvalidArgumentError, match=r"1 image placeholder\(s\) \('\[IMG\]'\) for 2 image"):
        llm.generate({"prompt": "a [IMG] b", "multi_modal_data": {"image": img[:2]}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="0 image placeholder"):
        llm.generate({"prompt": "a b", "multi_modal_data": {"image": img[:1]}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="not the 5x3 layout"):
        llm.generate({"prompt": "a [IMG][IMG][IMG_END] b", "multi_modal_data": {"image": img[:1]}}, GREEDY,
                     use_tqdm=False)


def test_item_checks(mistral3, llm):
    """check_image_item: what the worker refuses in an item the front-end did not make."""
    import msgspec
    from ferrox.models.mistral3 import Mistral3ForConditionalGeneration

    item = _processed(llm, "a [IMG] b", _images()[:1]).mm_items[0]
    check = Mistral3ForConditionalGeneration.check_image_item
    model = type("M", (), {"vision_tower": type("T", (), {"num_channels": 3, "patch_size": 4})(), "merge": 2})()
    assert check(model, item) is None  # type: ignore[arg-type]
    bad = {"grid": dict(grid=None), "tokens for": dict(length=item.length - 1),
           "embed_positions": dict(embed_positions=item.embed_positions[:-1]),
           "pixels": dict(grid=[3, 5], length=18, embed_positions=[r * 6 + c for r in range(3) for c in range(5)])}
    for problem, change in bad.items():
        assert problem in check(model, msgspec.structs.replace(item, **change))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def llava_pixtral(tmp_path_factory):
    import transformers

    folder = make_tiny_llava_pixtral(tmp_path_factory.mktemp("llava_pixtral"))
    hf = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


@pytest.mark.parametrize("budget", [2048, 7], ids=["whole", "chunked-7"])
def test_llava_over_pixtral_matches_transformers(llava_pixtral, budget):
    """Pixtral-12B's layout (LLaVA config, Pixtral tower, no patch merging): a row per patch, the rows layout,
    LLaVA's projector; greedy tokens as transformers' Llava on the same ids and pixels."""
    folder, hf = llava_pixtral
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, kv_cache_memory=SMALL_KV)
    assert type(llm.engine.runner.model).__name__ == "LlavaPixtralForConditionalGeneration"
    img = _images()
    cases = [[img[0]], [img[2], img[1]]]
    prompts = ["Hello " + " and ".join("[IMG]" for _ in c) + " What is this?" for c in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": c}} for p, c in zip(prompts, cases, strict=True)],
                        GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        processed = _processed(llm, prompt, imgs)
        assert out.prompt_token_ids == processed.prompt_token_ids
        # longest edge 32 over 4-pixel patches (sides floored, then whole patches): 40x24 -> 32x19 -> 8x5 rows,
        # 9x30 -> 9x32 -> 3x8, 70x90 -> 24x32 -> 6x8
        assert [item.grid for item in processed.mm_items] == [[[8, 5]], [[3, 8], [6, 8]]][cases.index(imgs)]
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processed)
    assert _hf_greedy(hf, processed) != _hf_greedy(hf, processed, blank=True)  # the pixels matter
    assert_no_leaked_blocks(llm)


def test_llava_over_pixtral_refuses_the_default_strategy(llava_pixtral, tmp_path):
    """The "default" feature strategy drops a row a Pixtral tower does not have: refused by name."""
    import json
    import shutil

    from ferrox.errors import UnsupportedModelError

    folder = tmp_path / "default"
    shutil.copytree(llava_pixtral[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["vision_feature_select_strategy"] = "default"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="vision_feature_select_strategy 'default'"):
        LLM(model=str(folder), dtype="float32", device="cpu", kv_cache_memory=SMALL_KV)
