"""CLIP and SigLIP vision towers (models/vision) against transformers' CLIPVisionModel and
SiglipVisionModel: tiny random-weight towers, the same weights loaded into both, every hidden state a
LLaVA or Gemma 3 reads compared; then configs that leave keys out, bfloat16, and the errors."""

from __future__ import annotations

import pytest
import torch
from ferrox.errors import InvalidArgumentError, UnsupportedModelError
from ferrox.models.vision import VisionTower, build_vision_tower
from ferrox.models.vision.clip import CLIPVisionTower
from ferrox.models.vision.siglip import SiglipVisionTower

transformers = pytest.importorskip("transformers")

# Tiny towers: 30 pixels with 14-pixel patches leaves a remainder the convolution drops, as CLIP's does.
TINY = {
    "clip": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
             "num_attention_heads": 4, "image_size": 30, "patch_size": 14},
    "siglip": {"model_type": "siglip_vision_model", "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 4, "num_attention_heads": 4, "image_size": 30, "patch_size": 10},
}
HF_CLASSES = {"clip": ("CLIPVisionConfig", "CLIPVisionModel"), "siglip": ("SiglipVisionConfig", "SiglipVisionModel")}
TOWERS = {"clip": CLIPVisionTower, "siglip": SiglipVisionTower}


def hf_tower(family: str, config: dict, seed: int = 0):
    """A transformers tower with every parameter randomized (LayerNorms included, so that each one's
    weights matter), float32, eval."""
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[family])
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def checkpoint_weights(model) -> dict[str, torch.Tensor]:
    """The state dict under `vision_model.`, as a checkpoint stores it (transformers 5 leaves the prefix
    out of the module's own state dict; 4 kept it)."""
    return {n if n.startswith("vision_model.") else f"vision_model.{n}": t for n, t in model.state_dict().items()}


def hf_post_layernorm(model) -> torch.nn.Module:
    return model.post_layernorm if hasattr(model, "post_layernorm") else model.vision_model.post_layernorm


def pixels(config: dict, batch: int = 2, seed: int = 1) -> torch.Tensor:
    size = config["image_size"]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def ferrox_tower(config: dict, weights: dict[str, torch.Tensor], *, dtype=torch.float32, device="cpu",
                 **kwargs) -> VisionTower:
    tower = build_vision_tower(config, dtype=dtype, device=device, **kwargs)
    tower.load_weights(weights.items())
    return tower.eval()


