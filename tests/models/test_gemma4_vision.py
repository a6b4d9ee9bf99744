"""Gemma 4 with images (Gemma4ForConditionalGeneration's vision tower) against transformers, float32 on CPU: a
tiny random checkpoint (tests/helpers/tiny_gemma4.py: a two-layer tower of 4-pixel patches pooled 3x3, at most 70
soft tokens an image, standardized, its projections clipped; a six-layer language model with E2B's per-layer
embeddings and KV-sharing layers, and use_bidirectional_attention "vision").

- the processor: Gemma4ImageProcessorPil's patches, positions and soft-token counts for images of three shapes
  (and with mm_processor_kwargs max_soft_tokens), Gemma4Processor's token expansion;
- the tower and embedder: transformers' get_image_features, image by image;
- greedy tokens through the real engine (one image, two images of different sizes, a chat, a prompt already
  expanded) equal transformers' generate given mm_token_type_ids, i.e. with an image's tokens attending to each
  other both ways on the sliding layers (a causal-only reference disagrees: the mask is what is tested);
- text-only requests as the text model answers them; audio refused by name, and mm_processor_kwargs other than
  max_soft_tokens and num_frames (videos: test_gemma4_video.py).
On a GPU: the tower at the released shape (Gemma4VisionConfig's defaults) against transformers' on CUDA, and the
tiny model's images through the CUDA engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers import tiny_models
from tests.helpers.tiny_gemma4 import make_tiny_gemma4
from tests.models.conftest import cut_at_eos, hf_greedy

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
# (height, width): 60 and 64 soft tokens, and a long one of 3 x 132 patches (past the tiny tower's 64 positions)
SHAPES = [(30, 100), (70, 70), (7, 200)]


def _images(shapes=SHAPES):
    rng = np.random.default_rng(3)
    return [PIL.fromarray(rng.integers(0, 255, (*shape, 3), dtype=np.uint8)) for shape in shapes]


def _hf_processor(folder, **kwargs):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil.from_pretrained(folder, **kwargs)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = make_tiny_gemma4(tmp_path_factory.mktemp("gemma4v"), images=True, per_layer=True, kv_shared=2,
                              bidirectional="vision", standardize=True, clipped=True, seed=7)
    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=16 << 20)
    yield folder, hf, llm
    llm.engine.shutdown()


def _hf(hf, folder, ids, images, *, both_ways=True):
    """transformers' greedy tokens for a prompt (ids as ferrox expanded them) and its images."""
    pixels = _hf_processor(folder)(images, return_tensors="pt")
    t = torch.tensor([ids])
    extra = {"mm_token_type_ids": (t == hf.config.image_token_id).long()} if both_ways else {}
    with torch.no_grad():
        out = hf.generate(input_ids=t, pixel_values=pixels["pixel_values"],
                          image_position_ids=pixels["image_position_ids"], max_new_tokens=GREEDY.max_tokens,
                          do_sample=False, **extra)
    return out[0, len(ids):].tolist()


