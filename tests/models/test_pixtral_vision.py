"""models/vision/pixtral_vision.py against transformers' PixtralVisionModel: random weights, one image and two of
different sizes (transformers pads them to one batch and masks attention to each image), the hidden state at
several feature layers, float32 within 1e-5; then the load and input errors."""

from __future__ import annotations

import pytest
import torch
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.vision.pixtral_vision import PixtralVisionTower

transformers = pytest.importorskip("transformers")

CONFIG = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2, patch_size=4,
              hidden_act="silu", image_size=64, rope_parameters={"rope_type": "axial", "rope_theta": 1000.0})


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = transformers.PixtralVisionModel(transformers.PixtralVisionConfig(**CONFIG)).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
            else:
                param.uniform_(0.5, 1.5)
    return model


def _tower(hf, feature_layer: int = -1) -> PixtralVisionTower:
    tower = PixtralVisionTower(hf.config.to_dict(), dtype=torch.float32, device="cpu", feature_layer=feature_layer)
    tower.load_weights(hf.state_dict().items())
    return tower


def _reference(hf, images):
    height = max(int(x.shape[1]) for x in images)
    width = max(int(x.shape[2]) for x in images)
    batch = torch.zeros(len(images), 3, height, width)
    for k, x in enumerate(images):
        batch[k, :, :x.shape[1], :x.shape[2]] = x
    with torch.no_grad():
        return hf(batch, image_sizes=[tuple(x.shape[1:]) for x in images], output_hidden_states=True).hidden_states


@pytest.mark.parametrize("sizes", [[(16, 24)], [(16, 24), (28, 8)]], ids=["one", "two"])
@pytest.mark.parametrize("feature_layer", [-1, -2, 0, 2])
def test_matches_transformers(hf, sizes, feature_layer):
    torch.manual_seed(1)
    images = [torch.randn(3, h, w) for h, w in sizes]
    want = _reference(hf, images)[feature_layer][0]
    with torch.no_grad():
        got = _tower(hf, feature_layer)(images)
    assert got.shape == want.shape == (sum(h * w for h, w in sizes) // 16, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_images_attend_within_themselves(hf):
    """An image's rows are the same alone and beside another."""
    torch.manual_seed(2)
    a, b = torch.randn(3, 12, 20), torch.randn(3, 8, 8)
    tower = _tower(hf)
    with torch.no_grad():
        torch.testing.assert_close(tower([a, b])[:15], tower([a]), atol=1e-6, rtol=1e-6)


def test_errors(hf):
    tower = _tower(hf)
    with pytest.raises(InvalidArgumentError, match="multiples of 4"):
        tower([torch.randn(3, 10, 8)])
    with pytest.raises(InvalidArgumentError, match=r"\[3, H, W\]"):
        tower([torch.randn(1, 8, 8)])
    weights = dict(hf.state_dict())
    with pytest.raises(UnsupportedModelError, match="missing 1 tensor"):
        _tower_from({k: v for k, v in weights.items() if k != "ln_pre.weight"})
    with pytest.raises(UnsupportedModelError, match="does not know: extra.weight"):
        _tower_from({**weights, "extra.weight": torch.zeros(1)})
    with pytest.raises(UnsupportedModelError, match="checkpoint shape"):
        _tower_from({**weights, "ln_pre.weight": torch.zeros(7)})
    with pytest.raises(UnsupportedModelError, match="vision_feature_layer 4"):
        PixtralVisionTower(CONFIG, dtype=torch.float32, device="cpu", feature_layer=4)
    with pytest.raises(UnsupportedModelError, match="hidden_act 'tanh'"):
        PixtralVisionTower({**CONFIG, "hidden_act": "tanh"}, dtype=torch.float32, device="cpu")


def _tower_from(weights) -> None:
    PixtralVisionTower(CONFIG, dtype=torch.float32, device="cpu").load_weights(weights.items())
