"""LLaVA (LlavaForConditionalGeneration) against transformers: tiny random checkpoints (a CLIP tower over a
Llama, llava-1.5's layout; a SigLIP tower over a Qwen2, the "full" strategy), real images through the
model folder's preprocessor_config.json, greedy tokens identical to transformers' generate over the same
expanded prompt and pixels; one and two images a prompt, an image cut across chunked-prefill steps, the
prefix cache kept apart by image, LLM.chat's image parts in both template content formats, and the
errors (placeholder count, text-only model, limit_mm_per_prompt, beam search, a bad url)."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.helpers.tiny_models import make_tiny_llama, make_tiny_llava

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _images():
    rng = np.random.default_rng(0)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((70, 90, 3), (50, 40, 3))]


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module", params=[("llama", "clip", 2048), ("qwen2", "siglip", 8)],
                ids=["llama-clip", "qwen2-siglip-chunked"])
def llava(request, tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    text, vision, budget = request.param
    folder = make_tiny_llava(tmp_path_factory.mktemp(f"llava-{text}"), text=text, vision=vision)
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    # budget 8: each 16-token image is computed across several chunked-prefill steps.
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    return folder, hf, llm


def _hf_greedy(hf, folder, ids, images, n=8):
    from ferrox.multimodal.image_processor import ImageProcessor

    pixels = torch.from_numpy(ImageProcessor.from_model_dir(folder)(images))
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def test_greedy_matches_transformers(llava):
    folder, hf, llm = llava
    img, img2 = _images()
    # The same text with different images, in one batch and again alone: the prefix cache must keep
    # them apart (their token ids are the same), and a repeat must reuse nothing wrongly.
    cases = [[img], [img2], [img, img2], [img2, img]]
    prompts = [{"prompt": "Hello " + " and ".join("<image>" for _ in imgs) + "\nWhat is this?",
                "multi_modal_data": {"image": imgs if len(imgs) > 1 else imgs[0]}} for imgs in cases]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    token_id = hf.config.image_token_id
    for imgs, out in zip(cases, outs, strict=True):
        ids = out.prompt_token_ids
        assert sum(t == token_id for t in ids) == 16 * len(imgs)  # 4x4 patches each
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, folder, ids, imgs)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids
    again = llm.generate(prompts[1], GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_chat_image_parts_both_content_formats(llava):
    folder, hf, llm = llava
    img, _ = _images()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}},
                                             {"type": "text", "text": "What is this?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>user\n<image>\nWhat is this?")  # the template wrote it
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, folder, out.prompt_token_ids, [img])
    # A string-content template: the placeholder on its own line before the text (vLLM's rule).
    pil_part = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_pil", "image_pil": img}]}]
    same = llm.chat(pil_part, GREEDY, use_tqdm=False, chat_template_content_format="string")[0]
    assert same.prompt == out.prompt
    assert same.outputs[0].token_ids == out.outputs[0].token_ids


def test_errors_name_the_field(llava, tmp_path):
    folder, _, llm = llava
    img, img2 = _images()
    with pytest.raises(InvalidArgumentError, match=r"1 image placeholder\(s\).*for 2 image"):
        llm.generate({"prompt": "<image> two?", "multi_modal_data": {"image": [img, img2]}}, GREEDY)
    # Side by side: two placeholders (a template may write them so), or one image already expanded (16).
    two = llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": [img, img2]}}, GREEDY,
                       use_tqdm=False)[0]
    spaced = llm.generate({"prompt": "<image>\n<image>", "multi_modal_data": {"image": [img, img2]}}, GREEDY,
                          use_tqdm=False)[0]
    assert len(two.prompt_token_ids) == len(spaced.prompt_token_ids) - 1
    expanded = llm.generate({"prompt": "<image>" * 16, "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    single = llm.generate({"prompt": "<image>", "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)
    assert expanded[0].prompt_token_ids == single[0].prompt_token_ids
    assert expanded[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    with pytest.raises(InvalidArgumentError, match="multi_modal_data.video"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"video": [img]}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match="beam search takes no images"):
        from ferrox.beam_search import BeamSearchParams

        llm.beam_search([{"prompt": "<image>", "multi_modal_data": {"image": img}}],
                        BeamSearchParams(beam_width=2, max_tokens=2))
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,!!"}}]}]
    with pytest.raises(InvalidArgumentError, match="image 0"):
        llm.chat(bad, GREEDY, use_tqdm=False)
    local = tmp_path / "cat.png"
    img.save(local)
    with pytest.raises(InvalidArgumentError, match="allowed-local-media-path"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": f"file://{local}"}}, GREEDY)
    # Nothing was left behind: a good request still runs.
    assert llm.generate({"prompt": "<image>", "multi_modal_data": {"image": img}}, GREEDY, use_tqdm=False)


def test_limit_and_local_files(tmp_path):
    folder = make_tiny_llava(tmp_path / "llava")
    img, _ = _images()
    img.save(tmp_path / "media.png")
    llm = LLM(model=folder, dtype="float32", device="cpu", limit_mm_per_prompt={"image": 1},
              allowed_local_media_path=str(tmp_path))
    with pytest.raises(InvalidArgumentError, match="at most 1"):
        llm.generate({"prompt": "<image><image>", "multi_modal_data": {"image": [img, img]}}, GREEDY)
    by_file = llm.generate({"prompt": "<image>", "multi_modal_data": {"image": str(tmp_path / "media.png")}},
                           GREEDY, use_tqdm=False)[0]
    by_object = llm.generate({"prompt": "<image>", "multi_modal_data": {"image": img.convert("RGB")}},
                             GREEDY, use_tqdm=False)[0]
    assert by_file.outputs[0].token_ids == by_object.outputs[0].token_ids


def test_text_only_model_refuses_images(tmp_path):
    llm = LLM(model=make_tiny_llama(tmp_path / "llama"), dtype="float32", device="cpu")
    img, _ = _images()
    with pytest.raises(InvalidArgumentError, match="takes no images"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": img}}, GREEDY)
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\].content\[0\].*takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(img)}}]}],
                 GREEDY)


@pytest.mark.gpu
def test_llava_on_cuda_matches_transformers(tmp_path):
    """The tower, projector and image rows on the device (bf16 weights would round differently from the float32
    reference: float32 here, so the tokens must agree)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import LlavaForConditionalGeneration

    folder = make_tiny_llava(tmp_path / "llava")
    hf = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=24)
    img, img2 = _images()
    out = llm.generate({"prompt": "<image> and <image>?", "multi_modal_data": {"image": [img, img2]}}, GREEDY,
                       use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, folder, out.prompt_token_ids, [img, img2])