def test_processor_matches_transformers(gemma):
    """Patches (the real ones; transformers pads to the budget with (-1, -1) positions), their row-major (col, row)
    positions and the soft-token counts; with max_soft_tokens 140 too. The prompt's expansion is
    Gemma4Processor's: begin-of-image, the soft tokens, end-of-image for each `<|image|>`."""
    from ferrox.multimodal.gemma4_processing import Gemma4ImageProcessor

    folder, _, llm = gemma
    images = _images()
    for kwargs in ({}, {"max_soft_tokens": 140}):
        ours = Gemma4ImageProcessor.from_model_dir(folder, kwargs)
        ref = _hf_processor(folder)(images, return_tensors="np", **kwargs)
        for k, image in enumerate(images):
            patches, (rows, cols) = ours(image)
            n = rows * cols
            assert ours.tokens((rows, cols)) == ref["num_soft_tokens_per_image"][k]
            np.testing.assert_array_equal(patches, ref["pixel_values"][k][:n])
            positions = np.stack([np.arange(n) % cols, np.arange(n) // cols], axis=-1)
            np.testing.assert_array_equal(ref["image_position_ids"][k][:n], positions)
            assert (ref["image_position_ids"][k][n:] == -1).all()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    processor = transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(), image_processor=_hf_processor(folder),
        tokenizer=tokenizer, video_processor=transformers.Gemma4VideoProcessor())
    text = "Two: <|image|> and <|image|> compare"
    want = processor(text=[text], images=[images[:2]], return_tensors="np")["input_ids"][0].tolist()
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": images[:2]}},
                       SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == want


def test_tower_and_embedder_match_get_image_features(gemma):
    folder, hf, llm = gemma
    model = llm.engine.runner.model
    images = _images()[:2]
    pixels = _hf_processor(folder)(images, return_tensors="pt")
    from ferrox.multimodal.gemma4_processing import Gemma4ImageProcessor

    ours = Gemma4ImageProcessor.from_model_dir(folder)
    with torch.no_grad():
        want = hf.model.get_image_features(pixels["pixel_values"], pixels["image_position_ids"]).pooler_output
        for image, rows in zip(images, want, strict=True):
            patches, grid = ours(image)
            got = model.embed_vision(model.vision_tower(torch.from_numpy(patches), grid))
            torch.testing.assert_close(got, rows, atol=2e-5, rtol=1e-5)


def test_greedy_matches_transformers_with_images(gemma):
    """One image, two of different sizes, a chat with an image part, and the two-image prompt given as the ids it
    expands to (already expanded: kept as they are)."""
    folder, hf, llm = gemma
    images = _images()
    cases = [("Hello <|image|> what is this?", [images[0]]),
             ("Two: <|image|> and <|image|> compare", [images[0], images[1]])]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in cases], GREEDY,
                        use_tqdm=False)
    eos = [tiny_models.EOS_TOKEN_ID]
    for (_, imgs), out in zip(cases, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), eos) == _hf(hf, folder, out.prompt_token_ids, imgs)
    # Each image's tokens attending both ways is what transformers does: a causal-only run disagrees.
    assert any(_hf(hf, folder, out.prompt_token_ids, imgs, both_ways=False) != _hf(hf, folder, out.prompt_token_ids,
                                                                                   imgs)
               for (_, imgs), out in zip(cases, outs, strict=True))
    again = llm.generate({"prompt_token_ids": outs[1].prompt_token_ids, "multi_modal_data": {"image": images[:2]}},
                         GREEDY, use_tqdm=False)[0]
    assert again.prompt_token_ids == outs[1].prompt_token_ids
    assert list(again.outputs[0].token_ids) == list(outs[1].outputs[0].token_ids)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": images[1]},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert "<|image|>" in chat.prompt
    assert cut_at_eos(list(chat.outputs[0].token_ids), eos) == _hf(hf, folder, chat.prompt_token_ids, [images[1]])


