"""multimodal/image_processor.py against transformers' PIL image processors (the "slow" ones), value
for value: the same configs, the same images (landscape, portrait, tiny, square, RGBA, L, P), the
same float32 pixels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from ferrox.errors import ModelLoadError, UnsupportedModelError
from ferrox.multimodal.image_processor import ImageProcessor
from PIL import Image

# transformers 5 names its PIL processors `...Pil` (the plain names are torchvision ones); in 4 the
# plain names were the PIL ones, and convert_to_rgb dropped alpha instead of compositing onto white.
NEW_TRANSFORMERS = hasattr(transformers, "CLIPImageProcessorPil")

LLAVA_15 = {  # llava-hf/llava-1.5-7b-hf
    "image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
GEMMA3 = {  # google/gemma-3-4b-it, nulls included
    "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": None, "do_normalize": True,
    "do_pan_and_scan": None, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
    "image_seq_length": 256, "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor", "resample": 2, "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llava-1.5": LLAVA_15,
    "gemma-3": GEMMA3,
    "clip-defaults-small": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
                            "crop_size": {"height": 32, "width": 32}},
    # A crop larger than the resized image: transformers centres it on zeros first.
    "clip-crop-pads": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 20},
                       "crop_size": {"height": 31, "width": 26}, "resample": 2},
    # Pre-dict configs: an int size (shortest edge) and an int crop (a square).
    "clip-int-sizes": {"image_processor_type": "CLIPImageProcessor", "size": 24, "crop_size": 22},
    "clip-no-resize": {"image_processor_type": "CLIPImageProcessor", "do_resize": False,
                       "crop_size": {"height": 6, "width": 9}},
    "clip-no-rescale": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 16},
                        "crop_size": {"height": 16, "width": 16}, "do_rescale": False,
                        "image_mean": 120.0, "image_std": 60.0, "resample": 1},
    "clip-raw": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 16},
                 "crop_size": {"height": 12, "width": 16}, "do_rescale": False, "do_normalize": False,
                 "resample": 0},
    "clip-rescale-only": {"image_processor_type": "CLIPImageProcessorFast", "size": {"shortest_edge": 16},
                          "crop_size": {"height": 16, "width": 16}, "do_normalize": False,
                          "rescale_factor": 1 / 127.5},
    "siglip": {"image_processor_type": "SiglipImageProcessor", "size": {"height": 24, "width": 20}},
    "siglip-bilinear": {"image_processor_type": "SiglipImageProcessor", "size": {"height": 16, "width": 16},
                        "resample": 2, "image_mean": [0.1, 0.2, 0.3], "image_std": [0.9, 0.8, 0.7]},
    "gemma-3-small": {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28},
                      "do_pan_and_scan": False},
    "llava-pad": {"image_processor_type": "LlavaImageProcessor", "do_pad": True,
                  "size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32}},
    "llava-pad-off": {"image_processor_type": "LlavaImageProcessor", "size": {"shortest_edge": 24},
                      "crop_size": {"height": 24, "width": 24}},
}


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(0)

    def pixels(width: int, height: int, channels: int) -> np.ndarray:
        return rng.integers(0, 256, (height, width, channels), dtype=np.uint8)

    images = [Image.fromarray(pixels(w, h, 3), "RGB") for w, h in ((40, 30), (30, 50), (5, 7), (33, 33), (97, 13))]
    images.append(Image.fromarray(pixels(20, 15, 1)[..., 0], "L"))
    if NEW_TRANSFORMERS:  # alpha composited onto white: transformers 5's convert_to_rgb, and vLLM's
        images.append(Image.fromarray(pixels(18, 26, 4), "RGBA"))
        palette = Image.fromarray(pixels(12, 9, 1)[..., 0], "L").convert("P")
        palette.putpalette(list(rng.integers(0, 256, 768)))
        palette.info["transparency"] = 7
        images.append(palette)
    return images


IMAGES = _images()


def _reference(config: dict[str, Any]) -> Any:
    """transformers' PIL processor for `config`, as AutoImageProcessor would pass the file's fields."""
    kind = config["image_processor_type"].removesuffix("Fast")
    cls = getattr(transformers, f"{kind}Pil", None) or getattr(transformers, kind)
    return cls(**{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")})


@pytest.mark.parametrize("name", CONFIGS)
def test_matches_transformers(name: str):
    config = CONFIGS[name]
    processor = ImageProcessor(config)
    images = IMAGES[:2] if name in ("llava-1.5", "gemma-3") else IMAGES  # big outputs: two are enough
    got = torch.from_numpy(processor(images))
    want = _reference(config)(images, return_tensors="pt").pixel_values
    assert got.dtype == torch.float32 and got.shape == (len(images), 3, *processor.output_size)
    if not (config.get("do_rescale", True) or config.get("do_normalize", True)):
        want = want.to(torch.float32)  # transformers leaves never-rescaled pixels uint8; ferrox is float32 always
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same arithmetic: equal to the bit


def test_output_sizes():
    assert ImageProcessor(LLAVA_15).output_size == (336, 336)
    assert ImageProcessor(GEMMA3).output_size == (896, 896)
    assert ImageProcessor(CONFIGS["siglip"]).output_size == (24, 20)
    assert ImageProcessor(CONFIGS["clip-int-sizes"]).output_size == (22, 22)
    assert ImageProcessor({"image_processor_type": "CLIPImageProcessor"}).output_size == (224, 224)
    assert ImageProcessor({"image_processor_type": "Gemma3ImageProcessor"}).output_size == (224, 224)
    assert ImageProcessor(LLAVA_15)([]).shape == (0, 3, 336, 336)


def test_rgb_with_a_transparent_colour_key_turns_white():
    image = Image.new("RGB", (4, 4), (10, 20, 30))
    image.info["transparency"] = (10, 20, 30)
    config = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 4, "width": 4},
              "do_normalize": False}
    assert torch.equal(torch.from_numpy(ImageProcessor(config)([image])), torch.ones(1, 3, 4, 4))


def test_pan_and_scan_is_refused():
    with pytest.raises(UnsupportedModelError, match="preprocessor_config.json: do_pan_and_scan"):
        ImageProcessor({**GEMMA3, "do_pan_and_scan": True})


def test_unknown_or_missing_type_is_refused():
    with pytest.raises(UnsupportedModelError,
                       match="preprocessor_config.json: image_processor_type 'Qwen2VLImageProcessor'"):
        ImageProcessor({"image_processor_type": "Qwen2VLImageProcessor"})
    with pytest.raises(UnsupportedModelError, match="preprocessor_config.json has no image_processor_type"):
        ImageProcessor({"size": {"height": 4, "width": 4}})


def test_old_and_suffixed_type_names():
    for name in ("CLIPFeatureExtractor", "CLIPImageProcessorFast", "CLIPImageProcessorPil"):
        assert ImageProcessor({"image_processor_type": name}).kind == "CLIPImageProcessor"
    assert ImageProcessor({"feature_extractor_type": "CLIPFeatureExtractor"}).kind == "CLIPImageProcessor"


def test_variable_output_sizes_are_refused():
    with pytest.raises(UnsupportedModelError, match="size must give height and width"):
        ImageProcessor({"image_processor_type": "SiglipImageProcessor", "size": {"shortest_edge": 30}})
    with pytest.raises(UnsupportedModelError, match="do_resize false"):
        ImageProcessor({"image_processor_type": "SiglipImageProcessor", "do_resize": False})
    with pytest.raises(UnsupportedModelError, match="size must be"):
        ImageProcessor({"image_processor_type": "CLIPImageProcessor", "size": {"longest_edge": 30}})


@pytest.mark.parametrize(("field", "value"), [
    ("resample", 9), ("do_resize", "yes"), ("rescale_factor", "1/255"), ("image_mean", [0.5, 0.5]),
    ("image_std", ["a", 1, 1]), ("size", {"height": 0, "width": 3}), ("crop_size", {"height": 2.5, "width": 3}),
])
def test_bad_fields_are_named(field: str, value: Any):
    with pytest.raises(ModelLoadError, match=f"preprocessor_config.json: {field}"):
        ImageProcessor({"image_processor_type": "CLIPImageProcessor", field: value})


def test_from_model_dir(tmp_path: Path):
    assert ImageProcessor.from_model_dir(tmp_path) is None
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(LLAVA_15))
    processor = ImageProcessor.from_model_dir(str(tmp_path))
    assert processor is not None and processor.output_size == (336, 336)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse .*preprocessor_config.json"):
        ImageProcessor.from_model_dir(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        ImageProcessor.from_model_dir(tmp_path)
