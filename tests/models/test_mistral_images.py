"""Images in chats under --tokenizer-mode mistral (multimodal/mistral_images.py, loader/mistral_tokenizer.py), as
vLLM serves Mistral Small 3.1 / Ministral 3 with `--tokenizer_mode mistral`: mistral_common encodes the chat and
prepares the images (tekken.json's image settings; no preprocessor_config.json).

A tiny random Mistral 3 over the tiny tekken's vocabulary (tests/helpers/tiny_mistral_vision.py), in Hugging Face's
layout and in Mistral's (params.json only). The prompt ids and each item's pixels, offset, run and [IMG] positions
are those of mistral_common's own encode_chat_completion of the same chat with its images as data URLs (two images
in one message, one moved first by mistral_common, a system prompt, an earlier turn); the engine's greedy answer is
transformers' on mistral_common's ids and pixels, from both folders and over HTTP (OpenAI's image_url, Anthropic's
image block); the errors name their field."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest

pytest.importorskip("mistral_common")
pytest.importorskip("cv2")  # (mistral-common[image]: its encoder resizes with OpenCV)

import torch  # noqa: E402
from ferrox import LLM, SamplingParams  # noqa: E402
from ferrox.engine.input_processor import attach_images, render_chat  # noqa: E402
from ferrox.errors import InvalidArgumentError, UnsupportedModelError  # noqa: E402
from ferrox.loader.config_file import read_model_config  # noqa: E402
from ferrox.multimodal.media import image_hash  # noqa: E402
from ferrox.multimodal.mistral_images import MistralImagePrompts, mistral_image_prompts  # noqa: E402
from ferrox.multimodal.processing import image_prompts_for_model  # noqa: E402
from mistral_common.protocol.instruct.request import ChatCompletionRequest  # noqa: E402
from mistral_common.protocol.instruct.validator import ValidationMode  # noqa: E402
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer as MistralCommon  # noqa: E402
from PIL import Image  # noqa: E402

from tests.helpers.tiny_mistral_vision import BREAK, END, IMAGE, make_tekken_mistral3, write_native  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0)
SMALL_KV = 32 << 20
NATIVE_FLAGS = dict(tokenizer_mode="mistral", config_format="mistral", load_format="mistral")


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(2)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((40, 24, 3), (70, 90, 3),
                                                                                       (9, 30, 3))]


def _data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _chat(image_part) -> list[dict]:
    """The conversation, each image as image_part(k) (k: its index in _images())."""
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"}, image_part(0),
                                         {"type": "text", "text": "with"}, image_part(1)]},
            {"role": "assistant", "content": "Both are noise."},
            # (text then one image: mistral_common puts the image first)
            {"role": "user", "content": [{"type": "text", "text": "And this?"}, image_part(2)]}]


def _pil_chat() -> list[dict]:
    images = _images()
    return _chat(lambda k: {"type": "image_pil", "image_pil": images[k]})


def _url_chat() -> list[dict]:
    urls = [_data_url(image) for image in _images()]
    return _chat(lambda k: {"type": "image_url", "image_url": {"url": urls[k]}})


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral_images")
    hf = make_tekken_mistral3(root / "hf")
    return hf, write_native(hf, root / "native")


@pytest.fixture(scope="module")
def reference(folders):
    """mistral_common's encoding of the chat (its own tokenizer of the file, images from data URLs) and
    transformers' greedy tokens on its ids and pixels."""
    import transformers

    ref = MistralCommon.from_file(f"{folders[0]}/tekken.json", mode=ValidationMode.test)
    encoded = ref.encode_chat_completion(ChatCompletionRequest.from_openai(_url_chat()))
    hf = transformers.Mistral3ForConditionalGeneration.from_pretrained(folders[0], dtype=torch.float32).eval()
    return encoded, _hf_greedy(hf, encoded.tokens, encoded.images), _hf_greedy(hf, encoded.tokens, encoded.images,
                                                                               blank=True)


