"""Gemma 4 under tensor parallelism (models/gemma4.py): two gloo rank processes on the CPU generate what one
process does, on tiny random float32 checkpoints (tests/models/test_gemma4.py's builder).

- "per_layer_kv_shared": sliding layers of 2 KV heads (one a rank) and full layers of 1 (head_dim 32, k = v:
  replicated on both ranks), so the two cache shapes are each a rank's own; E2B/E4B's per-layer embeddings
  (a vocabulary-parallel table) and KV-sharing layers (queries split over their source layer's heads) and the
  double-wide MLP of those layers.
- "moe": 26B-A4B's block, in a Gemma4ForConditionalGeneration checkpoint that takes images: the 4 experts sharded
  by their intermediate rows (16 of 32 a rank), and with --enable-expert-parallel split 2 + 2 (per_expert_scale
  applied by global expert id); a prompt with an image (its rows cut over several chunks of the step budget), the
  vision tower's layers sharded over the ranks (--mm-encoder-tp-mode weights), or whole on each rank with the
  images split among them ('data', with the expert-parallel run).

Greedy tokens equal, logprobs within 1e-4; the long prompts are prefilled in chunks of a 16-token budget and
pass the 16-token window. One engine per TP size (and expert placement) per model. A rank's shard is also
checked against the whole model, and the splits that cannot work are refused by name. On two GPUs (skipped
elsewhere) the same models over NCCL against one GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from ferrox.attention.kv_cache import kv_cache_shape
from ferrox.distributed.parallel_state import TPGroup, use_tp_group
from ferrox.distributed.sharding import check_tp_shapes
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import UnsupportedModelError
from ferrox.models.gemma4 import Gemma4ForCausalLM

from tests.helpers.tiny_gemma4 import make_tiny_gemma4
from tests.models.test_gemma4 import PROMPTS

pytest.importorskip("transformers")

BUILDERS = {"per_layer_kv_shared": {"per_layer": True, "kv_shared": 2}, "moe": {"moe": True, "images": True}}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4_tp")
    return {name: make_tiny_gemma4(root / name, seed=60 + i, **kind)
            for i, (name, kind) in enumerate(BUILDERS.items())}


def _generate(folder: str, tp: int, device: str = "cpu", **kw) -> list[tuple[list[int], list[float]]]:
    """(greedy tokens, their logprobs) of each prompt."""
    import numpy as np
    from ferrox import LLM, SamplingParams
    from PIL import Image

    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
    prompts: list[dict] = [{"prompt_token_ids": p} for p in PROMPTS]
    if os.path.exists(os.path.join(folder, "preprocessor_config.json")):  # a checkpoint that takes images
        image = Image.fromarray(np.random.default_rng(4).integers(0, 255, (30, 100, 3), dtype=np.uint8))
        prompts.append({"prompt": "Look: <|image|> what is it?", "multi_modal_data": {"image": image}})
    llm = LLM(model=folder, device=device, dtype="float32", tensor_parallel_size=tp, kv_cache_memory=8 << 20,
              max_num_batched_tokens=16, max_model_len=256, **kw)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
            for o in outs]


def _assert_same(reference, sharded, atol: float = 1e-4) -> None:
    for (tokens, lps), (tp_tokens, tp_lps) in zip(reference, sharded, strict=True):
        assert list(tp_tokens) == list(tokens)
        torch.testing.assert_close(torch.tensor(tp_lps), torch.tensor(lps), atol=atol, rtol=0)


def test_per_layer_kv_shared_tp2_matches_tp1(folders):
    folder = folders["per_layer_kv_shared"]
    _assert_same(_generate(folder, 1), _generate(folder, 2))


def test_moe_tp2_matches_tp1(folders):
    """The experts sharded by intermediate rows (vLLM's default), then split by count (expert parallel, the
    vision tower whole on each rank: --mm-encoder-tp-mode data)."""
    folder = folders["moe"]
    reference = _generate(folder, 1)
    assert len(reference) == len(PROMPTS) + 1  # (the image prompt)
    _assert_same(reference, _generate(folder, 2))
    _assert_same(reference, _generate(folder, 2, enable_expert_parallel=True, mm_encoder_tp_mode="data"))


def _load_rank(folder: str, rank: int, size: int, expert_parallel: bool = False):
    """Rank `rank` of `size` loaded as its engine process loads it (nothing at load talks to the other ranks)."""
    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=rank, size=size, expert_parallel=expert_parallel)):
        return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


def test_a_rank_holds_its_heads_and_experts(folders):
    """Rank 1 of 2 against the whole model: query heads 2-3 everywhere; a sliding layer's second KV head, a full
    layer's one KV head whole (replicated), a KV-sharing layer's queries only; its cache shapes those heads'.
    The experts: intermediate rows 16-31 of each (gate and up, and down's columns), or experts 2 and 3 whole."""
    folder = folders["per_layer_kv_shared"]
    whole, rank1 = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2)
    q_rows = {0: slice(32, 64), 2: slice(64, 128), 4: slice(32, 64)}  # heads 2-3 of head_dim 16 / 32
    kv_rows = {0: [slice(64 + 16, 64 + 32), slice(64 + 32 + 16, 64 + 64)],  # K head 1, V head 1
               2: [slice(128, 160), slice(160, 192)]}  # the one K head (and V = K) whole
    for layer in (0, 2, 4):
        full, part = (m.model.layers[layer].self_attn for m in (whole, rank1))
        rows = [q_rows[layer], *kv_rows.get(layer, [])]
        want = torch.cat([full.qkv_proj.weight[r] for r in rows])
        torch.testing.assert_close(part.qkv_proj.weight, want, atol=0, rtol=0)
        assert (part.num_heads, part.num_kv_heads) == (2, 1)
    spec = rank1.spec
    assert [kv_cache_shape(spec, 3, 8, 2, i)[3:] for i in range(spec.num_layers)] == [
        (1, 16), (1, 16), (1, 32), (1, 16), (1, 1), (1, 1)]

    folder = folders["moe"]
    whole = _load_rank(folder, 0, 1).model.layers[0].experts
    sharded, split = (_load_rank(folder, 1, 2, ep).model.layers[0].experts for ep in (False, True))
    gate_up = torch.cat([whole.w13[:, 16:32], whole.w13[:, 48:64]], dim=1)  # rows 16-31 of gate, then of up
    torch.testing.assert_close(sharded.w13, gate_up, atol=0, rtol=0)
    torch.testing.assert_close(sharded.w2, whole.w2[:, :, 16:32], atol=0, rtol=0)
    torch.testing.assert_close(split.w13, whole.w13[2:4], atol=0, rtol=0)
    torch.testing.assert_close(split.w2, whole.w2[2:4], atol=0, rtol=0)


