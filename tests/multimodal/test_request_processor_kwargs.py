"""A request's own mm_processor_kwargs (vLLM's per-prompt / per-request field): Qwen-VL's min_pixels / max_pixels
for that request only, exactly what the server-wide --mm-processor-kwargs of the same value gives; the same keys
refused by name (mm_processor_kwargs.<key>) offline and as a 400 on the server; the prefix cache keeping the
KV of one image at two resolutions apart."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_models import make_tiny_llava, make_tiny_qwen2_vl
from tests.server.server_proc import ServerProcess
from tests.server.server_proc import post_json as _post

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = PLACEHOLDER + " What is this?"  # the image first: its first KV blocks hold nothing but its tokens
SMALL = {"max_pixels": 56 * 56}  # the folder's is 28 * 28 * 16: the image below then has 16 tokens, here 4


def _image():
    return PIL.fromarray(np.random.default_rng(5).integers(0, 255, (112, 112, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = make_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))
    return folder, LLM(model=folder, dtype="float32", device="cpu", block_size=4)


def _rules(folder, processor_kwargs=None):
    """The prompt rules an engine started with --mm-processor-kwargs builds (multimodal/processing.py)."""
    from ferrox.multimodal.processing import image_prompts_for_model

    with open(f"{folder}/config.json", encoding="utf-8") as f:
        config = json.load(f)
    return image_prompts_for_model(folder, config, _tokenizer(folder), processor_kwargs=processor_kwargs)


def _tokenizer(folder):
    from ferrox.loader.source import resolve_model
    from ferrox.loader.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(folder))


def _attach(rules, tokenizer, prompt, media, kwargs=None):
    from ferrox.engine.input_processor import attach_images, process_prompt

    return attach_images(process_prompt(tokenizer, {"prompt": prompt, "multi_modal_data": media,
                                                    **({"mm_processor_kwargs": kwargs} if kwargs else {})}),
                         rules, "prompt")


def test_request_kwargs_give_the_server_flags_tokens_and_pixels(qwen):
    folder, llm = qwen
    tok, image = llm.get_tokenizer(), _image()
    shared, flagged = llm.engine.image_prompts, _rules(folder, SMALL)
    want = _attach(flagged, tok, PROMPT, {"image": image})
    got = _attach(shared, tok, PROMPT, {"image": image}, SMALL)
    default = _attach(shared, tok, PROMPT, {"image": image})
    assert got.prompt_token_ids == want.prompt_token_ids
    assert len(got.prompt_token_ids) < len(default.prompt_token_ids)
    assert got.mm_items[0].grid == want.mm_items[0].grid and got.mm_items[0].pixels == want.mm_items[0].pixels
    assert got.mm_items[0].hash == want.mm_items[0].hash != default.mm_items[0].hash
    assert shared.image_processor.max_pixels == 28 * 28 * 16  # the shared processor is left as it was
    assert shared.with_processor_kwargs(SMALL) is shared.with_processor_kwargs(dict(SMALL))  # derived once

    # One batch, one prompt with the kwargs: only that prompt changes; the offline dict form and LLM.chat agree.
    plain = {"prompt": PROMPT, "multi_modal_data": {"image": image}}
    small, full = llm.generate([{**plain, "mm_processor_kwargs": SMALL}, plain], GREEDY, use_tqdm=False)
    assert small.prompt_token_ids == want.prompt_token_ids and full.prompt_token_ids == default.prompt_token_ids
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                         {"type": "text", "text": "What is this?"}]}]
    chatted = llm.chat(chat, GREEDY, use_tqdm=False, mm_processor_kwargs=SMALL)[0]
    assert chatted.prompt_token_ids == _attach(flagged, tok, chatted.prompt, {"image": image}).prompt_token_ids
    assert len(chatted.prompt_token_ids) < len(llm.chat(chat, GREEDY, use_tqdm=False)[0].prompt_token_ids)

    # The answer an engine started with the flag gives for the same prompt.
    started = LLM(model=folder, dtype="float32", device="cpu", mm_processor_kwargs=SMALL)
    assert started.generate(plain, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == small.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_other_keys_are_refused_by_name(qwen, tmp_path):
    from ferrox.multimodal.processing import request_image_prompts

    folder, llm = qwen
    plain = {"prompt": PROMPT, "multi_modal_data": {"image": _image()}}
    for key, value in (("fps", 2), ("num_frames", 4), ("size", {"longest_edge": 100})):
        with pytest.raises(InvalidArgumentError, match=rf"prompts\[0\]: mm_processor_kwargs\.{key}: .*takes min_pixels"):
            llm.generate({**plain, "mm_processor_kwargs": {key: value}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="mm_processor_kwargs.fps"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, mm_processor_kwargs={"fps": 1})
    with pytest.raises(InvalidArgumentError, match="max_pixels must be a positive integer"):
        llm.generate({**plain, "mm_processor_kwargs": {"max_pixels": -1}}, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="min_pixels 12544 is more than max_pixels 3136"):
        llm.generate({**plain, "mm_processor_kwargs": {"min_pixels": 112 * 112, **SMALL}}, GREEDY, use_tqdm=False)
    # A family whose processors take no kwargs (LLaVA), and a text-only model: any key refused.
    llava = _rules(make_tiny_llava(tmp_path / "llava"))
    assert llava is not None
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs\.max_pixels: .*takes none"):
        request_image_prompts(llava, SMALL)
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs\.max_pixels: .*takes none"):
        request_image_prompts(None, SMALL)
    assert request_image_prompts(llava, {}) is llava
    assert_no_leaked_blocks(llm)


def test_video_kwargs(tmp_path):
    """Qwen2.5-VL videos read a request's max_pixels over their own bounds, as the flag's; fps and the frame
    counts are refused there (its video processor never samples frames again)."""
    from tests.helpers.tiny_qwen2_vl_video import VIDEO_PLACEHOLDER, make_tiny_qwen2_vl_video

    folder = make_tiny_qwen2_vl_video(tmp_path / "qwen2_5_vl", version="qwen2_5_vl")
    frames = np.random.default_rng(3).integers(0, 255, (4, 56, 84, 3), dtype=np.uint8)
    tok, kwargs = _tokenizer(folder), {"max_pixels": 56 * 56}  # (the images' floor)
    media = {"video": frames}
    got = _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media, kwargs)
    want = _attach(_rules(folder, kwargs), tok, VIDEO_PLACEHOLDER, media)
    default = _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media)
    assert got.prompt_token_ids == want.prompt_token_ids and got.mm_items[0].pixels == want.mm_items[0].pixels
    assert got.mm_items[0].length < default.mm_items[0].length
    for key in ("fps", "min_frames", "max_frames", "num_frames"):
        with pytest.raises(InvalidArgumentError, match=rf"mm_processor_kwargs\.{key}: "):
            _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media, {key: 2})


def test_qwen3_vl_samples_frames_at_a_requests_fps(tmp_path):
    """Qwen3-VL's video processor thins a whole video (do_sample_frames) to its fps: a request's fps gives the
    frames (and timestamps) the flag's does; num_frames stays refused (transformers refuses it beside fps)."""
    from tests.helpers.tiny_qwen3_vl import VIDEO_PLACEHOLDER, make_tiny_qwen3_vl_moe

    folder = make_tiny_qwen3_vl_moe(tmp_path / "qwen3_vl_moe", video=True)
    tok, kwargs = _tokenizer(folder), {"fps": 1, "min_frames": 2}
    frames = np.random.default_rng(1).integers(0, 255, (20, 50, 40, 3), dtype=np.uint8)
    media = {"video": (frames, {"fps": 5.0, "total_num_frames": 20, "frames_indices": list(range(20)),
                                "do_sample_frames": True})}
    got = _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media, kwargs)
    want = _attach(_rules(folder, kwargs), tok, VIDEO_PLACEHOLDER, media)
    default = _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media)
    assert got.prompt_token_ids == want.prompt_token_ids and got.mm_items[0].pixels == want.mm_items[0].pixels
    assert got.mm_items[0].grid[0] < default.mm_items[0].grid[0]  # 4 frames at 1 fps, not 8 at the folder's 2
    with pytest.raises(InvalidArgumentError, match=r"mm_processor_kwargs\.num_frames: "):
        _attach(_rules(folder), tok, VIDEO_PLACEHOLDER, media, {"num_frames": 4})


