"""models/vision/qwen2_vl_vision.py against transformers' Qwen2-VL and Qwen2.5-VL vision transformers: tiny
random-weight towers, the same weights in both, the merged rows compared for one image and for several of
different grids (2.5: windows that cut the image unevenly, full-attention blocks between them); then
bfloat16, the weight names of saved checkpoints, and the errors."""

from __future__ import annotations

import pytest
import torch
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.vision.qwen2_vl_vision import QwenVisionTower

transformers = pytest.importorskip("transformers")

TINY = {
    "qwen2_vl": {"depth": 4, "embed_dim": 32, "hidden_size": 48, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
                 "spatial_merge_size": 2, "temporal_patch_size": 2},
    "qwen2_5_vl": {"depth": 4, "hidden_size": 32, "out_hidden_size": 48, "intermediate_size": 40, "num_heads": 2,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                   "fullatt_block_indexes": [1, 3]},
}
# (t, h, w) patch grids: window_size 56 is 2x2 merged squares, so 6x10 and 10x6 leave partial windows.
GRIDS = {"one": [[1, 4, 6]], "two": [[1, 6, 10], [1, 10, 6]], "three": [[1, 2, 2], [2, 4, 4], [1, 8, 4]]}


def hf_visual(version: str, config: dict, seed: int = 0):
    """transformers' vision transformer, every parameter randomized (norms included), float32, eval."""
    if version == "qwen2_vl":
        from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig as Config
        from transformers.models.qwen2_vl.modeling_qwen2_vl import (
            Qwen2VisionTransformerPretrainedModel as Model,
        )
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Model,
        )
    torch.manual_seed(seed)
    model = Model(Config(**config)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def inputs(grids: list[list[int]], patch_dim: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), patch_dim, generator=torch.Generator().manual_seed(seed))
    return pixels, grid


def ferrox_tower(version: str, config: dict, weights, *, dtype=torch.float32, device="cpu") -> QwenVisionTower:
    tower = QwenVisionTower(config, version=version, dtype=dtype, device=device)
    tower.load_weights(weights)
    return tower.eval()


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
@pytest.mark.parametrize("version", TINY)
def test_matches_transformers(version, grids):
    config = TINY[version]
    hf = hf_visual(version, config)
    tower = ferrox_tower(version, config, hf.state_dict().items())
    pixels, grid = inputs(grids, 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid).pooler_output
        got = tower(pixels, grid)
    assert got.shape == (int(grid.prod(-1).sum()) // 4, 48)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert (tower.spatial_merge_size, tower.patch_size, tower.temporal_patch_size, tower.out_hidden_size) == \
        (2, 14, 2, 48)


def test_windows_matter():
    """Window attention is not full attention: with every block full, 2.5's rows change."""
    config = TINY["qwen2_5_vl"]
    hf = hf_visual("qwen2_5_vl", config)
    weights = hf.state_dict()
    windowed = ferrox_tower("qwen2_5_vl", config, weights.items())
    full = ferrox_tower("qwen2_5_vl", {**config, "fullatt_block_indexes": [0, 1, 2, 3]}, weights.items())
    pixels, grid = inputs(GRIDS["two"], 3 * 2 * 14 * 14)
    with torch.no_grad():
        assert not torch.allclose(windowed(pixels, grid), full(pixels, grid), atol=1e-3)


@pytest.mark.parametrize("version", TINY)
def test_bfloat16_is_close(version):
    config = TINY[version]
    hf = hf_visual(version, config)
    tower = ferrox_tower(version, config, hf.state_dict().items(), dtype=torch.bfloat16)
    pixels, grid = inputs(GRIDS["two"], 3 * 2 * 14 * 14)
    with torch.no_grad():
        expected = hf(pixels, grid_thw=grid).pooler_output
        got = tower(pixels, grid)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("version", TINY)
def test_cuda_matches_cpu(version):
    config = TINY[version]
    hf = hf_visual(version, config)
    cpu = ferrox_tower(version, config, hf.state_dict().items())
    gpu = ferrox_tower(version, config, hf.state_dict().items(), device="cuda")
    pixels, grid = inputs(GRIDS["three"], 3 * 2 * 14 * 14)
    with torch.no_grad():
        torch.testing.assert_close(gpu(pixels.cuda(), grid.cuda()).cpu(), cpu(pixels, grid), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("version", TINY)
def test_saved_checkpoint_names(version, tmp_path):
    """A saved checkpoint holds the tower under `visual.` (transformers 5 reverts its `model.visual.`
    module names on save); both prefixes load."""
    from safetensors.torch import load_file

    if version == "qwen2_vl":
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    text = {"hidden_size": 48, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 64, "bos_token_id": 1, "eos_token_id": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2]}}
    model = model_cls(config_cls(text_config=text, vision_config=TINY[version]))
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    visual = {n: t for n, t in saved.items() if n.startswith("visual.")}
    assert visual and not any(n.startswith("model.visual.") for n in saved)
    in_memory = {n: t for n, t in model.state_dict().items() if n.startswith("model.visual.")}
    assert {n.removeprefix("model.") for n in in_memory} == set(visual)
    pixels, grid = inputs(GRIDS["one"], 3 * 2 * 14 * 14)
    with torch.no_grad():
        a = ferrox_tower(version, TINY[version], visual.items())(pixels, grid)
        b = ferrox_tower(version, TINY[version], in_memory.items())(pixels, grid)
        expected = model.model.visual(pixels, grid_thw=grid).pooler_output
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b, expected, atol=1e-5, rtol=1e-5)