def _hf_greedy(hf, ids: list[int], images: list[np.ndarray], blank: bool = False) -> list[int]:
    batch = torch.zeros(len(images), 3, max(p.shape[1] for p in images), max(p.shape[2] for p in images))
    for k, p in enumerate(images):
        batch[k, :, :p.shape[1], :p.shape[2]] = 0 if blank else torch.from_numpy(p)
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=batch,
                          image_sizes=torch.tensor([list(p.shape[1:]) for p in images]), max_new_tokens=8,
                          do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def llm(folders):
    return LLM(folders[0], tokenizer_mode="mistral", dtype="float32", kv_cache_memory=SMALL_KV)


def _runs(ids: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each image's [IMG] ... [IMG_END] run."""
    runs, start = [], None
    for i, t in enumerate(ids):
        if t in (IMAGE, BREAK) and start is None:
            start = i
        elif t == END:
            runs.append((start, i + 1 - start))
            start = None
    return runs


def test_chat_ids_and_pixels_are_mistral_commons(folders, reference, llm):
    encoded = reference[0]
    tok = llm.get_tokenizer()
    prompts = llm.engine.image_prompts
    assert isinstance(prompts, MistralImagePrompts) and prompts.placeholder == "[IMG]"
    processed = attach_images(render_chat(tok, _pil_chat(), image_placeholder=prompts.placeholder), prompts,
                              "messages[0]")
    assert processed.prompt_token_ids == encoded.tokens
    assert processed.prompt.count("[IMG]") == 3  # (the rendered text: one [IMG] per image)
    runs = _runs(encoded.tokens)
    assert len(runs) == len(processed.mm_items) == len(encoded.images) == 3
    for item, pixels, (start, length), image in zip(processed.mm_items, encoded.images, runs, _images(), strict=True):
        assert (item.offset, item.length) == (start, length)
        assert item.embed_positions == [k for k in range(length) if encoded.tokens[start + k] == IMAGE]
        assert list(item.shape) == list(pixels.shape) and item.grid == [pixels.shape[1] // 8, pixels.shape[2] // 8]
        assert np.array_equal(np.frombuffer(item.pixels, np.float32).reshape(item.shape), pixels)
        assert item.hash == image_hash(image)  # (the prefix cache's salt)
    # The server's path (serving_images.take_template_images) leaves the image parts where they are, whatever the
    # content format says (mistral_common takes OpenAI's parts).
    from types import SimpleNamespace

    from ferrox.entrypoints.openai.serving_images import take_template_images

    ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok, image_prompts=prompts), model_name="m",
                          options=SimpleNamespace(chat_template_content_format="string"))
    taken = take_template_images(ctx, _url_chat(), tok.get_chat_template())
    assert taken[1]["content"][1] == {"type": "image"} and taken[3]["content"][1] == {"type": "image"}
    # --mm-processor-cache-gb: a repeated image is mistral_common's pixels again, not processed twice.
    config = read_model_config(folders[0], "auto")[0]
    cached = image_prompts_for_model(folders[0], config, tok, processor_cache_gb=0.01)
    for _ in range(2):
        again = attach_images(render_chat(tok, _pil_chat(), image_placeholder="[IMG]"), cached, "messages[0]")
        assert again.prompt_token_ids == encoded.tokens and [i.pixels for i in again.mm_items] == [
            i.pixels for i in processed.mm_items]
    assert cached.processor_cache is not None and cached.processor_cache.stats() == {"mm_cache_queries": 6,
                                                                                     "mm_cache_hits": 3}


