"""vLLM's --mm-encoder-tp-mode under tensor parallelism (models/vision/encoder_setup.py, tower_tp.py,
worker/multimodal.py).

'weights' (the default): each tower's transformer blocks are sharded over the ranks, Megatron-style: in process,
every family's rank holds exactly its rows / columns of the whole tower's q/k/v, output, MLP weights (and InternViT's
q/k norms), its heads halved, the rest of the tower and the projector whole. 'data': the tower stays whole on every
rank, and each step's new images are split among the ranks (the driver runs only its share through its tower) and
their rows gathered to all. End to end on CPU with 2 gloo rank processes, greedy tokens (float32) with images equal
tensor_parallel_size=1's in either mode: Qwen2-VL's images of three sizes (rows of unequal counts gathered) and
Qwen3-VL's DeepStack rows under 'data'; a Pixtral tower (Mistral 3) and an InternViT with q/k norms under 'weights'
(LLaVA's and Gemma 3's ViT and the Qwen towers run sharded in tests/engine/test_vision_tensor_parallel.py). One rank:
both modes are the same.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.distributed.parallel_state import TPGroup

from tests.engine.test_batch_invariance import assert_no_leaked_blocks

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _images():
    rng = np.random.default_rng(11)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8))
            for shape in ((60, 90, 3), (50, 40, 3), (30, 34, 3))]


def _prompts(placeholder: str):
    """Five images in four prompts (and a text-only one), all in the first step."""
    a, b, c = _images()
    cases = [[a], [b], [b, a], [c], []]
    return [{"prompt": "Hello " + " and ".join(placeholder for _ in case) + " What is this?",
             "multi_modal_data": {"image": case}} if case else "Hello, what is this?" for case in cases]


def _generate(folder: str, tp: int, mode: str, placeholder: str) -> tuple[list[list[int]], int]:
    """(greedy tokens of each prompt, the images the driver ran through its tower)."""
    llm = LLM(model=folder, dtype="float32", device="cpu", tensor_parallel_size=tp, mm_encoder_tp_mode=mode,
              max_model_len=256, kv_cache_memory=4 << 20)
    try:
        outs = llm.generate(_prompts(placeholder), GREEDY, use_tqdm=False)
        assert_no_leaked_blocks(llm)
        runs = llm.engine.runner.images.tower_runs
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], runs


def _check(folder: str, placeholder: str, modes: tuple[str, ...]) -> None:
    reference, all_images = _generate(folder, 1, "weights", placeholder)
    assert all_images == 5 and reference[0] != reference[1], "the images were meant to decide the tokens"
    if "data" in modes:
        assert _generate(folder, 1, "data", placeholder) == (reference, all_images)  # one rank: the same
    for mode in modes:
        tokens, runs = _generate(folder, 2, mode, placeholder)
        assert tokens == reference, mode
        if mode == "data":  # the driver encoded its share only; the other rank the rest
            assert 0 < runs < all_images, runs
        else:  # every rank runs every image through its half of the tower
            assert runs == all_images


def test_qwen2_vl_data_mode_gathers_unequal_images(tmp_path):
    from tests.helpers.tiny_models import make_tiny_qwen2_vl

    _check(make_tiny_qwen2_vl(tmp_path), QWEN_IMAGE, ("data",))


def test_qwen3_vl_data_mode_gathers_deepstack_rows(tmp_path):
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl

    _check(make_tiny_qwen3_vl(tmp_path), QWEN_IMAGE, ("data",))


def test_pixtral_tower_sharded(tmp_path):
    from tests.helpers.tiny_models import make_tiny_mistral3

    _check(make_tiny_mistral3(tmp_path), "[IMG]", ("weights",))


def test_internvit_with_qk_norms_sharded(tmp_path):
    from tests.helpers.tiny_internvl import make_tiny_internvl

    _check(make_tiny_internvl(tmp_path, text="qwen3"), "<IMG_CONTEXT>", ("weights",))


# ---- in process: what each rank holds -------------------------------------------------------------------
def _builders():
    from tests.engine.test_vision_tensor_parallel import _builders as others
    from tests.helpers.tiny_internvl import make_tiny_internvl
    from tests.helpers.tiny_models import make_tiny_gemma3_vision, make_tiny_llava, make_tiny_qwen2_vl
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl

    return {**others(), "llava-clip": make_tiny_llava, "gemma3": make_tiny_gemma3_vision, "qwen2-vl": make_tiny_qwen2_vl,
            "qwen2.5-vl": lambda d: make_tiny_qwen2_vl(d, version="qwen2_5_vl"), "qwen3-vl": make_tiny_qwen3_vl,
            "internvl-qk-norm": lambda d: make_tiny_internvl(d, text="qwen3")}


FAMILIES = ["llava-clip", "gemma3", "idefics3", "llava-next", "llava-pixtral", "mistral3", "internvl",
            "internvl-qk-norm", "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe"]


def _build(folder: str, tp: TPGroup):
    from ferrox.distributed.parallel_state import use_tp_group
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.loader.weights import iter_safetensors
    from ferrox.models.registry import get_model_class

    spec = load_model_spec(resolve_model(folder))
    cls = get_model_class([spec.architecture], spec.hf_config)
    with use_tp_group(tp), torch.no_grad():
        model = cls(spec, torch.float32, "cpu")
        model.load_weights(iter_safetensors(folder, lazy=tp.size > 1))
    return model


def _rows(whole: torch.Tensor, parts: int, rank: int) -> torch.Tensor:
    """Rank `rank` of 2's rows of each of `parts` equal row blocks."""
    return torch.cat([block.chunk(2)[rank] for block in whole.chunk(parts)])


