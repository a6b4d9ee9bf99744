"""The tiny hybrid linear-attention Qwen builders (tests/helpers/tiny_qwen3_5.py) against transformers itself: each
folder loads back, gives finite logits, and transformers' cached greedy generate (Gated DeltaNet conv and recurrent
state carried across steps) picks the tokens its own no-cache full-sequence forward argmaxes: the reference the
ferrox tests compare to is self-consistent. The multimodal ones run with an image (a 4x4-patch grid, 4 rows).
Slow: ~10 s of its ~13 s is the first import of transformers' Qwen3.5 modules (flash-linear-attention's package)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import tiny_qwen3_5

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 120, 3, 77, 200]
NEW = 4
TEXT = {"qwen3_5": "make_tiny_qwen3_5", "qwen3_5_moe": "make_tiny_qwen3_5_moe", "qwen3_next": "make_tiny_qwen3_next",
        "qwen3_next_dense_layer": "make_tiny_qwen3_next"}
MULTIMODAL = {"qwen3_5_multimodal": ("make_tiny_qwen3_5_multimodal", "Qwen3_5ForConditionalGeneration"),
              "qwen3_5_moe_multimodal": ("make_tiny_qwen3_5_moe_multimodal", "Qwen3_5MoeForConditionalGeneration")}


def _check_greedy(model, ids: torch.Tensor, **inputs) -> None:
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **inputs).logits
        assert torch.isfinite(logits).all()
        out = model.generate(input_ids=ids, max_new_tokens=NEW, do_sample=False, use_cache=True,
                             pad_token_id=0, eos_token_id=None, **inputs)
        assert out.shape[1] == ids.shape[1] + NEW
        extra = {k: torch.cat([v, v.new_zeros(1, NEW)], 1) if k == "mm_token_type_ids" else v
                 for k, v in inputs.items()}
        full = model(input_ids=out, use_cache=False, **extra).logits
    want = full[0, ids.shape[1] - 1:-1].argmax(-1)
    assert out[0, ids.shape[1]:].tolist() == want.tolist()


@pytest.mark.parametrize("name", list(TEXT))
def test_text_builder_loads_and_generates(tmp_path, name):
    import transformers

    overrides = {"mlp_only_layers": [1]} if name == "qwen3_next_dense_layer" else {}
    folder = getattr(tiny_qwen3_5, TEXT[name])(tmp_path / name, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        assert type(model).__name__ == json.load(f)["architectures"][0]
    assert next(model.parameters()).dtype == torch.float32
    if name == "qwen3_next_dense_layer":
        assert hasattr(model.model.layers[1].mlp, "gate_proj") and hasattr(model.model.layers[0].mlp, "experts")
    _check_greedy(model, torch.tensor([PROMPT]))


@pytest.mark.parametrize("name", list(MULTIMODAL))
def test_multimodal_builder_loads_and_generates(tmp_path, name):
    import transformers

    build, cls = MULTIMODAL[name]
    folder = getattr(tiny_qwen3_5, build)(tmp_path / name)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    model = getattr(transformers, cls).from_pretrained(folder, dtype=torch.float32).eval()
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                       "<|video_pad|>")}
    assert ids == {"<|vision_start|>": config["vision_start_token_id"], "<|vision_end|>": config["vision_end_token_id"],
                   "<|image_pad|>": config["image_token_id"], "<|video_pad|>": config["video_token_id"]}
    image = config["image_token_id"]
    prompt = PROMPT[:3] + [config["vision_start_token_id"]] + [image] * 4 + [config["vision_end_token_id"]] + PROMPT[3:]
    input_ids = torch.tensor([prompt])
    generator = torch.Generator().manual_seed(0)
    pixel_values = torch.randn(16, 3 * 2 * 16 * 16, generator=generator)  # one 64x64 image: 4x4 patches, 2x2 merged
    _check_greedy(model, input_ids, pixel_values=pixel_values, image_grid_thw=torch.tensor([[1, 4, 4]]),
                  mm_token_type_ids=(input_ids == image).int())


def test_next_row_layout_matches_transformers(tmp_path):
    """next_qkvz_rows is fix_query_key_value_ordering's split: the rows it names give transformers' q, k, v, z, b, a."""
    import transformers

    folder = tiny_qwen3_5.make_tiny_qwen3_next(tmp_path / "next")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        rows = tiny_qwen3_5.next_qkvz_rows(json.load(f))
    attn = model.model.layers[0].linear_attn
    x = torch.randn(1, 3, 64)
    with torch.no_grad():
        parts = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(x), attn.in_proj_ba(x))
        got = dict(zip("qkvzba", parts, strict=True))
        for name, index in rows.items():
            weight = (attn.in_proj_ba if name in "ba" else attn.in_proj_qkvz).weight[index]
            torch.testing.assert_close(got[name].reshape(1, 3, -1), x @ weight.T)
