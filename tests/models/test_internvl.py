"""InternVL (InternVLForConditionalGeneration, the hub's "-hf" layout) against transformers: tiny random checkpoints
(an InternViT of 56-pixel tiles, 7-pixel patches, pixel shuffled to 16 rows a tile; a Qwen2 text side under a
LayerNorm tower with q/k/v bias, a Qwen3 one under an RMSNorm tower with q/k norms), each `<IMG_CONTEXT>` expanded
to exactly the ids InternVLProcessor makes (`<img>`, 16 context tokens per tile, `</img>`), the tiles' pixels equal
to GotOcr2ImageProcessor's (dynamic grids plus the thumbnail), and greedy tokens identical to transformers'
generate on those ids and pixels: one and two images of different tile counts, whole and chunked prefill cutting
tiles across steps; the tower alone; the errors and refused settings."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError, UnsupportedModelError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_internvl import TOKENS_PER_TILE, internvl_processor, make_tiny_internvl

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
IMAGE = "<IMG_CONTEXT>"


def _images():
    """Wide (2x1 grid + thumbnail: 3 tiles), square (1 tile), tall RGBA (1x4 grid + thumbnail: 5 tiles)."""
    rng = np.random.default_rng(0)
    shapes = ((40, 90, 3), (30, 30, 3), (120, 31, 4))
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in shapes]


CASES = [("Hello " + IMAGE + " what is this?", [0]), ("Compare" + IMAGE + "and " + IMAGE + ": which?", [0, 1]),
         ("Just text, no image.", [])]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def internvl(request, tmp_path_factory):
    from transformers import InternVLForConditionalGeneration

    # seed 2: greedy tokens that change with the images for both text sides (not one token repeated)
    folder = make_tiny_internvl(tmp_path_factory.mktemp("internvl") / request.param, text=request.param, seed=2)
    hf = InternVLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_seqs=4)
    return folder, hf, llm


def _processed(folder, text, images):
    return internvl_processor(folder)(text=[text], images=list(images) or None, return_tensors="pt")


def _hf_greedy(hf, inputs):
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked-8"])
def test_greedy_matches_transformers(internvl, budget):
    folder, hf, llm = internvl
    if budget != 2048:  # 8 < 16 rows a tile: every tile is cut across steps
        llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    images = _images()
    prompts = [{"prompt": text, "multi_modal_data": {"image": [images[k] for k in ks]}} if ks else text
               for text, ks in CASES]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, ks), out in zip(CASES, outs, strict=True):
        inputs = _processed(folder, text, [images[k] for k in ks])
        assert out.prompt_token_ids == inputs["input_ids"][0].tolist()  # InternVLProcessor's ids exactly
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, inputs)
    assert_no_leaked_blocks(llm)
    if budget == 2048:  # the images matter: other pixels give other tokens
        swapped = llm.generate({"prompt": CASES[1][0], "multi_modal_data": {"image": images[1::-1]}}, GREEDY,
                               use_tqdm=False)[0]
        assert list(swapped.outputs[0].token_ids) != list(outs[1].outputs[0].token_ids)


def test_tiles_match_the_image_processor(internvl):
    """One item per image over its context tokens; its pixels GotOcr2ImageProcessor's tiles, thumbnail last."""
    folder, _, llm = internvl
    images = _images()
    text = "A" + IMAGE + "B" + IMAGE + "C" + IMAGE
    expanded, items = llm.engine.image_prompts.expand(llm.get_tokenizer().encode(text), images, "test")
    inputs = _processed(folder, text, images)
    assert expanded == inputs["input_ids"][0].tolist()
    assert [item.shape[0] for item in items] == [3, 1, 5]
    pixels = np.concatenate([item.pixel_values().numpy() for item in items])
    np.testing.assert_array_equal(pixels, inputs["pixel_values"].numpy())
    token = llm.engine.image_prompts.image_token_id
    for item in items:
        assert item.length == item.shape[0] * TOKENS_PER_TILE
        assert expanded[item.offset:item.end] == [token] * item.length
        assert expanded[item.offset - 1] == llm.engine.image_prompts.start_id
        assert expanded[item.end] == llm.engine.image_prompts.end_id


