"""InternVL's remote-code layout (InternVLChatModel, the hub's OpenGVLab repos without "-HF") against transformers'
native InternVL over the same weights: tests/helpers/tiny_internvl.py writes a tiny native checkpoint and, by
hand, the remote layout of its tensors (fused q/k/v, the remote names, llm_config / vision_config, no
preprocessor_config.json). ferrox serves the remote folder; the reference is transformers' generate on the native
one, fed the ids and pixels this file makes itself: the remote code's published tiling (dynamic_preprocess) and
vLLM's `<image>` expansion, written here independently of ferrox's. One and two images of different tile
counts, a text-only prompt, whole and chunked prefill; llm.chat's `<image>` placement; the refused settings."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError, UnsupportedModelError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_internvl import TILE, TOKENS_PER_TILE, make_tiny_internvl_chat

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
MAX_TILES = 6  # the tiny config's max_dynamic_patch (min 1, use_thumbnail, dynamic_image_size)


# --- the reference: the remote code's preprocessing, from its published algorithm -------------------------------

def ref_grid(width, height, tile, low, high):
    """find_closest_aspect_ratio over the remote code's target ratios: (cols, rows)."""
    ratios = sorted({(i, j) for n in range(low, high + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if low <= i * j <= high}, key=lambda r: r[0] * r[1])
    best, best_diff = (1, 1), float("inf")
    for cols, rows in ratios:
        diff = abs(width / height - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def ref_tiles(image, tile=TILE, low=1, high=MAX_TILES, thumbnail=True):
    """dynamic_preprocess then ToTensor and ImageNet Normalize: float32 [tiles, 3, tile, tile]."""
    image = image.convert("RGB")
    cols, rows = ref_grid(image.width, image.height, tile, low, high)
    resized = image.resize((tile * cols, tile * rows), PIL.Resampling.BICUBIC)
    crops = []
    for k in range(cols * rows):
        left, top = (k % cols) * tile, (k // cols) * tile
        crops.append(resized.crop((left, top, left + tile, top + tile)))
    if thumbnail and len(crops) > 1:
        crops.append(image.resize((tile, tile), PIL.Resampling.BICUBIC))
    mean = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    tensors = [(torch.from_numpy(np.array(c)).permute(2, 0, 1).float().div(255) - mean) / std for c in crops]
    return torch.stack(tensors)


def ref_inputs(native, text, images):
    """vLLM's expansion: each `<image>` in the text, in order, becomes `<img>`, the image's context tokens and
    `</img>`; the text then tokenized. -> (ids, pixels or None)."""
    from transformers import PreTrainedTokenizerFast

    tiles = [ref_tiles(image) for image in images]
    for t in tiles:
        text = text.replace("<image>", "<img>" + "<IMG_CONTEXT>" * (len(t) * TOKENS_PER_TILE) + "</img>", 1)
    ids = PreTrainedTokenizerFast.from_pretrained(native)(text)["input_ids"]
    return ids, (torch.cat(tiles) if tiles else None)


def _images():
    """Wide (2x1 grid + thumbnail: 3 tiles), square (1 tile), tall greyscale (1x4 grid + thumbnail: 5 tiles)."""
    rng = np.random.default_rng(0)
    return [PIL.fromarray(rng.integers(0, 255, (40, 90, 3), dtype=np.uint8)),
            PIL.fromarray(rng.integers(0, 255, (30, 30, 3), dtype=np.uint8)),
            PIL.fromarray(rng.integers(0, 255, (120, 31), dtype=np.uint8))]


CASES = [("Hello <image> what is this?", [0]), ("Compare<image>and <image>: which?", [0, 1]),
         ("Just text, no image.", [])]


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def internvl_chat(request, tmp_path_factory):
    from transformers import InternVLForConditionalGeneration

    # seed 2: greedy tokens that change with the images for both text sides (test_internvl.py's)
    native, remote = make_tiny_internvl_chat(tmp_path_factory.mktemp("internvl_chat") / request.param,
                                             text=request.param, seed=2, max_dynamic_patch=MAX_TILES)
    hf = InternVLForConditionalGeneration.from_pretrained(native, dtype=torch.float32).eval()
    llm = LLM(model=remote, dtype="float32", device="cpu", max_num_seqs=4)
    return native, remote, hf, llm


def _hf_greedy(hf, ids, pixels):
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    if pixels is not None:
        inputs["pixel_values"] = pixels
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked-8"])
def test_greedy_matches_transformers(internvl_chat, budget):
    native, remote, hf, llm = internvl_chat
    if budget != 2048:  # 8 < 16 rows a tile: every tile is cut across steps
        llm = LLM(model=remote, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    images = _images()
    prompts = [{"prompt": text, "multi_modal_data": {"image": [images[k] for k in ks]}} if ks else text
               for text, ks in CASES]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for (text, ks), out in zip(CASES, outs, strict=True):
        ids, pixels = ref_inputs(native, text, [images[k] for k in ks])
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, ids, pixels)
    assert_no_leaked_blocks(llm)
    if budget == 2048:  # the images matter: other pixels give other tokens
        swapped = llm.generate({"prompt": CASES[1][0], "multi_modal_data": {"image": images[1::-1]}}, GREEDY,
                               use_tqdm=False)[0]
        assert list(swapped.outputs[0].token_ids) != list(outs[1].outputs[0].token_ids)


def test_tiles_match_the_reference(internvl_chat):
    """One item per image over its context tokens, between `<img>` and `</img>`; its pixels the reference's."""
    native, _, _, llm = internvl_chat
    images = _images()
    text = "A <image> B<image>C\n<image>"
    prompts = llm.engine.image_prompts
    expanded, items = prompts.expand(llm.get_tokenizer().encode(text), images, "test")
    ids, pixels = ref_inputs(native, text, images)
    assert expanded == ids
    assert [item.shape[0] for item in items] == [3, 1, 5]
    np.testing.assert_array_equal(np.concatenate([item.pixel_values().numpy() for item in items]), pixels.numpy())
    for item in items:
        assert item.length == item.shape[0] * TOKENS_PER_TILE
        assert expanded[item.offset:item.end] == [prompts.image_token_id] * item.length
        assert (expanded[item.offset - 1], expanded[item.end]) == (prompts.start_id, prompts.end_id)


def test_tiling_grid_matches_the_reference():
    """ferrox's grid choice against the reference's, exact ties included (a 2:1 image on a 1x2 / 2x1 choice
    without the 1x1 grid; square images, where 1x1, 2x2, 3x3 tie and the area decides)."""
    from ferrox.multimodal.internvl_chat_processing import candidate_grids, closest_grid

    sizes = [(448, 448), (90, 40), (31, 120), (896, 448), (1000, 300), (999, 1000), (700, 5), (500, 400),
             (1000, 1000), (1800, 1800), (300, 900), (224, 448), (260, 100)]
    for width, height in sizes:  # (260, 100) on 5 tiles: 1x5 and 5x1 tie, the candidates' order decides
        for low, high in [(1, 12), (1, 6), (2, 4), (2, 3), (1, 1), (4, 9), (5, 5)]:
            grids = candidate_grids(low, high)
            assert closest_grid(width, height, 448, grids) == ref_grid(width, height, 448, low, high), \
                (width, height, low, high)


def test_image_features_match_transformers(internvl_chat):
    """The tower, pixel shuffle and projector from the remote names against transformers' get_image_features
    over the native ones, closely (greedy tokens alone would miss, say, a q/k norm's eps)."""
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    _, remote, hf, _ = internvl_chat
    source = resolve_model(remote)
    model = load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")
    pixels = torch.cat([ref_tiles(image) for image in _images()])
    with torch.no_grad():
        want = hf.model.get_image_features(pixel_values=pixels)
        want = getattr(want, "pooler_output", want)
        torch.testing.assert_close(model.embed_multimodal(pixels), want, rtol=1e-5, atol=1e-5)


def test_single_tile_without_dynamic_image_size(internvl_chat, tmp_path):
    """dynamic_image_size false: one tile, the image resized to it (no grid, no thumbnail)."""
    from ferrox.multimodal.internvl_chat_processing import InternVLChatImageProcessor

    _, remote, _, _ = internvl_chat
    with open(f"{remote}/config.json", encoding="utf-8") as f:
        config = {**json.load(f), "dynamic_image_size": False}
    tiles = InternVLChatImageProcessor(config)(_images()[0])
    np.testing.assert_array_equal(tiles, ref_tiles(_images()[0], low=1, high=1).numpy())
    assert tiles.shape == (1, 3, TILE, TILE)


def test_chat_with_an_image_part(internvl_chat):
    """The string-content chat template gets "<image>\\n" before the text, as vLLM renders it."""
    native, _, hf, llm = internvl_chat
    image = _images()[2]
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user\n<image>\nWhat is this?<|im_end|>" in chat.prompt
    ids, pixels = ref_inputs(native, chat.prompt, [image])
    assert chat.prompt_token_ids == ids
    assert list(chat.outputs[0].token_ids) == _hf_greedy(hf, ids, pixels)


def test_errors(internvl_chat):
    _, _, _, llm = internvl_chat
    images = _images()
    with pytest.raises(InvalidArgumentError, match=r"1 image placeholder\(s\) \('<image>'\) for 2 image"):
        llm.generate({"prompt": "one <image> only", "multi_modal_data": {"image": images[:2]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="holds <IMG_CONTEXT> tokens itself"):
        llm.generate({"prompt": "<img>" + "<IMG_CONTEXT>" * 16 + "</img>", "multi_modal_data": {"image": images[1:2]}},
                     GREEDY)
    assert_no_leaked_blocks(llm)


def _edited(folder, dest, **fields):
    shutil.copytree(folder, dest)
    with open(dest / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    for key, value in fields.items():
        if key == "llm_config":
            config[key].update(value)
        else:
            config[key] = value
    with open(dest / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(dest)


@pytest.mark.parametrize(("fields", "match"), [
    ({"ps_version": "v1"}, "ps_version 'v1'"),
    ({"llm_config": {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"]}},
     "llm_config.model_type 'internlm2'"),
    ({"force_image_size": 112}, "force_image_size 112 differs"),
    ({"use_llm_lora": 16}, "use_llm_lora 16"),
    ({"downsample_ratio": 0.3}, "downsample_ratio 0.3"),
])
def test_refused_settings(internvl_chat, tmp_path, fields, match):
    _, remote, _, _ = internvl_chat
    if not remote.split("/")[-2].endswith("qwen2"):
        pytest.skip("the settings are the layout's, not the text model's")
    with pytest.raises(UnsupportedModelError, match=match):
        LLM(model=_edited(remote, tmp_path / "edited", **fields), dtype="float32", device="cpu")


@pytest.mark.gpu
def test_on_cuda_matches_transformers(internvl_chat):
    """The tower over every tile of two images, and chunked prefill cutting tiles, on the device, float32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    native, remote, hf, _ = internvl_chat
    llm = LLM(model=remote, dtype="float32", device="cuda", max_num_batched_tokens=8)
    images = _images()
    text, ks = CASES[1]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": [images[k] for k in ks]}}, GREEDY,
                       use_tqdm=False)[0]
    ids, pixels = ref_inputs(native, text, [images[k] for k in ks])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, ids, pixels)
    assert_no_leaked_blocks(llm)
