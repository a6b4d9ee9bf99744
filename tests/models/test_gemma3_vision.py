"""Gemma 3 with images (Gemma3ForConditionalGeneration) against transformers: a tiny random checkpoint (a
SigLIP tower of 4x4 patches pooled to 4 rows, six layers with a 16-token window on five), the prompt's
`<start_of_image>` expanded exactly as Gemma3Processor's text replacement tokenizes, and greedy tokens
identical to transformers given token_type_ids, i.e. with each image's tokens attending to each other
both ways (they differ from a causal-only run, which the test checks, so the mask is what it tests).
Chunked prefill with a budget barely larger than an image (the scheduler computes each image in one
step), preemption under a tight KV cache, and the Triton backend handing such steps to the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.errors import InvalidArgumentError

from tests.engine.test_batch_invariance import assert_no_leaked_blocks
from tests.helpers.tiny_models import make_tiny_gemma3_vision

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=8, temperature=0)
FULL = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"


def _images(n=3):
    rng = np.random.default_rng(1)
    return [PIL.fromarray(rng.integers(0, 255, (40 + 13 * k, 90 - 11 * k, 3), dtype=np.uint8)) for k in range(n)]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    folder = make_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3v"))
    hf = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, hf


def _hf(hf, folder, ids, images, *, both_ways=True):
    from ferrox.multimodal.image_processor import ImageProcessor

    pixels = torch.from_numpy(ImageProcessor.from_model_dir(folder)(images))
    t = torch.tensor([ids])
    extra = {"token_type_ids": (t == hf.config.image_token_id).long()} if both_ways else {}
    with torch.no_grad():
        out = hf.generate(input_ids=t, pixel_values=pixels, max_new_tokens=8, do_sample=False, **extra)
    return out[0, len(ids):].tolist()


def _prompts(images):
    cases = [[images[0]], [images[1]], [images[0], images[2]], [images[2], images[1], images[0]]]
    return cases, [{"prompt": "Hello\n" + " and ".join("<start_of_image>" for _ in imgs) + "What is this?",
                    "multi_modal_data": {"image": imgs}} for imgs in cases]


@pytest.mark.parametrize("budget", [2048, 6], ids=["whole", "chunked-6"])
def test_greedy_matches_transformers_with_images_attending_both_ways(gemma, budget):
    folder, hf = gemma
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=budget)
    tok = llm.get_tokenizer()
    cases, prompts = _prompts(_images())
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for imgs, prompt, out in zip(cases, prompts, outs, strict=True):
        ids = out.prompt_token_ids
        assert ids == tok.encode(prompt["prompt"].replace("<start_of_image>", FULL))  # Gemma3Processor's text rule
        assert list(out.outputs[0].token_ids) == _hf(hf, folder, ids, imgs)
    if budget == 2048:  # the mask matters: a causal-only reference disagrees
        assert list(outs[0].outputs[0].token_ids) != _hf(hf, folder, outs[0].prompt_token_ids, cases[0],
                                                          both_ways=False)
    assert_no_leaked_blocks(llm)


def test_preemption_and_chat(gemma):
    folder, hf = gemma
    llm = LLM(model=folder, dtype="float32", device="cpu")
    cases, prompts = _prompts(_images())
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    per_block = kv_cache_bytes_per_block(llm.engine.spec, 16, torch.float32)
    tight = LLM(model=folder, dtype="float32", device="cpu", kv_cache_memory=per_block * 5, max_model_len=64,
                max_num_batched_tokens=16)
    outs = tight.generate(prompts * 2, GREEDY, use_tqdm=False)
    assert tight.engine.stats()["num_preemptions"] > 0
    assert [list(o.outputs[0].token_ids) for o in outs] == expected * 2
    assert_no_leaked_blocks(tight)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": cases[0][0]},
                                             {"type": "text", "text": "What is this?"}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    assert "<start_of_image>" in chat.prompt
    assert list(chat.outputs[0].token_ids) == _hf(hf, folder, chat.prompt_token_ids, cases[0])


def test_image_longer_than_the_step_budget_is_refused(gemma):
    folder, _ = gemma
    llm = LLM(model=folder, dtype="float32", device="cpu", max_num_batched_tokens=3)
    with pytest.raises(InvalidArgumentError, match="max_num_batched_tokens"):
        llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": _images(1)}}, GREEDY)


def test_triton_backend_hands_both_way_steps_to_the_reference():
    """The Triton kernels mask no bidirectional ranges: a step with them runs the torch reference (on the same
    cache), so the Triton backend's output is the reference's, bit for bit."""
    from ferrox.attention.metadata import AttentionMetadata
    from ferrox.attention.torch_backend import TorchAttentionBackend
    from ferrox.attention.triton_backend import TritonAttentionBackend

    torch.manual_seed(0)
    q, k, v = torch.randn(10, 4, 16), torch.randn(10, 2, 16), torch.randn(10, 2, 16)
    i32 = torch.int32
    meta = AttentionMetadata(num_actual_tokens=10, max_query_len=10, max_seq_len=10,
                             slot_mapping=torch.arange(16, 26), query_start_loc=torch.tensor([0, 10], dtype=i32),
                             seq_lens=torch.tensor([10], dtype=i32), block_table=torch.tensor([[1]], dtype=i32),
                             query_start_loc_cpu=torch.tensor([0, 10], dtype=i32), seq_lens_cpu=torch.tensor([10], dtype=i32),
                             bidirectional={0: [(3, 7)]})
    outs = []
    for backend in (TritonAttentionBackend(), TorchAttentionBackend()):
        cache = torch.zeros(2, 2, 16, 2, 16)
        outs.append(backend.forward(q, k, v, cache, meta, 0.25, window=5))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    causal = TorchAttentionBackend().forward(q, k, v, torch.zeros(2, 2, 16, 2, 16),
                                             AttentionMetadata(**{**{f: getattr(meta, f) for f in meta.__slots__},
                                                                  "bidirectional": None}), 0.25, window=5)
    assert not torch.equal(causal[3:6], outs[1][3:6]) and torch.equal(causal[7:], outs[1][7:])


@pytest.mark.gpu
def test_images_on_cuda_match_transformers(gemma):
    """On CUDA the image steps leave the Triton kernels for the torch attention over the same cache; the
    decode steps after them are the Triton kernels' (float32: the tokens must agree)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, hf = gemma
    llm = LLM(model=folder, dtype="float32", device="cuda", max_num_batched_tokens=6)
    cases, prompts = _prompts(_images())
    for imgs, out in zip(cases, llm.generate(prompts, GREEDY, use_tqdm=False), strict=True):
        assert list(out.outputs[0].token_ids) == _hf(hf, folder, out.prompt_token_ids, imgs)