@pytest.fixture(scope="module", params=["clip", "siglip"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(family):
    """(config, transformers model, checkpoint weights, pixels, transformers' outputs with hidden states)."""
    config = TINY[family]
    model = hf_tower(family, config)
    x = pixels(config)
    with torch.no_grad():
        out = model(pixel_values=x, output_hidden_states=True)
    return config, model, checkpoint_weights(model), x, out


@pytest.mark.parametrize("feature_layer", [-1, -2, 0, 1])
def test_hidden_state_matches_transformers(reference, family, feature_layer):
    config, _, weights, x, out = reference
    tower = ferrox_tower(config, weights, feature_layer=feature_layer)
    with torch.no_grad():
        got = tower(x)
    assert len(out.hidden_states) == config["num_hidden_layers"] + 1
    torch.testing.assert_close(got, out.hidden_states[feature_layer], atol=1e-5, rtol=1e-5)
    built = feature_layer if feature_layer >= 0 else config["num_hidden_layers"] + 1 + feature_layer
    assert len(tower.encoder.layers) == built
    assert tower.post_layernorm is None


def test_post_layernorm_matches_last_hidden_state(reference, family):
    """SigLIP's last_hidden_state has post_layernorm (Gemma 3 reads it); CLIP's does not (transformers
    applies it to the pooled class token only), so there the reference applies it itself."""
    config, model, weights, x, out = reference
    tower = ferrox_tower(config, weights, post_layernorm=True)
    with torch.no_grad():
        got = tower(x)
        want = out.last_hidden_state if family == "siglip" else hf_post_layernorm(model)(out.last_hidden_state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_shape_and_attributes(reference, family):
    config, _, weights, x, _ = reference
    tower = ferrox_tower(config, weights)
    grid = config["image_size"] // config["patch_size"]
    assert tower.num_patches == grid * grid
    assert tower.has_class_token == (family == "clip")
    assert (tower.hidden_size, tower.image_size, tower.patch_size) == (32, 30, config["patch_size"])
    assert tower(x).shape == (2, grid * grid + int(tower.has_class_token), 32)


def test_unprefixed_names_and_float64_pixels(reference):
    """transformers 5's own state dict names (no `vision_model.`) load too; pixels of another float
    dtype are cast to the tower's."""
    config, model, _, x, out = reference
    tower = ferrox_tower(config, {n.removeprefix("vision_model."): t for n, t in model.state_dict().items()})
    with torch.no_grad():
        torch.testing.assert_close(tower(x.double()), out.hidden_states[-1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_defaults_are_transformers(name):
    """The hard-coded defaults are transformers' (ferrox does not import it at run time)."""
    config_cls = getattr(transformers, HF_CLASSES[name][0])
    hf = config_cls().to_dict()
    assert {k: hf[k] for k in TOWERS[name].config_defaults} == dict(TOWERS[name].config_defaults)


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_sparse_config_takes_defaults(name):
    """A hub vision_config writes only what differs from the defaults; the activation and LayerNorm eps
    left out must come out as transformers' (quick_gelu/1e-5 for CLIP, gelu tanh/1e-6 for SigLIP)."""
    config = {"model_type": TOWERS[name].model_type, "hidden_size": 32, "intermediate_size": 40,
              "num_hidden_layers": 2, "num_attention_heads": 4, "image_size": 28, "patch_size": 14}
    model = hf_tower(name, config, seed=3)
    x = pixels(config, seed=4)
    tower = ferrox_tower(config, checkpoint_weights(model))
    with torch.no_grad():
        torch.testing.assert_close(tower(x), model(pixel_values=x, output_hidden_states=True).hidden_states[-1],
                                   atol=1e-5, rtol=1e-5)
    assert tower.encoder.layers[0].layer_norm1.eps == TOWERS[name].config_defaults["layer_norm_eps"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(reference, dtype):
    config, _, weights, x, _ = reference
    with torch.no_grad():
        want = ferrox_tower(config, weights)(x)
        got = ferrox_tower(config, weights, dtype=dtype)(x)
    assert got.dtype == dtype
    assert (got.float() - want).norm() / want.norm() < 2e-2


def test_skipped_tensors_are_not_read(reference):
    """Layers past feature_layer, an unused post_layernorm and SigLIP's head are skipped unread: a
    placeholder standing in for each (it would fail any read) loads without complaint."""
    config, _, weights, _, _ = reference
    last = f"layers.{config['num_hidden_layers'] - 1}."
    skipped = [n for n in weights if last in n or "post_layernorm" in n or n.startswith("vision_model.head.")]
    assert skipped
    ferrox_tower(config, {**weights, **{n: object() for n in skipped}}, feature_layer=-2)


# --- errors -------------------------------------------------------------------------------------------


def test_unknown_model_type():
    with pytest.raises(ValueError, match="vision_config.model_type") as info:
        build_vision_tower({"model_type": "dinov2"}, dtype=torch.float32, device="cpu")
    assert info.value.param == "vision_config.model_type"
    with pytest.raises(UnsupportedModelError, match="vision_config.model_type"):
        build_vision_tower({}, dtype=torch.float32, device="cpu")


def test_unsupported_activation():
    with pytest.raises(ValueError, match="vision_config.hidden_act"):
        build_vision_tower({**TINY["clip"], "hidden_act": "swiglu"}, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("feature_layer", [4, -5, 100])
def test_feature_layer_out_of_range(feature_layer):
    """3 layers: hidden_states has 4 entries, so -4..3 are valid."""
    with pytest.raises(ValueError, match="vision_feature_layer"):
        build_vision_tower(TINY["clip"], dtype=torch.float32, device="cpu", feature_layer=feature_layer)
    for ok in (-4, 3):
        build_vision_tower(TINY["clip"], dtype=torch.float32, device="cpu", feature_layer=ok)


def test_post_layernorm_needs_last_layer():
    with pytest.raises(ValueError, match="post_layernorm"):
        build_vision_tower(TINY["siglip"], dtype=torch.float32, device="cpu", feature_layer=-2, post_layernorm=True)
    build_vision_tower(TINY["siglip"], dtype=torch.float32, device="cpu", feature_layer=4, post_layernorm=True)


def test_unknown_weight_name(reference, family):
    config, _, weights, _, _ = reference
    # Another family's tensor, and a layer the config does not have (not merely one left unbuilt).
    stray = "vision_model.pre_layrnorm.weight" if family == "siglip" else "vision_model.embeddings.patch_embedding.bias"
    beyond = f"vision_model.encoder.layers.{config['num_hidden_layers']}.mlp.fc1.weight"
    for name in (stray, beyond):
        tower = build_vision_tower(config, dtype=torch.float32, device="cpu")
        with pytest.raises(ValueError, match=name.replace(".", r"\.")):
            tower.load_weights([*weights.items(), (name, torch.zeros(32))])


def test_missing_weight(reference):
    config, _, weights, _, _ = reference
    name = "vision_model.encoder.layers.1.self_attn.k_proj.bias"
    tower = build_vision_tower(config, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.1\.self_attn\.qkv_proj\.bias shard k_proj"):
        tower.load_weights((n, t) for n, t in weights.items() if n != name)


def test_wrong_shape(reference):
    config, _, weights, _, _ = reference
    tower = build_vision_tower(config, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="position_embedding.*checkpoint shape"):
        tower.load_weights({**weights, "vision_model.embeddings.position_embedding.weight": torch.zeros(3, 32)}.items())


def test_wrong_image_size(reference):
    config, _, weights, _, _ = reference
    tower = ferrox_tower(config, weights)
    with pytest.raises(InvalidArgumentError, match="30x30") as info:
        tower(torch.zeros(1, 3, 28, 28))
    assert info.value.param == "pixel_values"
    with pytest.raises(ValueError, match="expected"):
        tower(torch.zeros(3, 30, 30))


@pytest.mark.gpu
def test_cuda_bfloat16(reference):
    """The tower on CUDA in bfloat16 (SDPA's fused kernels) against transformers in float32 on CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config, _, weights, x, out = reference
    tower = ferrox_tower(config, weights, dtype=torch.bfloat16, device="cuda", feature_layer=-2)
    with torch.no_grad():
        got = tower(x.cuda()).float().cpu()
    want = out.hidden_states[-2]
    assert (got - want).norm() / want.norm() < 2e-2