def test_text_unchanged_and_refusals_by_name(gemma):
    """Text prompts answer as transformers' text-only generate; audio inputs and processor kwargs other than
    max_soft_tokens and num_frames are refused naming them; an image the tower has no positions for is refused
    naming it; max_soft_tokens changes the image's count."""
    folder, hf, llm = gemma
    prompts = [[5, 9, 11], list(range(3, 43))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == hf_greedy(hf, prompt, 8)
    image = _images()[1]
    with pytest.raises(InvalidArgumentError, match=r"multi_modal_data\.audio"):
        llm.generate({"prompt": "<|audio|>", "multi_modal_data": {"audio": np.zeros(16_000)}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="'input_audio'"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}],
                 GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs\.pooling_kernel_size: .*max_soft_tokens"):
        llm.generate({"prompt": "<|image|>", "multi_modal_data": {"image": image},
                      "mm_processor_kwargs": {"pooling_kernel_size": 2}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="max_soft_tokens must be one of"):
        llm.generate({"prompt": "<|image|>", "multi_modal_data": {"image": image},
                      "mm_processor_kwargs": {"max_soft_tokens": 100}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"image 0: grid \[3, 132\]: more than the tower's 64"):
        llm.generate({"prompt": "<|image|>", "multi_modal_data": {"image": _images()[2]}}, GREEDY)
    bigger = llm.generate({"prompt": "<|image|>", "multi_modal_data": {"image": image},
                           "mm_processor_kwargs": {"max_soft_tokens": 140}}, SamplingParams(max_tokens=1),
                          use_tqdm=False)[0]
    want = _hf_processor(folder)([image], max_soft_tokens=140)["num_soft_tokens_per_image"][0]
    assert bigger.prompt_token_ids.count(hf.config.image_token_id) == want > 64


# ---- GPU ----------------------------------------------------------------------------------------------
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def released_shape_tower_matches(device: str, dtype: torch.dtype, max_soft_tokens: int = 280) -> float:
    """Gemma4VisionConfig's defaults (768 wide, 16 layers, 16-pixel patches), random weights, standardized, two images
    of different sizes: ferrox's tower and embedder against transformers' Gemma4VisionModel and
    Gemma4MultimodalEmbedder (into a 1536-wide text model). Returns the largest relative error (norm of the
    difference over the norm of transformers' rows), image by image."""
    from ferrox.models.vision.gemma4_vision import Gemma4VisionEmbedder, Gemma4VisionTower
    from ferrox.multimodal.gemma4_processing import Gemma4ImageProcessor
    from transformers.models.gemma4 import modeling_gemma4 as hf_gemma4
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    torch.manual_seed(0)
    vision = transformers.Gemma4VisionConfig(standardize=True)
    text = transformers.Gemma4TextConfig(hidden_size=1536)
    hf_tower, hf_embedder = hf_gemma4.Gemma4VisionModel(vision), hf_gemma4.Gemma4MultimodalEmbedder(vision, text)
    with torch.no_grad():
        hf_tower.std_bias.normal_(0, 0.5)
        hf_tower.std_scale.uniform_(0.5, 1.5)
    hf_tower, hf_embedder = hf_tower.to(device, dtype).eval(), hf_embedder.to(device, dtype).eval()
    tower = Gemma4VisionTower(vision.to_dict(), dtype=dtype, device=device)
    tower.load_weights((f"model.vision_tower.{n}", t) for n, t in hf_tower.state_dict().items())
    embedder = Gemma4VisionEmbedder(vision.hidden_size, text.hidden_size, vision.rms_norm_eps, dtype, device)
    embedder.embedding_projection.weight.data.copy_(hf_embedder.embedding_projection.weight)
    images = _images([(480, 640), (900, 300)])
    pixels = Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)(images, return_tensors="pt")
    ours = Gemma4ImageProcessor({"max_soft_tokens": max_soft_tokens})
    worst = 0.0
    with torch.no_grad():
        rows = hf_tower(pixels["pixel_values"].to(device), pixels["image_position_ids"].to(device)).last_hidden_state
        want = hf_embedder(rows).float().split(pixels["num_soft_tokens_per_image"].tolist())
        for image, expected in zip(images, want, strict=True):
            patches, grid = ours(image)
            got = embedder(tower(torch.from_numpy(patches).to(device), grid)).float()
            assert got.shape == expected.shape
            worst = max(worst, float((got - expected).norm() / expected.norm()))
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_released_shape_tower_on_cuda_matches_transformers(dtype, bound):
    _needs_cuda()
    assert released_shape_tower_matches("cuda", dtype) < bound


@pytest.mark.gpu
def test_images_on_cuda_match_transformers(gemma):
    """The tiny model's images through the CUDA engine (float32): the image steps' sliding layers leave the Triton
    kernels for the torch attention over the same cache, the full layers and decode steps stay on them."""
    _needs_cuda()
    folder, hf, _ = gemma
    llm = LLM(model=folder, dtype="float32", device="cuda", max_model_len=512)
    try:
        images = _images()[:2]
        out = llm.generate({"prompt": "Two: <|image|> and <|image|> compare", "multi_modal_data": {"image": images}},
                           GREEDY, use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    assert cut_at_eos(list(out.outputs[0].token_ids), [tiny_models.EOS_TOKEN_ID]) == _hf(
        hf, folder, out.prompt_token_ids, images)