def test_prefix_cache_keeps_resolutions_apart(qwen):
    """One image at two max_pixels: the same placeholder ids fill its first KV blocks, but other pixels make
    other KV. The second request must reuse nothing of the first (its answer is a fresh engine's), while the
    same request again reuses its own blocks."""
    folder, llm = qwen
    plain = {"prompt": PROMPT, "multi_modal_data": {"image": _image()}}
    small = {**plain, "mm_processor_kwargs": SMALL}
    assert llm.reset_prefix_cache()
    first = llm.generate(plain, GREEDY, use_tqdm=False)[0]
    other = llm.generate(small, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    again = llm.generate(small, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == other.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate(small, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == other.outputs[0].token_ids
    assert llm.generate(plain, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert_no_leaked_blocks(llm)


def test_server_takes_a_requests_kwargs(qwen):
    folder, llm = qwen
    buf = io.BytesIO()
    _image().save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    image = PIL.open(io.BytesIO(buf.getvalue()))
    chat = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]
    offline = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                            {"type": "text", "text": "What is this?"}]}]
    small, full = (llm.chat(offline, GREEDY, use_tqdm=False, mm_processor_kwargs=kw)[0] for kw in (SMALL, None))
    # (vLLM's --trust-request-mm-kwargs: without it a request's kwargs are refused, tests/server/test_mm_flags.py)
    srv = ServerProcess(folder, "--served-model-name", "qwen", "--dtype", "float32", "--trust-request-mm-kwargs")
    try:
        body = {"model": "qwen", "messages": chat, "max_tokens": GREEDY.max_tokens, "temperature": 0}
        for kwargs, want in ((SMALL, small), (None, full)):
            status, out = _post(srv.base_url, {**body, "mm_processor_kwargs": kwargs})
            assert status == 200, out
            assert out["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
            assert out["choices"][0]["message"]["content"] == want.outputs[0].text
        for kwargs, want in ((SMALL, small), (None, full)):  # /tokenize counts the tokens the chat would take
            status, out = _post(srv.base_url, {"model": "qwen", "messages": chat, "mm_processor_kwargs": kwargs},
                                "/tokenize")
            assert status == 200 and out["count"] == len(want.prompt_token_ids), out
        status, err = _post(srv.base_url, {**body, "mm_processor_kwargs": {"fps": 2}})
        assert status == 400 and err["error"]["param"] == "mm_processor_kwargs", err
        assert "mm_processor_kwargs.fps" in err["error"]["message"], err
        status, err = _post(srv.base_url, {**body, "mm_processor_kwargs": {"max_pixels": "big"}})
        assert status == 400 and "max_pixels must be a positive integer" in err["error"]["message"], err
    finally:
        srv.stop()


def test_text_before_an_image_is_shared_and_nothing_from_the_image_on(qwen):
    """The blocks before an image are the same text's blocks whatever the image (vLLM's per-block extra keys):
    a second image after the same 3-block preamble reuses exactly those 12 tokens, its answer is a fresh
    engine's (the reset run), and the first image's request again reuses all but its last block."""
    folder, llm = qwen
    preamble = " ".join(["the system prompt says hello"] * 3)
    tok = llm.get_tokenizer()
    prompt = preamble + PLACEHOLDER + " What is this?"
    image_at = len(tok.encode(preamble, add_special_tokens=False))
    assert image_at >= 12
    other = PIL.fromarray(np.random.default_rng(9).integers(0, 255, (112, 112, 3), dtype=np.uint8))
    first, second = ({"prompt": prompt, "multi_modal_data": {"image": im}} for im in (_image(), other))
    assert llm.reset_prefix_cache()
    a = llm.generate(first, GREEDY, use_tqdm=False)[0]
    b = llm.generate(second, GREEDY, use_tqdm=False)[0]
    assert b.num_cached_tokens == image_at // 4 * 4
    again = llm.generate(first, GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 4 * 4
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    assert llm.generate(second, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == b.outputs[0].token_ids
    assert_no_leaked_blocks(llm)