def test_abort_mid_image_frees_blocks_and_embeddings(tmp_path):
    """An image request aborted while its image is half computed (budget 8 of its 16 rows): its KV blocks and
    its kept embeddings are gone, and the next request with the same text but another image is its own."""
    from ferrox.engine.input_processor import attach_images, process_prompt
    from ferrox.engine.protocol import EngineCoreRequest

    from tests.engine.test_batch_invariance import assert_no_leaked_blocks

    folder = make_tiny_llava(tmp_path / "llava")
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=8)
    engine = llm.engine
    img, img2 = _images()
    processed = attach_images(process_prompt(llm.get_tokenizer(), {"prompt": "Look: <image> ok?",
                                                                    "multi_modal_data": {"image": img}}),
                              engine.image_prompts, "prompt")
    engine.add_request(EngineCoreRequest("half", processed.prompt_token_ids, GREEDY, mm_inputs=processed.mm_items))
    for _ in range(2):  # the text, then the image's first rows
        engine.step()
    assert engine.runner.images._encoded  # the image was encoded and is being consumed
    engine.abort_requests(["half"])
    assert not engine.runner.images and not engine.runner.images._encoded
    assert_no_leaked_blocks(llm)
    alone = llm.generate({"prompt": "Look: <image> ok?", "multi_modal_data": {"image": img2}}, GREEDY, use_tqdm=False)
    fresh = LLM(model=folder, dtype="float32", device="cpu").generate(
        {"prompt": "Look: <image> ok?", "multi_modal_data": {"image": img2}}, GREEDY, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_disable_chunked_mm_input_computes_each_image_whole(llava):
    """--disable-chunked-mm-input (vLLM's): an image's 16 tokens are never cut over chunked-prefill steps, so a
    budget of 8 cannot hold it (refused naming max_num_batched_tokens) and one of 24 computes it in one step, with
    the tokens of the chunked engine and of transformers."""
    folder, hf, llm = llava
    if "qwen2" not in str(folder):
        pytest.skip("one family is enough: the rule is the scheduler's")
    img, _ = _images()
    prompt = {"prompt": "Hello <image>\nWhat is this?", "multi_modal_data": {"image": img}}
    cut = llm.generate(prompt, GREEDY, use_tqdm=False)[0]  # (the fixture's budget 8 cuts the image)
    small = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=8, disable_chunked_mm_input=True)
    with pytest.raises(InvalidArgumentError, match="max_num_batched_tokens"):
        small.generate(prompt, GREEDY, use_tqdm=False)
    small.engine.shutdown()
    whole = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=24, disable_chunked_mm_input=True)
    out = whole.generate(prompt, GREEDY, use_tqdm=False)[0]
    whole.engine.shutdown()
    assert out.outputs[0].token_ids == cut.outputs[0].token_ids
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, folder, out.prompt_token_ids, [img])
