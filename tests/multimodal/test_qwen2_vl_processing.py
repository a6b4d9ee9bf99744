"""multimodal/qwen2_vl_processing.py against transformers' Qwen2VLImageProcessorPil and Qwen2VLProcessor:
the same configs and images (aspect ratios, tiny ones smart_resize enlarges, large ones it shrinks, RGBA,
L, P), bit-equal float32 patches and equal grids; prompts expanded to the same ids; then prompts that hold
expanded images already, and the errors."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from ferrox.errors import InvalidArgumentError, ModelLoadError, UnsupportedModelError
from ferrox.multimodal.processing import image_prompts_for_model
from ferrox.multimodal.qwen2_vl_processing import QwenVLImageProcessor, QwenVLImagePrompts, smart_resize
from PIL import Image

pytest.importorskip("transformers")
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: E402

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen2-VL-7B-Instruct's file, max_pixels lowered so that a test image is shrunk too.
    "hub": {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 28 * 28 * 40,
            "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "image_mean": MEAN, "image_std": STD},
    # As transformers 5 saves it.
    "size": {"image_processor_type": "Qwen2VLImageProcessorPil", "size": {"shortest_edge": 28 * 28 * 8,
             "longest_edge": 28 * 28 * 24}, "resample": 2},
    "defaults": {"image_processor_type": "Qwen2VLImageProcessor"},
    "other-patches": {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 8, "merge_size": 3,
                      "temporal_patch_size": 1, "min_pixels": 24 * 24, "max_pixels": 24 * 24 * 30,
                      "image_mean": 0.5, "image_std": [0.5, 0.25, 0.5], "do_rescale": False},
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
    "landscape": _image(500, 300), "portrait": _image(181, 403, seed=1), "square": _image(224, 224, seed=2),
    "tiny": _image(10, 10, seed=3), "thin": _image(5, 90, seed=4), "large": _image(1201, 799, seed=5),
    "rgba": _image(64, 48, "RGBA", seed=6), "grey": _image(71, 33, "L", seed=7), "palette": _image(90, 60, "P"),
    "near-200": _image(400, 2, seed=8),
}


@pytest.mark.parametrize("image", IMAGES.values(), ids=IMAGES.keys())
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_patches_match_transformers(config, image):
    expected = Qwen2VLImageProcessorPil(**config)(image)
    patches, grid = QwenVLImageProcessor(config)(image)
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    assert patches.dtype == np.float32 and patches.flags.c_contiguous
    np.testing.assert_array_equal(patches, expected["pixel_values"])


def test_without_resize():
    config = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": False}
    image = _image(84, 56)
    expected = Qwen2VLImageProcessorPil(**config)(image)
    patches, grid = QwenVLImageProcessor(config)(image)
    assert [list(grid)] == expected["image_grid_thw"].tolist() == [[1, 4, 6]]
    np.testing.assert_array_equal(patches, expected["pixel_values"])
    with pytest.raises(ValueError, match="multiples of 28"):
        QwenVLImageProcessor(config)(_image(80, 56))


def test_smart_resize():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    for height, width in [(1, 1), (3, 500), (27, 29), (42, 42), (70, 70), (1000, 3000), (4321, 1234), (14, 14)]:
        for bounds in [(3136, 1003520), (28 * 28 * 4, 28 * 28 * 16), (784, 784)]:
            if max(height, width) / min(height, width) > 200:
                with pytest.raises(ValueError, match="aspect ratio"):
                    smart_resize(height, width, 28, *bounds)
                continue
            assert smart_resize(height, width, 28, *bounds) == hf_smart_resize(height, width, 28, *bounds)


def test_pixel_bounds_forms():
    """size {shortest_edge, longest_edge}; top-level min_pixels / max_pixels override it; transformers
    4.45's size {min_pixels, max_pixels} is read too (transformers 5 refuses it)."""
    assert (QwenVLImageProcessor({}).min_pixels, QwenVLImageProcessor({}).max_pixels) == (3136, 28 * 28 * 1280)
    both = QwenVLImageProcessor({"size": {"shortest_edge": 100, "longest_edge": 5000}, "max_pixels": 4000})
    assert (both.min_pixels, both.max_pixels) == (100, 4000)
    old = QwenVLImageProcessor({"size": {"min_pixels": 200, "max_pixels": 6000}})
    assert (old.min_pixels, old.max_pixels) == (200, 6000)
    with pytest.raises(UnsupportedModelError, match="shortest_edge, longest_edge"):
        QwenVLImageProcessor({"size": {"shortest_edge": 100}})
    with pytest.raises(ModelLoadError, match="more than max_pixels"):
        QwenVLImageProcessor({"min_pixels": 5000, "max_pixels": 4000})
    with pytest.raises(UnsupportedModelError, match="not a Qwen2-VL one"):
        QwenVLImageProcessor({"image_processor_type": "CLIPImageProcessor"})
    with pytest.raises(ModelLoadError, match="do_rescale must be true or false"):
        QwenVLImageProcessor({"do_rescale": "yes"})


# --- prompts ---------------------------------------------------------------------------------------------------

TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import AddedToken

    from tests.helpers.tiny_models import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in TOKENS])
    return tok


@pytest.fixture
def folder(tmp_path, tokenizer):
    """A model folder: config.json's image tokens and vision config, the hub's preprocessor_config.json."""
    start, end, pad = (tokenizer.token_to_id(t) for t in TOKENS)
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "image_token_id": pad,
              "vision_start_token_id": start, "vision_end_token_id": end,
              "vision_config": {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(CONFIGS["hub"]))
    return tmp_path, config


