"""Qwen3.5 / Qwen3.6 with images and videos (models/qwen3_5_vl.py: Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration) against transformers on the tiny multimodal checkpoints
(tests/helpers/tiny_qwen3_5.py: the hybrid Gated DeltaNet / gated-attention text model, partial rotary of 8 of 16
dims under interleaved mrope_section [2, 1, 1], Qwen3-VL's three-block tower without DeepStack).

The real engine (ferrox.LLM), dense and MoE: chats carrying images beside a text-only one, and a prompt with a
video and an image, greedy tokens and their logprobs equal to transformers' forward over the same ids, patches
and grids; a chunked prefill (5-token budget) cutting the images and the video; the rotary positions against
get_rope_index; the partial interleaved rotary against transformers' own on ferrox's reordered q/k rows;
--language-model-only serving the text of the multimodal checkpoint and refusing images."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers import tiny_qwen3_5
from tests.helpers.tiny_qwen3_vl import PLACEHOLDER, VIDEO_PLACEHOLDER

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

FAMILIES = {"dense": (tiny_qwen3_5.make_tiny_qwen3_5_multimodal, "Qwen3_5ForConditionalGeneration"),
            "moe": (tiny_qwen3_5.make_tiny_qwen3_5_moe_multimodal, "Qwen3_5MoeForConditionalGeneration")}
GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)


def _images():
    rng = np.random.default_rng(2)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((60, 90, 3), (100, 50, 3),
                                                                                     (30, 30, 3))]


def _clip(count: int, seed: int) -> tuple[np.ndarray, dict]:
    """`count` 40x70 frames picked from a 3x longer 6 fps video, with vLLM's metadata."""
    frames = np.random.default_rng(seed).integers(0, 255, (count, 40, 70, 3), dtype=np.uint8)
    return frames, {"fps": 6.0, "total_num_frames": 3 * count, "frames_indices": list(range(0, 3 * count, 3))}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, transformers model), built once each when first asked for."""
    built: dict[str, tuple[str, object]] = {}

    def get(name: str):
        if name not in built:
            make, arch = FAMILIES[name]
            folder = make(tmp_path_factory.mktemp(f"qwen3_5_vl_{name}"))
            built[name] = folder, getattr(transformers, arch).from_pretrained(folder, dtype=torch.float32).eval()
        return built[name]

    return get


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, checkpoints):
    """(name, folder, transformers model, an engine with room for whole prompts)."""
    folder, hf = checkpoints(request.param)
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=8 << 20, max_num_batched_tokens=2048)
    yield request.param, folder, hf, llm
    llm.engine.shutdown()


def _processed(llm, prompt, data):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": data}),
                         llm.engine.image_prompts, "prompt")


def _hf_inputs(hf, processed, ids: list[int]) -> dict:
    """transformers' inputs for `ids` (ferrox's expanded prompt, then its output): the items' patches and grids."""
    tensor = torch.tensor([ids])
    inputs: dict = dict(input_ids=tensor)
    items = processed.mm_items or []
    if not items:
        return inputs
    kinds = (tensor == hf.config.image_token_id).int() + 2 * (tensor == hf.config.video_token_id).int()
    kinds[0, len(processed.prompt_token_ids):] = 0
    inputs["mm_token_type_ids"] = kinds
    for modality, pixels, grids in (("image", "pixel_values", "image_grid_thw"),
                                    ("video", "pixel_values_videos", "video_grid_thw")):
        mine = [it for it in items if it.modality == modality]
        if mine:
            inputs[pixels] = torch.cat([it.pixel_values() for it in mine])
            inputs[grids] = torch.tensor([it.grid for it in mine])
    return inputs