def test_engine_matches_transformers(reference, llm):
    encoded, want, blank = reference
    assert want != blank  # (the reference itself answers otherwise without the pixels)
    out = llm.chat(_pil_chat(), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == encoded.tokens
    assert list(out.outputs[0].token_ids) == want
    # An offline token prompt with one [IMG] per image (vLLM's Mistral path takes token prompts).
    image = _images()[2]
    one = llm.generate({"prompt_token_ids": [1, 3, 500, IMAGE, 4], "multi_modal_data": {"image": image}}, GREEDY,
                       use_tqdm=False)[0]
    assert one.prompt_token_ids == [1, 3, 500, *([IMAGE] * 4 + [BREAK]), *([IMAGE] * 4 + [END]), 4]


def test_params_json_folder_answers_an_image_chat(folders, reference):
    """Mistral's layout: params.json's vision_encoder, consolidated.safetensors and tekken.json's image settings
    (no config.json, no preprocessor_config.json), as the Ministral 3 recipe serves it."""
    encoded, want, _ = reference
    native = LLM(folders[1], dtype="float32", kv_cache_memory=SMALL_KV, **NATIVE_FLAGS)
    assert isinstance(native.engine.image_prompts, MistralImagePrompts)
    out = native.chat(_pil_chat(), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == encoded.tokens and list(out.outputs[0].token_ids) == want


def test_server_image_chat(folders, reference):
    """`ferrox serve` of the params.json folder with vLLM's flags: OpenAI's image_url data URLs and Anthropic's
    base64 image blocks answer as transformers; over --limit-mm-per-prompt is a 400 naming messages."""
    from aiohttp.test_utils import TestClient, TestServer
    from ferrox import AsyncLLM
    from ferrox.entrypoints.openai.server import METRICS, build_app

    _, want, _ = reference
    engine = AsyncLLM(model=folders[1], dtype="float32", kv_cache_memory=SMALL_KV, limit_mm_per_prompt={"image": 3},
                      **NATIVE_FLAGS)
    images = _images()

    def anthropic_block(k: int) -> dict:
        return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": _data_url(images[k]).split(",", 1)[1]}}

    async def run() -> list:
        app = build_app(engine, served_model_name="m")
        async with TestClient(TestServer(app)) as client:
            chat = await client.post("/v1/chat/completions", json={"model": "m", "messages": _url_chat(),
                                                                   "max_tokens": 8, "temperature": 0,
                                                                   "return_token_ids": True})
            claude = await client.post("/v1/messages", json={"model": "m", "max_tokens": 8, "temperature": 0,
                                                             "system": "You are terse.",
                                                             "messages": _chat(anthropic_block)[1:]})
            four = _url_chat()
            four[1]["content"].append(dict(four[1]["content"][1]))
            too_many = await client.post("/v1/chat/completions", json={"model": "m", "messages": four, "max_tokens": 1})
            out = [(r.status, await r.json()) for r in (chat, claude, too_many)]
        engine.stat_loggers.remove(app[METRICS])
        return out

    try:
        (chat_status, chat), (claude_status, claude), (too_status, too) = asyncio.run(run())
    finally:
        engine.shutdown()
    assert chat_status == 200, chat
    assert chat["choices"][0]["token_ids"] == want
    assert claude_status == 200, claude
    assert claude["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert too_status == 400 and too["error"]["param"] == "messages" and "--limit-mm-per-prompt" in \
        too["error"]["message"], too


def test_refusals_name_the_field(folders, llm):
    tok = llm.get_tokenizer()
    config = read_model_config(folders[0], "auto")[0]
    limited = image_prompts_for_model(folders[0], config, tok, limits={"image": 2})
    with pytest.raises(InvalidArgumentError, match=r"messages\[0\]: 3 images, at most 2 .*--limit-mm-per-prompt"):
        attach_images(render_chat(tok, _pil_chat(), image_placeholder="[IMG]"), limited, "messages[0]")
    # A text-only model (no image rules) refuses the image part by name.
    assert image_prompts_for_model(folders[0], {"architectures": ["MistralForCausalLM"]}, tok) is None
    with pytest.raises(InvalidArgumentError, match=r"messages\[1\]\.content\[1\]: .* takes no images") as e:
        render_chat(tok, _pil_chat(), image_placeholder=None)
    assert e.value.param == "messages"
    # A text prompt's "[IMG]" is text in this mode (as in vLLM): the hint says what to send instead.
    with pytest.raises(InvalidArgumentError, match=r"0 image placeholder.*encodes a text prompt's '\[IMG\]' as text"):
        llm.generate({"prompt": "a [IMG] b", "multi_modal_data": {"image": _images()[0]}}, GREEDY, use_tqdm=False)
    # tekken.json's image settings must be the model's.
    encoder = tok.image_encoder
    with pytest.raises(UnsupportedModelError, match="image_patch_size 4 x spatial_merge_size 2 differs"):
        mistral_image_prompts(folders[0], {**config, "spatial_merge_size": 1}, encoder, limit=None,
                              allowed_local_media_path=None)
    with pytest.raises(UnsupportedModelError, match="image_token_index is 11"):
        mistral_image_prompts(folders[0], {**config, "image_token_index": 11}, encoder, limit=None,
                              allowed_local_media_path=None)