def _prompts(folder, tokenizer, **kwargs) -> QwenVLImagePrompts:
    path, config = folder
    prompts = image_prompts_for_model(str(path), config, tokenizer, **kwargs)
    assert isinstance(prompts, QwenVLImagePrompts)
    return prompts


def test_expansion_matches_transformers(folder, tokenizer):
    """Qwen2VLProcessor's text rule (its own replace_image_token; the processor itself cannot be built
    without torchvision's video processor), then the tokenizer: the same ids as ferrox's expansion."""
    from transformers import Qwen2VLProcessor

    hf_images = Qwen2VLImageProcessorPil(**CONFIGS["hub"])
    prompts = _prompts(folder, tokenizer)
    assert prompts.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    images = [IMAGES["landscape"], IMAGES["tiny"], IMAGES["large"]]
    text = f"Compare {prompts.placeholder} and\n{prompts.placeholder}{prompts.placeholder} please."
    expected = hf_images(images)
    rule = SimpleNamespace(image_processor=hf_images, image_token="<|image_pad|>")
    pieces = text.split("<|image_pad|>")
    hf_text = pieces[0] + "".join(Qwen2VLProcessor.replace_image_token(rule, expected, k) + piece  # type: ignore[arg-type]
                                  for k, piece in enumerate(pieces[1:]))
    ids, items = prompts.expand(tokenizer.encode(text).ids, images, "prompt")
    assert ids == tokenizer.encode(hf_text).ids
    grids = expected["image_grid_thw"].tolist()
    assert [item.grid for item in items] == grids
    assert [item.length for item in items] == [t * h * w // 4 for t, h, w in grids]
    assert len({item.length for item in items}) == 3  # each image its own count
    pad = prompts.image_token_id
    assert all(ids[i.offset - 1] != pad and set(ids[i.offset:i.end]) == {pad} and ids[i.end] != pad for i in items)
    np.testing.assert_array_equal(np.concatenate([i.pixel_values().numpy() for i in items]),
                                  expected["pixel_values"])

    # The expanded prompt again, images already in place: the same ids, the same items.
    again, items2 = prompts.expand(ids, images, "prompt")
    assert again == ids and [(i.offset, i.length, i.grid) for i in items2] == [(i.offset, i.length, i.grid)
                                                                                 for i in items]


def test_runs_read_one_way(folder, tokenizer):
    """Placeholders side by side are one image each; a run of an image's own length is that image already
    expanded, mixed freely; a run that reads two ways, or none, is refused by name."""
    prompts = _prompts(folder, tokenizer)
    pad = prompts.image_token_id
    small, wide = IMAGES["tiny"], IMAGES["landscape"]
    n = prompts.image_processor.tokens(prompts.image_processor(wide)[1])
    assert prompts.image_processor.tokens(prompts.image_processor(small)[1]) == 4 and n > 4
    assert [item.length for item in prompts.expand([5, pad, 6, pad, 7], [small, wide], "p")[1]] == [4, n]
    ids, items = prompts.expand([5, pad, pad, 6], [small, wide], "p")
    assert [(i.offset, i.length) for i in items] == [(1, 4), (5, n)] and ids == [5, *[pad] * (4 + n), 6]
    assert prompts.expand([5, *[pad] * 4, 6, pad], [small, wide], "p")[0] == ids[:5] + [6] + [pad] * n
    with pytest.raises(InvalidArgumentError, match="do not match 2 image"):
        prompts.expand([5, pad, 6], [small, wide], "p")
    with pytest.raises(InvalidArgumentError, match="do not match 1 image"):
        prompts.expand([5, pad, pad, pad, 6], [wide], "p")
    with pytest.raises(InvalidArgumentError, match="do not match 0 image"):
        prompts.expand([5, pad, 6], [], "p")
    # Four tokens: four 4-token images side by side, or one of them expanded; the other run decides.
    ids, items = prompts.expand([*[pad] * 4, 9, pad, pad, pad], [small] * 4, "p")
    assert [(i.offset, i.length) for i in items] == [(0, 4), (5, 4), (9, 4), (13, 4)]
    with pytest.raises(InvalidArgumentError, match="can be read two ways"):
        prompts.expand([*[pad] * 4, 9, *[pad] * 4], [small] * 5, "p")
    assert prompts.expand([5, 6], [], "p") == ([5, 6], [])


def test_errors(folder, tokenizer):
    path, config = folder
    prompts = _prompts(folder, tokenizer, limits={"image": 1})
    pad = prompts.image_token_id
    with pytest.raises(InvalidArgumentError, match="at most 1"):
        prompts.expand([pad, pad], [IMAGES["tiny"]] * 2, "p")
    with pytest.raises(InvalidArgumentError, match="image 0: .*aspect ratio"):
        prompts.expand([pad], [_image(403, 2)], "p")
    (path / "preprocessor_config.json").unlink()
    with pytest.raises(InvalidArgumentError, match="no preprocessor_config.json"):
        _prompts(folder, tokenizer).expand([pad], [IMAGES["tiny"]], "p")
    # transformers 5 saves the image processor inside processor_config.json.
    (path / "processor_config.json").write_text(json.dumps({"image_processor": CONFIGS["hub"]}))
    assert _prompts(folder, tokenizer).image_processor.max_pixels == 28 * 28 * 40
    (path / "preprocessor_config.json").write_text(json.dumps({**CONFIGS["hub"], "merge_size": 3}))
    with pytest.raises(UnsupportedModelError, match="merge_size 3 differs from the vision tower's spatial_merge"):
        _prompts(folder, tokenizer)
    with pytest.raises(UnsupportedModelError, match="image_token_id 99999"):
        image_prompts_for_model(str(path), {**config, "image_token_id": 99999}, tokenizer)