def _assert_matches_transformers(hf, llm, prompt: str, data: dict, out) -> None:
    """The output's greedy tokens are transformers' argmax over prompt + output (one forward: its positions from
    get_rope_index over the whole sequence), each token's logprob within 1e-4 of transformers'."""
    processed = _processed(llm, prompt, data)
    assert out.prompt_token_ids == processed.prompt_token_ids
    sample = out.outputs[0]
    ids = list(sample.token_ids)
    pads = (hf.config.image_token_id, hf.config.video_token_id)
    assert not set(ids) & set(pads), "an output token is a vision pad: transformers would count it as one"
    hf.model.rope_deltas = None  # (kept between calls by transformers)
    with torch.inference_mode():
        logits = hf(**_hf_inputs(hf, processed, processed.prompt_token_ids + ids)).logits[0]
    ref = torch.log_softmax(logits.double(), dim=-1)[len(processed.prompt_token_ids) - 1:-1]
    assert ids == ref.argmax(-1).tolist()
    for i, (tok, lps) in enumerate(zip(ids, sample.logprobs, strict=True)):
        assert math.isclose(lps[tok].logprob, ref[i, tok].item(), abs_tol=1e-4)


def test_chats_with_images_and_text_match_transformers(family):
    """One image, two of different sizes, and a text-only conversation, in one batch."""
    from ferrox.models.qwen3_5_vl import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    name, _, hf, llm = family
    model = llm.engine.runner.model
    assert type(model) is (Qwen3_5ForConditionalGeneration if name == "dense" else Qwen3_5MoeForConditionalGeneration)
    assert model.deepstack_layers == 0
    img = _images()
    cases = [[img[0]], [img[1], img[2]], []]
    chats = [[{"role": "user", "content": [*({"type": "image_pil", "image_pil": i} for i in c),
                                           {"type": "text", "text": "What is this?" if c else "Hello there"}]}]
             for c in cases]
    outs = llm.chat(chats, GREEDY, use_tqdm=False)
    for images, out in zip(cases, outs, strict=True):
        assert out.prompt.count(PLACEHOLDER) == len(images)
        _assert_matches_transformers(hf, llm, out.prompt, {"image": images} if images else {}, out)
    assert_no_leaked_blocks(llm)


def test_video_beside_an_image_matches_transformers(family):
    """A video (each temporal patch after its `<t seconds>` text, one rotary block per frame) then an image."""
    _, _, hf, llm = family
    prompt = "See " + VIDEO_PLACEHOLDER + " then " + PLACEHOLDER + " ok"
    data = {"video": _clip(4, seed=1), "image": _images()[2]}
    out = llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)[0]
    assert [it.modality for it in _processed(llm, prompt, data).mm_items] == ["video", "image"]
    _assert_matches_transformers(hf, llm, prompt, data, out)


def test_chunked_prefill_across_images_and_a_video(family):
    """A 5-token budget cuts every image and the video across steps (the tower's rows a few at a time, the
    recurrent states carried between the chunks)."""
    _, folder, hf, _ = family
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=8 << 20, max_num_batched_tokens=5)
    try:
        img = _images()
        cases = [("Hello " + PLACEHOLDER + " and " + PLACEHOLDER + " What is this?", {"image": [img[0], img[1]]}),
                 ("Hi " + VIDEO_PLACEHOLDER + " what?", {"video": _clip(4, seed=6)}),
                 ("No images here at all", {})]
        outs = llm.generate([{"prompt": p, "multi_modal_data": d} for p, d in cases], GREEDY, use_tqdm=False)
        for (prompt, data), out in zip(cases, outs, strict=True):
            _assert_matches_transformers(hf, llm, prompt, data, out)
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()


def test_rotary_positions_match_get_rope_index(family):
    from ferrox.worker.mrope import mrope_positions

    _, _, hf, llm = family
    processed = _processed(llm, "a " + VIDEO_PLACEHOLDER + " b " + PLACEHOLDER + " c",
                           {"image": [_images()[1]], "video": [_clip(4, seed=5)]})
    inputs = _hf_inputs(hf, processed, processed.prompt_token_ids)
    want, delta = hf.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"],
                                          inputs["video_grid_thw"].clone())
    got, got_delta = mrope_positions(len(processed.prompt_token_ids), processed.mm_items, 2)
    assert np.array_equal(got, want[:, 0].numpy()) and got_delta == int(delta)


