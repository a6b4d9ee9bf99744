"""Vision-language models under tensor parallelism on CPU (gloo): the language model sharded over 2 rank
processes, the vision tower's blocks too (--mm-encoder-tp-mode weights, the default; 'data' and the shards
themselves: tests/engine/test_mm_encoder_tp.py), the projector whole, each rank embedding its requests' images
itself (worker/rank_images.py). Greedy tokens with images (float32) must be those of tensor_parallel_size=1 on the
same checkpoint (itself checked against transformers in tests/models/), with a small step budget that cuts
an image across steps (Gemma 3's images attend both ways and are computed whole: its budget is barely
larger than one), and no KV block left behind.

A rank that ignored the images (or embedded other rows) would disagree with the driver inside the sharded
layers' sums, and the tokens would change: each family's different-images prompts answer differently, so
the images decide the tokens. End to end: LLaVA (the LLaVA layout), Qwen2-VL (multimodal rotary), Qwen3-VL
(DeepStack), Gemma 3 (bidirectional image spans); none is marked slow (each under 20 s, the file ~40 s). The other families load on two
in-process ranks: tower and projector loaded whole and equal to one rank's (the loader shards the tower after),
the language model sharded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrox import LLM, SamplingParams

from tests.engine.test_batch_invariance import assert_no_leaked_blocks

PIL = pytest.importorskip("PIL.Image")

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _images():
    rng = np.random.default_rng(3)
    return [PIL.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for shape in ((60, 90, 3), (50, 40, 3))]


def _prompts(placeholder: str):
    """Two images alone (same text), both in one prompt, and a text-only prompt, in one batch."""
    a, b = _images()
    cases = [[a], [b], [b, a], []]
    return [{"prompt": "Hello " + " and ".join(placeholder for _ in c) + " What is this?",
             "multi_modal_data": {"image": c}} if c else "Hello, what is this?" for c in cases]


def _generate(folder: str, tp: int, placeholder: str, budget: int) -> list[list[int]]:
    llm = LLM(model=folder, dtype="float32", device="cpu", tensor_parallel_size=tp, max_num_batched_tokens=budget,
              max_model_len=256, kv_cache_memory=4 << 20)
    try:
        outs = llm.generate(_prompts(placeholder), GREEDY, use_tqdm=False)
        assert_no_leaked_blocks(llm)
    finally:
        llm.engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _check(folder: str, placeholder: str, budget: int) -> None:
    reference = _generate(folder, 1, placeholder, budget)
    assert reference[0] != reference[1], "the images were meant to decide the tokens"
    assert _generate(folder, 2, placeholder, budget) == reference


def test_llava_tp2_matches_tp1(tmp_path):
    """A 16-token image in steps of 6 tokens: its rows come a few at a time, on every rank."""
    from tests.helpers.tiny_models import make_tiny_llava

    _check(make_tiny_llava(tmp_path, text="qwen2", vision="siglip"), "<image>", budget=6)


def test_qwen2_vl_tp2_matches_tp1(tmp_path):
    """Multimodal rotary positions, computed per rank from the same items."""
    from tests.helpers.tiny_models import make_tiny_qwen2_vl

    _check(make_tiny_qwen2_vl(tmp_path), QWEN_IMAGE, budget=5)


def test_qwen3_vl_tp2_matches_tp1(tmp_path):
    """DeepStack: the tower's extra row sets are added after the first (sharded) decoder layers."""
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl

    _check(make_tiny_qwen3_vl(tmp_path), QWEN_IMAGE, budget=5)


def test_gemma3_tp2_takes_images_and_matches_tp1(tmp_path):
    """Each rank's attention lets an image's tokens see each other both ways (spans from its own items)."""
    from tests.helpers.tiny_models import make_tiny_gemma3_vision

    _check(make_tiny_gemma3_vision(tmp_path), "<start_of_image>", budget=8)


def _builders():
    from tests.helpers.tiny_internvl import make_tiny_internvl
    from tests.helpers.tiny_models import (
        make_tiny_idefics3,
        make_tiny_llava_next,
        make_tiny_llava_pixtral,
        make_tiny_mistral3,
    )
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl_moe

    return {"mistral3": make_tiny_mistral3, "llava-pixtral": make_tiny_llava_pixtral,
            "llava-next": make_tiny_llava_next, "internvl": make_tiny_internvl, "idefics3": make_tiny_idefics3,
            "qwen3-vl-moe": make_tiny_qwen3_vl_moe}


