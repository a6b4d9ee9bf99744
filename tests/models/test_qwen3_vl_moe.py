"""Qwen3-VL-MoE against transformers on a tiny random checkpoint (tests/helpers/tiny_qwen3_vl.py
make_tiny_qwen3_vl_moe: dense Qwen3-VL's tower, rotary and DeepStack on a Qwen3-MoE decoder with a dense layer
between two sparse ones): greedy tokens identical to transformers' generate on the same ids, patches and grids,
whole and with chunked prefill cutting the images, from the fused experts as transformers saves them and as the
hub's files store them (transposed); config fields ferrox cannot honour refused by name."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.errors import UnsupportedModelError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_qwen3_vl import PLACEHOLDER, hub_expert_layout, make_tiny_qwen3_vl_moe

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)


def _images():
    rng = np.random.default_rng(2)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((60, 90, 3), (100, 50, 3),
                                                                                     (30, 30, 3))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import transformers

    folder = make_tiny_qwen3_vl_moe(tmp_path_factory.mktemp("qwen3_vl_moe"))
    hf = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _processed(llm, prompt, images):
    from ferrox.engine.input_processor import attach_images, process_prompt

    data = {"image": images} if images else {}
    return attach_images(process_prompt(llm.get_tokenizer(), {"prompt": prompt, "multi_modal_data": data}),
                         llm.engine.image_prompts, "prompt")


def _hf_greedy(hf, processed):
    """transformers' greedy tokens for ferrox's expanded prompt and the items' patches and grids, in order."""
    items = processed.mm_items
    ids = torch.tensor([processed.prompt_token_ids])
    inputs = dict(input_ids=ids, mm_token_type_ids=(ids == hf.config.image_token_id).int())
    if items:
        inputs.update(pixel_values=torch.cat([it.pixel_values() for it in items]),
                      image_grid_thw=torch.tensor([it.grid for it in items]))
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


CASES = [[0], [2, 1], []]  # one image; two of different sizes; text only


def _check_greedy(llm, hf):
    img = _images()
    cases = [[img[i] for i in c] for c in CASES]
    prompts = ["Hello " + " and ".join(PLACEHOLDER for _ in c) + " What is this?" for c in cases]
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": c} if c else {}}
                         for p, c in zip(prompts, cases, strict=True)], GREEDY, use_tqdm=False)
    for prompt, imgs, out in zip(prompts, cases, outs, strict=True):
        processed = _processed(llm, prompt, imgs)
        assert out.prompt_token_ids == processed.prompt_token_ids
        assert list(out.outputs[0].token_ids) == _hf_greedy(hf, processed), prompt
    assert_no_leaked_blocks(llm)


@pytest.mark.parametrize("budget", [2048, 5], ids=["whole", "chunked-5"])
def test_greedy_matches_transformers(qwen, budget):
    """The three prompts in one batch; with a budget of 5 tokens every image is cut across steps (its rows and
    DeepStack rows come a few at a time)."""
    folder, hf = qwen
    _check_greedy(LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget), hf)


def test_loads_the_hub_expert_layout(qwen, tmp_path):
    """The hub's files hold the fused experts transposed ([E, hidden, 2 x I], [E, I, hidden]): the same tokens."""
    folder, hf = qwen
    hub = hub_expert_layout(folder, tmp_path / "hub")
    from safetensors import safe_open

    with safe_open(os.path.join(hub, "model.safetensors"), "pt") as f:
        shape = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == [6, 64, 32]  # (the layout this test means to cover)
    _check_greedy(LLM(model=hub, dtype="float32", device="cpu", max_num_batched_tokens=7), hf)


def test_routing_and_deepstack_decide_the_tokens(qwen):
    """The tests above can fail on the experts' routing and on DeepStack: transformers with a different top-k, or
    without DeepStack, answers otherwise on this checkpoint."""
    import copy

    _, hf = qwen
    llm = LLM(model=qwen[0], dtype="float32", device="cpu")
    processed = _processed(llm, "Hello " + PLACEHOLDER + " What is this?", [_images()[0]])
    want = _hf_greedy(hf, processed)
    plain = copy.deepcopy(hf)
    plain.model.visual.deepstack_visual_indexes = []
    assert _hf_greedy(plain, processed) != want
    top1 = copy.deepcopy(hf)
    for layer in top1.model.language_model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.top_k = 1
    assert _hf_greedy(top1, processed) != want


def _with_text_config(folder, tmp_path, **fields):
    for name in os.listdir(folder):
        shutil.copy(os.path.join(folder, name), tmp_path / name)
    with open(tmp_path / "config.json", encoding="utf-8") as f:
        config = json.load(f)
    config["text_config"].update(fields)
    with open(tmp_path / "config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
    return str(tmp_path)


@pytest.mark.parametrize("field,value", [("norm_topk_prob", False), ("shared_expert_intermediate_size", 32)])
def test_refuses_fields_it_cannot_honour(qwen, tmp_path, field, value):
    """transformers' Qwen3-VL-MoE renormalises its top-k always and has no shared expert: a config asking otherwise
    is refused by name, not served as something else."""
    folder = _with_text_config(qwen[0], tmp_path, **{field: value})
    with pytest.raises(UnsupportedModelError, match=field):
        LLM(model=folder, dtype="float32", device="cpu")


@pytest.mark.gpu
def test_on_cuda_matches_transformers(qwen):
    """The tower, DeepStack, the experts' Triton kernels, the [3, T] rotary positions of image steps (eager) and
    the decode steps after them (CUDA graphs, fused decode path) on the device, float32, images cut across
    steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf = qwen
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=8)
    img = _images()
    prompt = "Hello " + PLACEHOLDER + " and " + PLACEHOLDER + " What is this?"
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": img[:2]}}, GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf, _processed(llm, prompt, img[:2]))