def test_partial_interleaved_rotary_matches_transformers(checkpoints):
    """transformers' Qwen3.5 text rotary (interleaved mrope cos / sin over the 8 rotated dims, apply_rotary_pos_emb
    passing the other 8 through) on q / k, against ferrox's MRotaryEmbedding (rotary_dim 8, from the checkpoint's
    spec) on the same heads in ferrox's row order (partial_rotary_order); rope_rows (the Triton kernels' layout)
    holds the same angles. Contiguous sections, or the full-head rotary, would differ."""
    from ferrox.layers.ops import apply_rotary
    from ferrox.layers.rotary import MRotaryEmbedding, RotaryEmbedding, partial_rotary_order
    from ferrox.loader.model_config import spec_from_hf_config
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    folder, hf = checkpoints("dense")
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        spec = spec_from_hf_config(json.load(f), "config.json")
    rope = RotaryEmbedding.for_spec(spec, "cpu")
    assert isinstance(rope, MRotaryEmbedding) and spec.rotary_dim == 8 and spec.hf_config["mrope_section"] == [2, 1, 1]
    torch.manual_seed(0)
    positions = torch.randint(0, 50, (3, 1, 12))
    q, k = torch.randn(1, 4, 12, 16), torch.randn(1, 2, 12, 16)
    cos, sin = hf.model.language_model.rotary_emb(q, positions)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    order = partial_rotary_order(16, 8)
    got_cos, got_sin = rope.cos_sin(positions[:, 0], torch.float32)
    for x, want in ((q, want_q), (k, want_k)):
        ours = x[0].transpose(0, 1)[..., order]  # [T, heads, 16] in ferrox's rows
        torch.testing.assert_close(apply_rotary(ours, got_cos, got_sin), want[0].transpose(0, 1)[..., order])
    rows = rope.rope_rows(positions[:, 0])
    torch.testing.assert_close(rows, torch.cat([got_cos[:, 0, :8], got_sin[:, 0, :8]], dim=-1))
    contiguous = MRotaryEmbedding(16, spec.rope_theta, None, "cpu", section=[2, 1, 1], rotary_dim=8)
    assert not torch.allclose(contiguous.cos_sin(positions[:, 0], torch.float32)[0], got_cos)
    # Text positions ([T], or three equal rows) are the plain partial rotary.
    plain = RotaryEmbedding(16, spec.rope_theta, None, "cpu", rotary_dim=8)
    same = positions[0, 0]
    torch.testing.assert_close(rope.cos_sin(same.expand(3, -1), torch.float32)[0], plain.cos_sin(same, torch.float32)[0])
    with pytest.raises(Exception, match=r"adding up to the rotary dims / 2 .*\(4\)"):
        MRotaryEmbedding(16, 1e7, None, section=[4, 2, 2], rotary_dim=8)


def test_language_model_only_serves_the_text(checkpoints):
    """--language-model-only: the tower is not built; text prompts still match transformers, images are refused."""
    folder, hf = checkpoints("dense")
    llm = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=8 << 20, language_model_only=True)
    try:
        assert not getattr(llm.engine.runner.model, "takes_images", True)
        out = llm.generate({"prompt": "Hello there, how are you"}, GREEDY, use_tqdm=False)[0]
        _assert_matches_transformers(hf, llm, "Hello there, how are you", {}, out)
        with pytest.raises(Exception, match="image"):
            llm.generate({"prompt": "Hi " + PLACEHOLDER, "multi_modal_data": {"image": _images()[0]}}, GREEDY)
    finally:
        llm.engine.shutdown()