TOWERS = {"mistral3": ("vision_tower", "multi_modal_projector"), "llava-pixtral": ("vision_tower", "multi_modal_projector"),
          "llava-next": ("vision_tower", "multi_modal_projector", "image_newline"),
          "internvl": ("vision_tower", "multi_modal_projector"), "idefics3": ("vision_model", "connector"),
          "qwen3-vl-moe": ("visual",)}


@pytest.mark.parametrize("family", list(TOWERS))
def test_other_families_load_on_two_ranks(tmp_path, family):
    """Each rank of two (built in this process, reading lazy safetensors slices as a sharded engine does)
    holds the whole tower and projector, equal to one rank's, and its half of the vocabulary."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.loader.weights import iter_safetensors
    from ferrox.models.registry import get_model_class

    folder = _builders()[family](tmp_path)
    spec = load_model_spec(resolve_model(folder))
    cls = get_model_class([spec.architecture], spec.hf_config)
    assert cls.supports_tensor_parallel and cls.takes_images
    with torch.no_grad():
        whole = cls(spec, torch.float32, "cpu")
        whole.load_weights(iter_safetensors(folder))
    own = TOWERS[family]
    reference = {n: p for n, p in whole.state_dict().items() if n.startswith(own)}
    assert reference
    for rank in range(2):
        with use_tp_group(TPGroup(rank=rank, size=2)), torch.no_grad():
            part = cls(spec, torch.float32, "cpu")
            part.load_weights(iter_safetensors(folder, lazy=True))
        mine = {n: p for n, p in part.state_dict().items() if n.startswith(own)}
        assert mine.keys() == reference.keys()
        for name, tensor in mine.items():
            assert torch.equal(tensor, reference[name]), name
        embed = part.model.embed_tokens
        assert embed.num_rows < spec.vocab_size and embed.vocab_start == rank * embed.weight.shape[0]


def test_unsplittable_language_model_is_refused_by_name(tmp_path):
    """A tower of any shape is served (one that does not split runs whole: test_mm_encoder_tp.py); the language
    model's heads must still split."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.errors import UnsupportedModelError
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model
    from ferrox.models.registry import get_model_class

    from tests.helpers.tiny_models import make_tiny_llava

    spec = load_model_spec(resolve_model(make_tiny_llava(tmp_path)))
    cls = get_model_class([spec.architecture], spec.hf_config)
    with use_tp_group(TPGroup(rank=0, size=3)), pytest.raises(
            UnsupportedModelError, match=rf"num_attention_heads \({spec.num_heads}\) is not divisible by "
                                         r"tensor_parallel_size \(3\)"):
        cls(spec, torch.float32, "cpu")


def test_rank_replays_the_drivers_slot_changes_in_order():
    """Between two steps a slot may be freed and taken by another request with other images: a rank
    replaying the driver's log (through the step channel's packing) holds what the driver holds."""
    from types import SimpleNamespace

    from ferrox.distributed.step_channel import pack, unpack
    from ferrox.multimodal.inputs import MultiModalItem
    from ferrox.worker.rank_images import ImageEventLog, RankImages

    def item(offset: int, value: float) -> MultiModalItem:
        return MultiModalItem.from_pixels(offset, 2, np.full((2, 3), value, dtype=np.float32), f"h{value}", grid=[1, 2, 4])

    model = SimpleNamespace(takes_images=True, mrope_merge_size=2)
    log, rank = ImageEventLog(), RankImages(model, torch.device("cpu"))
    so = SimpleNamespace(req_slots=[0, 3])
    log.add(0, 8, [item(1, 1.0)])
    log.add(3, 9, [item(2, 2.0), item(5, 3.0)])
    log.remove([0])
    log.add(0, 7, [item(4, 4.0)])
    log.add(1, 5, None)
    arrays = {"x": np.zeros(1)}
    log.drain_into(arrays, so)
    rank._replay(unpack(pack(arrays)))
    assert {s: [(i.offset, i.hash) for i in items] for s, items in rank.images._items.items()} == {
        0: [(4, "h4.0")], 3: [(2, "h2.0"), (5, "h3.0")]}
    assert rank.mrope is not None and sorted(rank.mrope._delta) == [0, 3]
    assert rank.images._items[3][1].pixel_values().eq(3.0).all()
    empty = {"x": np.zeros(1)}
    log.drain_into(empty, so)  # drained: the next step carries no events
    assert "mm_events" not in empty and list(empty["req_slots"]) == [0, 3]