def test_tiling_grid_matches_transformers():
    from ferrox.multimodal.internvl_processing import tiling_grid
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    for height, width in [(448, 448), (40, 90), (120, 31), (448, 896), (300, 1000), (1000, 999), (5, 700), (224, 448)]:
        for low, high in [(1, 12), (1, 6), (2, 4), (1, 1)]:
            assert tiling_grid(height, width, 448, low, high) == get_optimal_tiled_canvas(
                (height, width), (448, 448), low, high)


def test_chat_with_an_image_part(internvl):
    folder, hf, llm = internvl
    image = _images()[2]
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert IMAGE + "\nWhat is this?" in chat.prompt
    inputs = _processed(folder, chat.prompt, [image])
    assert chat.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(chat.outputs[0].token_ids) == _hf_greedy(hf, inputs)


@pytest.mark.parametrize("settings", [dict(norm_type="layer_norm", use_mean_pooling=False, layer=-1),
                                      dict(norm_type="rms_norm", use_qk_norm=True, layer=-2)])
def test_tower_matches_transformers(settings):
    """The tower alone against InternVLVisionModel: its final LayerNorm (use_mean_pooling false), an inner layer."""
    from ferrox.models.vision.intern_vit import InternVisionTower
    from transformers import InternVLVisionConfig, InternVLVisionModel

    settings = dict(settings)
    layer = settings.pop("layer")
    config = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=28,
                  patch_size=7, attention_bias=True, **settings)
    torch.manual_seed(0)
    ref = InternVLVisionModel(InternVLVisionConfig(**config)).eval()
    with torch.no_grad():
        for param in ref.parameters():
            param.normal_(0.0, 0.3)
    tower = InternVisionTower(config, dtype=torch.float32, device="cpu", feature_layer=layer)
    tower.load_weights(ref.state_dict().items())
    pixels = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        out = ref(pixel_values=pixels, output_hidden_states=True)
        want = out.last_hidden_state if layer == -1 else out.hidden_states[layer]
        torch.testing.assert_close(tower(pixels), want, rtol=1e-5, atol=1e-5)


def test_errors(internvl):
    _, _, llm = internvl
    images = _images()
    with pytest.raises(InvalidArgumentError, match=r"1 image placeholder\(s\) \('<IMG_CONTEXT>'\) for 2 image"):
        llm.generate({"prompt": "one " + IMAGE + " only", "multi_modal_data": {"image": images[:2]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="0 image placeholder"):
        llm.generate({"prompt": "no placeholder", "multi_modal_data": {"image": images[:1]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"16 image placeholder\(s\)"):  # already expanded: refused
        llm.generate({"prompt": "<img>" + IMAGE * 16 + "</img>", "multi_modal_data": {"image": images[1:2]}}, GREEDY)
    assert_no_leaked_blocks(llm)


def _edited(folder, dest, file, **fields):
    shutil.copytree(folder, dest)
    with open(dest / file, encoding="utf-8") as f:
        config = json.load(f)
    config.update(fields)
    with open(dest / file, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(dest)


@pytest.mark.parametrize(("file", "fields", "match"), [
    ("config.json", {"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy 'full'"),
    ("config.json", {"downsample_ratio": 0.3}, "downsample_ratio 0.3"),
    ("preprocessor_config.json", {"do_center_crop": True}, "do_center_crop"),
    ("preprocessor_config.json", {"size": {"height": 112, "width": 112}}, "size 112 differs"),
])
def test_refused_settings(internvl, tmp_path, file, fields, match):
    folder, _, _ = internvl
    if not folder.endswith("qwen2"):
        pytest.skip("the settings are the tower's and the processor's, not the text model's")
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=_edited(folder, tmp_path / "edited", file, **fields), dtype="float32", device="cpu")


@pytest.mark.gpu
def test_on_cuda_matches_transformers(internvl):
    """The tower over every tile of an image, and chunked prefill cutting tiles, on the device, float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf, _ = internvl
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=8)
    images = _images()
    text, ks = CASES[1]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [images[k] for k in ks]}}, GREEDY,
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _processed(folder, text, [images[k] for k in ks]))
    assert_no_leaked_blocks(llm)
