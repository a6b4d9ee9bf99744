"""vLLM's --language-model-only (LLM(language_model_only=True)): a vision-language model served as text.

Every modality's limit is 0, so an image or video is refused exactly as under --limit-mm-per-prompt
'{"image": 0, "video": 0}' (the flag wins over a limit that allows some, as vLLM's get_limit_per_prompt), and the
vision side (tower, projector, image-only tensors) is neither built nor loaded: each family's model holds only
its language model's parameters, equal to the whole model's, with no tensor left on the meta device
(models/vision/encoder_setup.py). Limits of 0 for every modality a model takes skip the encoder too (vLLM's
rule); a limit that leaves one modality open keeps it. A text-only model takes the flag and is unchanged.
Tiny random checkpoints, the real loader and engine."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import InvalidArgumentError

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
TEXT_ONLY = {"image": 0, "video": 0}


def _builders():
    from tests.helpers.tiny_gemma4 import make_tiny_gemma4
    from tests.helpers.tiny_internvl import make_tiny_internvl, make_tiny_internvl_chat
    from tests.helpers.tiny_llava_onevision import make_tiny_llava_onevision
    from tests.helpers.tiny_models import (
        make_tiny_gemma3_vision,
        make_tiny_idefics3,
        make_tiny_llava,
        make_tiny_llava_next,
        make_tiny_llava_pixtral,
        make_tiny_mistral3,
        make_tiny_qwen2_vl,
    )
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl, make_tiny_qwen3_vl_moe

    return {
        "llava": make_tiny_llava, "llava-next": make_tiny_llava_next, "llava-onevision": make_tiny_llava_onevision,
        "llava-pixtral": make_tiny_llava_pixtral, "mistral3": make_tiny_mistral3, "gemma3": make_tiny_gemma3_vision,
        "idefics3": make_tiny_idefics3, "internvl": lambda d: make_tiny_internvl(d, text="qwen3"),
        "internvl-chat": lambda d: make_tiny_internvl_chat(d)[1], "qwen2-vl": make_tiny_qwen2_vl,
        "qwen2.5-vl": lambda d: make_tiny_qwen2_vl(d, version="qwen2_5_vl"), "qwen3-vl": make_tiny_qwen3_vl,
        "qwen3-vl-moe": make_tiny_qwen3_vl_moe, "gemma4": lambda d: make_tiny_gemma4(d, images=True),
    }


FAMILIES = ["llava", "llava-next", "llava-onevision", "llava-pixtral", "mistral3", "gemma3", "idefics3", "internvl",
            "internvl-chat", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe", "gemma4"]


def _load(folder: str, limits=None):
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu", mm_limits=limits)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_vision_side_is_not_built(tmp_path, family):
    """Each family: the text-only model holds exactly the whole model's language parameters, the same values,
    nothing on the meta device, its vision modules SkippedEncoders, and says it takes no images."""
    from ferrox.models.vision.encoder_setup import SkippedEncoder

    folder = _builders()[family](tmp_path / family)
    whole, text = _load(folder), _load(folder, TEXT_ONLY)
    assert not any(t.is_meta for t in [*text.parameters(), *text.buffers()])
    skipped = [name for name, m in text.named_modules() if isinstance(m, SkippedEncoder)]
    assert skipped, "no vision module was left out"
    assert type(text).takes_images and not text.takes_images and not getattr(text, "takes_videos", False)
    kept, full = dict(text.named_parameters()), dict(whole.named_parameters())
    assert set(kept) < set(full)
    for name, param in kept.items():
        assert torch.equal(param, full[name]), name
    for name in set(full) - set(kept):  # every parameter left out is the vision side's
        assert name.startswith(tuple(s + "." for s in skipped)), name
    assert sum(p.numel() for p in kept.values()) < sum(p.numel() for p in full.values())


def _image():
    return PIL.fromarray(np.random.default_rng(5).integers(0, 255, (60, 80, 3), dtype=np.uint8))


def test_llm_serves_text_and_refuses_images_as_a_zero_limit(tmp_path, caplog):
    """The same text answers as the whole model; an image refused as under limit 0 (a limit that allowed some
    is overridden, with a warning); dummy weights load too."""
    from tests.helpers.tiny_models import make_tiny_llava

    folder = make_tiny_llava(tmp_path / "llava")
    whole = LLM(model=folder, dtype="float32", device="cpu", max_model_len=128)
    with caplog.at_level(logging.WARNING, logger="ferrox.config"):
        text = LLM(model=folder, dtype="float32", device="cpu", max_model_len=128, language_model_only=True,
                   limit_mm_per_prompt={"image": 2})
    assert "every modality's limit is 0" in caplog.text
    zero = LLM(model=folder, dtype="float32", device="cpu", max_model_len=128, limit_mm_per_prompt=TEXT_ONLY)
    prompts = ["Hello, what is this?", "One two three"]
    expected = [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)]
    for llm in (text, zero):
        assert not llm.engine.runner.model.takes_images  # (limits of 0 alone skip the tower too, as vLLM's)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    image = {"prompt": "<image> What is this?", "multi_modal_data": {"image": _image()}}
    errors = []
    for llm in (text, zero):
        with pytest.raises(InvalidArgumentError, match="at most 0 may be given") as exc:
            llm.generate(image, GREEDY, use_tqdm=False)
        errors.append(str(exc.value))
    assert errors[0] == errors[1]
    dummy = LLM(model=folder, dtype="float32", device="cpu", max_model_len=128, language_model_only=True,
                load_format="dummy")
    assert len(dummy.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == GREEDY.max_tokens
    for llm in (whole, text, zero, dummy):
        llm.engine.shutdown()


def test_an_open_modality_keeps_the_encoder_and_text_models_take_the_flag(tmp_path):
    """Qwen2-VL takes videos too: {"image": 0} alone keeps its tower (videos may still come); a text-only model
    with --language-model-only is unchanged."""
    from tests.helpers.tiny_models import make_tiny_llama, make_tiny_qwen2_vl

    qwen = _load(make_tiny_qwen2_vl(tmp_path / "qwen"), {"image": 0})
    assert qwen.takes_images and not any(t.is_meta for t in qwen.parameters())
    folder = make_tiny_llama(tmp_path / "llama")
    outs = []
    for flag in (False, True):
        llm = LLM(model=folder, dtype="float32", device="cpu", max_model_len=128, language_model_only=flag)
        outs.append(llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
        llm.engine.shutdown()
    assert outs[0] == outs[1]


def test_prompt_embeds_stay_refused_for_a_vision_model(tmp_path):
    """A vision family served as text is still a vision family to --enable-prompt-embeds (refused by name)."""
    from tests.helpers.tiny_models import make_tiny_llava

    with pytest.raises(ValueError, match=r"enable_prompt_embeds: .*a vision model"):
        LLM(model=make_tiny_llava(tmp_path / "llava"), dtype="float32", device="cpu", max_model_len=128,
            language_model_only=True, enable_prompt_embeds=True)