def _towers(model) -> list:
    return [m for m in model.modules() if hasattr(m, "tp_blocks")]


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_mode_keeps_each_ranks_part(tmp_path, family):
    from ferrox.models.vision.encoder_setup import place_vision_encoder

    folder = _builders()[family](tmp_path)
    whole = _build(folder, TPGroup())
    whole_blocks = [b for t in _towers(whole) for b in t.tp_blocks()]
    assert whole_blocks
    for rank in range(2):
        group = TPGroup(rank=rank, size=2)
        part = _build(folder, group)
        assert place_vision_encoder(part, group, "weights") == "weights"
        assert part.mm_encoder_data_group is None
        blocks = [b for t in _towers(part) for b in t.tp_blocks()]
        assert len(blocks) == len(whole_blocks)
        with torch.no_grad():
            for mine, full in zip(blocks, whole_blocks, strict=True):
                assert mine.attention.num_heads * 2 == full.attention.num_heads
                for name in mine.qkv:
                    parts = 3 if len(mine.qkv) == 1 else 1
                    layer, ref = getattr(mine.attention, name), getattr(full.attention, name)
                    assert torch.equal(layer.weight, _rows(ref.weight, parts, rank)), name
                    if ref.bias is not None:
                        assert torch.equal(layer.bias, _rows(ref.bias, parts, rank)), name
                for owner, ref_owner, names in ((mine.mlp, full.mlp, mine.up),):
                    for name in names:
                        assert torch.equal(getattr(owner, name).weight, _rows(getattr(ref_owner, name).weight, 1, rank))
                for owner, ref_owner, name in ((mine.attention, full.attention, mine.out), (mine.mlp, full.mlp, mine.down)):
                    layer, ref = getattr(owner, name), getattr(ref_owner, name)
                    assert torch.equal(layer.weight, ref.weight.chunk(2, dim=1)[rank]), name
                    if ref.bias is not None:  # whole, added by rank 0 only (RowParallelLinear)
                        assert torch.equal(layer.bias, ref.bias) and layer.adds_bias == (rank == 0)
                for name in mine.qk_norms:
                    assert torch.equal(getattr(mine.attention, name).weight,
                                       getattr(full.attention, name).weight.chunk(2)[rank])
        if family == "internvl-qk-norm":
            assert all(b.qk_norms for b in blocks)
        held = sum(p.numel() for t in _towers(part) for p in t.parameters())
        assert held < sum(p.numel() for t in _towers(whole) for p in t.parameters())


def test_data_mode_and_the_fallback_keep_the_tower_whole(tmp_path, caplog):
    """'data': the tower untouched, the model given its group. 'weights' on 3 ranks of a tower with 2 heads:
    whole too ('data'), with a warning naming the numbers."""
    from ferrox.models.vision.encoder_setup import place_vision_encoder

    from tests.helpers.tiny_models import make_tiny_qwen2_vl

    folder = make_tiny_qwen2_vl(tmp_path)
    whole = _build(folder, TPGroup())
    before = {n: p.clone() for n, p in whole.visual.named_parameters()}
    group = TPGroup(rank=0, size=2)
    assert place_vision_encoder(whole, group, "data") == "data" and whole.mm_encoder_data_group is group
    three = TPGroup(rank=0, size=3)
    with caplog.at_level(logging.WARNING):
        assert place_vision_encoder(whole, three, "weights") == "data" and whole.mm_encoder_data_group is three
    assert "attention heads do not split 3 ways" in caplog.text
    after = dict(whole.visual.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(after[n], p) for n, p in before.items())
    assert place_vision_encoder(whole, TPGroup(), "weights") is None  # one rank: nothing to place


def test_assignment_balances_and_agrees():
    from ferrox.worker.multimodal import assign_items

    assert assign_items([10, 1, 1, 8], 2) == [0, 1, 1, 1]  # 10 | 8 + 1 + 1
    assert assign_items([5], 2) == [0]
    assert assign_items([3, 3, 3, 3], 2) == [0, 1, 0, 1]
    assert assign_items([], 2) == []