def test_unsplittable_shapes_are_refused_by_name(folders):
    """A full layer's own KV heads that split neither way fail at start naming the layer (executor/launch.py
    checks before any rank starts); the experts' intermediate size counts only when they are sharded by it."""
    spec = load_model_spec(resolve_model(folders["per_layer_kv_shared"]))
    odd = dataclasses.replace(spec, num_heads=6, layer_kv_shapes=((2, 16), (2, 16), (3, 32)) * 2)
    with pytest.raises(UnsupportedModelError, match=r"layer 2 has 3 KV heads .* tensor_parallel_size \(2\)"):
        check_tp_shapes(odd, 2)
    spec = load_model_spec(resolve_model(folders["moe"]))
    assert spec.moe is not None
    odd = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, intermediate_size=33))
    with pytest.raises(UnsupportedModelError, match=r"moe_intermediate_size \(33\)"):
        with use_tp_group(TPGroup(rank=0, size=2)):
            Gemma4ForCausalLM(odd, torch.float32, "cpu")
    with use_tp_group(TPGroup(rank=0, size=2, expert_parallel=True)):
        experts = Gemma4ForCausalLM(odd, torch.float32, "cpu").model.layers[0].experts
    assert (experts.num_local_experts, experts.intermediate_size) == (2, 33)


# ---- GPU (two) --------------------------------------------------------------------------------------
def _generate_in_new_process(folder: str, **kw) -> list[tuple[list[int], list[float]]]:
    """_generate on two GPUs in a child process: a tensor-parallel engine's NCCL group lives until its process
    exits."""
    code = ("import json; from tests.models.test_gemma4_tp import _generate; "
            f"print('RESULT', json.dumps(_generate({folder!r}, 2, device='cuda', **{kw!r})))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize(("name", "kw"), [("per_layer_kv_shared", {}), ("moe", {}),
                                          ("moe", {"enable_expert_parallel": True})])
def test_tp2_on_cuda_matches_one_gpu(folders, name, kw):
    """Two GPUs over NCCL (the all-reduces inside the captured CUDA graphs, the Triton attention over each
    layer's per-rank cache shape, the fused MoE kernels on each rank's experts) against one GPU, float32."""
    _assert_same(_generate(folders[name], 1, device="cuda"), _generate_in_new_process(folders[name], **kw),
                 atol=1e-3)