def test_defaults_and_aliases():
    """Keys a config leaves out take transformers' defaults; hub configs' `in_chans` is in_channels."""
    tower = QwenVisionTower({"depth": 1, "in_chans": 3}, version="qwen2_vl", dtype=torch.float32, device="meta")
    assert (tower.width, tower.out_hidden_size, tower.num_heads, tower.patch_dim) == (1280, 3584, 16, 1176)
    tower = QwenVisionTower({"depth": 1, "hidden_size": 1280}, version="qwen2_5_vl", dtype=torch.float32,
                            device="meta")
    assert (tower.width, tower.out_hidden_size, tower.window, sorted(tower.full_attention_blocks)) == \
        (1280, 3584, 4, [7, 15, 23, 31])


def test_errors():
    config = TINY["qwen2_vl"]
    hf = hf_visual("qwen2_vl", config)
    weights = hf.state_dict()
    with pytest.raises(UnsupportedModelError, match="does not know: blocks.9.attn.qkv.weight"):
        ferrox_tower("qwen2_vl", config, [*weights.items(), ("blocks.9.attn.qkv.weight", torch.zeros(1))])
    with pytest.raises(UnsupportedModelError, match="missing 1 tensor.*merger.mlp.2.bias"):
        ferrox_tower("qwen2_vl", config, [(n, t) for n, t in weights.items() if n != "merger.mlp.2.bias"])
    with pytest.raises(ValueError, match="checkpoint shape"):
        ferrox_tower("qwen2_vl", {**config, "embed_dim": 64}, weights.items())
    with pytest.raises(UnsupportedModelError, match="version"):
        QwenVisionTower(config, version="qwen3_vl", dtype=torch.float32, device="cpu")
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        QwenVisionTower({**config, "hidden_act": "relu6"}, version="qwen2_vl", dtype=torch.float32, device="cpu")
    tower = ferrox_tower("qwen2_vl", config, weights.items())
    pixels, grid = inputs([[1, 4, 4]], 3 * 2 * 14 * 14)
    with pytest.raises(InvalidArgumentError, match="pixel_values"):
        tower(pixels[:-1], grid)
    with pytest.raises(InvalidArgumentError, match="grid_thw"):
        tower(pixels[:12], torch.tensor([[1, 4, 3]]))
