"""multimodal/pixtral_processing.py against transformers' PixtralImageProcessorPil and PixtralProcessor's text
rule: the same configs and images (shrunk, enlarged to whole units, RGBA, L, P), bit-equal float32 pixels and
equal sizes; prompts expanded to the same ids, items over the whole rows layout with the `[IMG]` positions
taking the rows; prompts that hold an expanded image already; the errors."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.pixtral_processing import PixtralImageProcessor, PixtralImagePrompts, layout_ids
from ferrox.multimodal.processing import image_prompts_for_model
from PIL import Image

pytest.importorskip("transformers")
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil  # noqa: E402

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# (config, unit: PixtralProcessor's patch_size x spatial_merge_size, which it passes to the image processor)
CONFIGS: dict[str, tuple[dict[str, Any], int]] = {
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503's file, the longest edge lowered so that images shrink.
    "mistral-small": ({"image_processor_type": "PixtralImageProcessorFast", "patch_size": 14, "resample": 3,
                       "size": {"longest_edge": 308}, "image_mean": MEAN, "image_std": STD,
                       "rescale_factor": 0.00392156862745098}, 28),
    "defaults": ({"image_processor_type": "PixtralImageProcessor"}, 16),
    "height-width": ({"image_processor_type": "PixtralImageProcessorPil", "size": {"height": 100, "width": 60},
                      "resample": 2, "image_mean": 0.5, "image_std": [0.5, 0.25, 0.5]}, 8),
    "no-rescale": ({"do_rescale": False, "do_normalize": False, "size": {"longest_edge": 64}}, 4),
}


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "P": 1}[mode]
    pixels = rng.integers(0, 256, size=(height, width, bands), dtype=np.uint8)
    image = Image.fromarray(pixels[..., 0] if bands == 1 else pixels, "L" if mode == "P" else mode)
    if mode == "P":
        image = image.convert("P", palette=Image.Palette.ADAPTIVE)
    return image


IMAGES = {
    "landscape": _image(500, 300), "portrait": _image(181, 403, seed=1), "square": _image(56, 56, seed=2),
    "tiny": _image(3, 5, seed=3), "thin": _image(5, 90, seed=4), "large": _image(1201, 799, seed=5),
    "rgba": _image(64, 48, "RGBA", seed=6), "grey": _image(71, 33, "L", seed=7), "palette": _image(90, 60, "P"),
}


@pytest.mark.parametrize("image", IMAGES.values(), ids=IMAGES.keys())
@pytest.mark.parametrize("case", CONFIGS.values(), ids=CONFIGS.keys())
def test_pixels_match_transformers(case, image):
    config, unit = case
    expected = PixtralImageProcessorPil(**config)(image, patch_size=unit, return_tensors="np")
    pixels, (rows, cols) = PixtralImageProcessor(config, unit)(image)
    assert expected["image_sizes"].tolist() == [[rows * unit, cols * unit]]
    assert pixels.dtype == np.float32 and pixels.flags.c_contiguous
    np.testing.assert_array_equal(pixels, expected["pixel_values"][0])


def test_without_resize():
    config = {"do_resize": False}
    image = _image(48, 32)
    expected = PixtralImageProcessorPil(**config)(image, patch_size=16, return_tensors="np")
    pixels, grid = PixtralImageProcessor(config, 16)(image)
    assert grid == (2, 3)
    np.testing.assert_array_equal(pixels, expected["pixel_values"][0])
    with pytest.raises(ValueError, match="multiples of 16"):
        PixtralImageProcessor(config, 16)(_image(40, 32))


def test_config_errors():
    with pytest.raises(UnsupportedModelError, match="not PixtralImageProcessor"):
        PixtralImageProcessor({"image_processor_type": "CLIPImageProcessor"}, 16)
    with pytest.raises(UnsupportedModelError, match="size must be"):
        PixtralImageProcessor({"size": {"shortest_edge": 10}}, 16)
    with pytest.raises(UnsupportedModelError, match="do_center_crop"):
        PixtralImageProcessor({"do_center_crop": True}, 16)
    with pytest.raises(ModelLoadError, match="image_std"):
        PixtralImageProcessor({"image_std": [1, 2]}, 16)
    with pytest.raises(ValueError, match="no pixels"):
        PixtralImageProcessor({"size": {"longest_edge": 16}}, 16)(_image(1000, 2))


# --- prompts ---------------------------------------------------------------------------------------------------

TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
HUB = CONFIGS["mistral-small"][0]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import AddedToken

    from tests.helpers.tiny_models import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in TOKENS])
    return tok


@pytest.fixture
def folder(tmp_path, tokenizer):
    """A model folder: config.json's image token, patch and merge sizes, the hub's two processor files."""
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": tokenizer.token_to_id("[IMG]"),
              "spatial_merge_size": 2, "vision_config": {"model_type": "pixtral", "patch_size": 14}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(HUB))
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "PixtralProcessor", "patch_size": 14, "spatial_merge_size": 2, "image_token": "[IMG]",
         "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}))
    return tmp_path, config


def _prompts(folder, tokenizer, **kwargs) -> PixtralImagePrompts:
    path, config = folder
    prompts = image_prompts_for_model(str(path), config, tokenizer, **kwargs)
    assert isinstance(prompts, PixtralImagePrompts)
    return prompts


def _pixtral_processor(monkeypatch):
    """transformers' PixtralProcessor class: its module imports the torchvision image processor (absent here) for
    one function the PIL one has too."""
    import importlib
    import sys

    from transformers.models.pixtral import image_processing_pil_pixtral

    monkeypatch.setitem(sys.modules, "transformers.models.pixtral.image_processing_pixtral",
                        image_processing_pil_pixtral)
    monkeypatch.delitem(sys.modules, "transformers.models.pixtral.processing_pixtral", raising=False)
    return importlib.import_module("transformers.models.pixtral.processing_pixtral").PixtralProcessor


def test_expansion_matches_transformers(folder, tokenizer, monkeypatch):
    """PixtralProcessor's text rule (its own replace_image_token; the processor itself cannot be built without
    torchvision), then the tokenizer: the same ids as ferrox's expansion; the items cover each layout and
    put the rows on its `[IMG]`s."""
    processor_cls = _pixtral_processor(monkeypatch)
    prompts = _prompts(folder, tokenizer)
    assert prompts.placeholder == "[IMG]"
    images = [IMAGES["landscape"], IMAGES["tiny"], IMAGES["portrait"]]
    text = "Compare [IMG] and\n[IMG][IMG] please."
    expected = PixtralImageProcessorPil(**HUB)(images, patch_size=28, return_tensors="np")
    rule = SimpleNamespace(patch_size=14, spatial_merge_size=2, image_token="[IMG]", image_break_token="[IMG_BREAK]",
                           image_end_token="[IMG_END]")
    pieces = text.split("[IMG]")
    hf_text = pieces[0] + "".join(processor_cls.replace_image_token(rule, expected, k) + piece  # type: ignore[arg-type]
                                  for k, piece in enumerate(pieces[1:]))
    ids, items = prompts.expand(tokenizer.encode(text).ids, images, "prompt")
    assert ids == tokenizer.encode(hf_text).ids
    img, brk, end = (tokenizer.token_to_id(t) for t in TOKENS)
    sizes = expected["image_sizes"].tolist()
    assert [item.grid for item in items] == [[h // 28, w // 28] for h, w in sizes]
    assert len({tuple(item.grid) for item in items}) == 3  # each image its own layout
    for k, (item, (h, w)) in enumerate(zip(items, sizes, strict=True)):
        assert ids[item.offset:item.end] == layout_ids(h // 28, w // 28, img, brk, end)
        assert item.embed_positions == [i for i in range(item.length) if ids[item.offset + i] == img]
        assert item.num_embeds == (h // 28) * (w // 28)
        np.testing.assert_array_equal(item.pixel_values().numpy(), expected["pixel_values"][k, :, :h, :w])

    # The expanded prompt again, images already in place: the same ids, the same items.
    again, items2 = prompts.expand(ids, images, "prompt")
    assert again == ids and [(i.offset, i.length, i.grid) for i in items2] == [(i.offset, i.length, i.grid)
                                                                                 for i in items]


def test_expanded_layouts_and_placeholders(folder, tokenizer):
    prompts = _prompts(folder, tokenizer)
    img, brk, end = (tokenizer.token_to_id(t) for t in TOKENS)
    small = IMAGES["square"]  # 56x56: 2x2 rows
    two = layout_ids(2, 2, img, brk, end)
    assert two == [img, img, brk, img, img, end]
    # Placeholders side by side are one image each; an expanded image may sit right before one.
    assert prompts.expand([5, img, img, 6], [small, small], "p")[0] == [5, *two, *two, 6]
    assert prompts.expand([5, *two, img, 6], [small, small], "p")[0] == [5, *two, *two, 6]
    with pytest.raises(InvalidArgumentError, match="not the 2x2 layout"):
        prompts.expand([5, img, img, img, end, 6], [small], "p")
    with pytest.raises(InvalidArgumentError, match="break tokens outside"):
        prompts.expand([5, img, brk, 6], [small], "p")
    with pytest.raises(InvalidArgumentError, match="break tokens outside"):
        prompts.expand([5, end, 6], [], "p")
    with pytest.raises(InvalidArgumentError, match="1 image placeholder.* for 2 image"):
        prompts.expand([5, img, 6], [small, small], "p")
    with pytest.raises(InvalidArgumentError, match="0 image placeholder"):
        prompts.expand([5, 6], [small], "p")
    assert prompts.expand([5, 6], [], "p") == ([5, 6], [])


def test_errors(folder, tokenizer):
    path, config = folder
    prompts = _prompts(folder, tokenizer, limits={"image": 1})
    img = prompts.image_token_id
    with pytest.raises(InvalidArgumentError, match="at most 1"):
        prompts.expand([img, img], [IMAGES["tiny"]] * 2, "p")
    with pytest.raises(InvalidArgumentError, match="image 0: .*no pixels"):
        prompts.expand([img], [_image(4000, 2)], "p")
    (path / "preprocessor_config.json").unlink()
    (path / "processor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(InvalidArgumentError, match="no preprocessor_config.json"):
        _prompts(folder, tokenizer).expand([img], [IMAGES["tiny"]], "p")
    # transformers 5 saves the image processor inside processor_config.json.
    (path / "processor_config.json").write_text(json.dumps({"image_processor": HUB}))
    assert _prompts(folder, tokenizer).image_processor.max_height == 308
    (path / "processor_config.json").write_text(json.dumps({"image_processor": HUB, "spatial_merge_size": 1}))
    with pytest.raises(UnsupportedModelError, match="spatial_merge_size 1 differs"):
        _prompts(folder, tokenizer)
    with pytest.raises(UnsupportedModelError, match="image_token_index 99999"):
        image_prompts_for_model(str(path), {**config, "image_token_index": 99999}, tokenizer)
    (path / "processor_config.json").write_text(json.dumps({"image_break_token": "[ROW]"}))
    with pytest.raises(UnsupportedModelError, match=r"no '\[ROW\]' token"):
        _prompts(folder, tokenizer)
