"""A ferrox Llama with a LoRAManager against transformers + peft (each adapter merged into the
weights with merge_and_unload): batches mixing base-model requests and requests of different
adapters (ranks 8, 4 with rsLoRA and per-module patterns, and a q/v-only one) in one forward,
prefill and decode, with more adapters than GPU slots so they swap in and out."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from ferrox.attention.decode_path import DecodePath
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.loader.model_loader import load_model, load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest
from ferrox.models.registry import get_model_class

from tests.helpers.driver import StepRequest, build_step
from tests.helpers.tiny_models import make_tiny_llama
from tests.kernels.kernel_refs import relative_error
from tests.lora.adapters import load_hf_model, make_peft_adapter, merged_reference

pytest.importorskip("transformers")
pytest.importorskip("peft")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 4
PROMPTS = [[5, 17, 99, 3, 42, 7], [8, 120, 66, 9], [250, 31, 77, 12, 4], [19, 56, 201], [33, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(base folder, transformers base model, {adapter id: folder})."""
    root = tmp_path_factory.mktemp("lora_model")
    folder = make_tiny_llama(root / "base", seed=7)
    base = load_hf_model(folder)
    adapters = {
        1: make_peft_adapter(base, root / "a1", r=8, lora_alpha=16, seed=1),
        2: make_peft_adapter(base, root / "a2", r=4, lora_alpha=8, use_rslora=True, seed=2,
                             rank_pattern={"o_proj": 2}, alpha_pattern={"down_proj": 3.0}),
        3: make_peft_adapter(base, root / "a3", r=8, lora_alpha=8, target_modules=("q_proj", "v_proj"), seed=3),
    }
    return folder, base, adapters


def _ferrox_model(folder, device: torch.device, kernels: str = "torch"):
    source = resolve_model(folder)
    spec = load_model_spec(source)
    model = load_model(source, spec, dtype=torch.float32, device="cpu")
    if kernels == "torch" and device.type == "cpu":
        return model
    other = get_model_class([spec.architecture])(spec, torch.float32, device, kernels=kernels)
    other.load_state_dict(model.state_dict())
    other.finalize_weights()
    return other.eval()


def _manager(model, adapters, device: torch.device, max_loras: int = 2) -> LoRAManager:
    manager = LoRAManager(model, max_loras=max_loras, max_lora_rank=8, max_cpu_loras=None if max_loras >= 3 else 3,
                          device=device, dtype=torch.float32, max_num_tokens=64)
    for lora_id, path in adapters.items():
        manager.add_adapter(LoRARequest(f"adapter{lora_id}", lora_id, path))
    return manager


@torch.inference_mode()
def _run(model, manager: LoRAManager | None, prompts: list[list[int]], lora_ids: list[int],
         device: torch.device) -> list[torch.Tensor]:
    """float32 logits of every prompt position: all prompts but their last token prefilled in one
    mixed step, then one decode step of the last tokens. Returns [len(prompt), vocab] per prompt."""
    caches = allocate_kv_caches(model.spec, 1 + 2 * len(prompts), BLOCK, torch.float32, device)
    tables = [[1 + 2 * i, 2 + 2 * i] for i in range(len(prompts))]
    steps = [[StepRequest(p[:-1], 0, t) for p, t in zip(prompts, tables, strict=True)],
             [StepRequest(p[-1:], len(p) - 1, t) for p, t in zip(prompts, tables, strict=True)]]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for reqs in steps:
        ids, pos, meta = build_step(reqs, BLOCK, device)
        if manager is not None:
            manager.prepare_step(np.repeat(lora_ids, [len(r.token_ids) for r in reqs]))
        logits = model.compute_logits(model(ids, pos, caches, meta)).cpu()
        for i, (lo, hi) in enumerate(zip(meta.query_start_loc_cpu[:-1], meta.query_start_loc_cpu[1:], strict=True)):
            rows[i].append(logits[lo:hi])
    return [torch.cat(r) for r in rows]


@torch.inference_mode()
def _hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def test_mixed_batches_match_peft_merged(tiny):
    folder, base, adapters = tiny
    cpu = torch.device("cpu")
    plain = _ferrox_model(folder, cpu)
    model = _ferrox_model(folder, cpu)
    manager = _manager(model, adapters, cpu)
    assert type(model.model.decode_path) is DecodePath
    references = {0: base, **{i: merged_reference(base, path) for i, path in adapters.items()}}

    # Two slots, three adapters: the second batch needs adapter 3, which takes adapter 1's slot (the
    # least recently used one not in the batch); the third brings adapter 1 back, alone (T = 1 decode).
    batches = [([0, 1, 2, 1], PROMPTS[:4]), ([3, 0, 2], PROMPTS[1:4]), ([1], PROMPTS[4:])]
    for lora_ids, prompts in batches:
        got = _run(model, manager, prompts, lora_ids, cpu)
        base_rows = _run(plain, None, prompts, lora_ids, cpu)
        for lora_id, prompt, logits, plain_logits in zip(lora_ids, prompts, got, base_rows, strict=True):
            torch.testing.assert_close(logits, _hf_logits(references[lora_id], prompt), atol=1e-4, rtol=1e-4)
            if lora_id == 0:  # base rows pass through the wrapped layers untouched
                assert torch.equal(logits, plain_logits)
            else:  # and the adapters do change the output
                assert not torch.allclose(logits, plain_logits, atol=1e-2)
        slots = [manager.slot_of(i) for i in set(lora_ids) - {0}]
        assert None not in slots and len(set(slots)) == len(slots)
    assert manager.slot_of(2) is None  # evicted by adapter 1 in the last batch (LRU: 3 was used later)
    assert {manager.slot_of(1), manager.slot_of(3)} == {0, 1}


def test_triton_kernel_set(tiny):
    """The Triton kernel set (GPU path; on CPU in tests/kernels/test_interpreter.py's child)
    against the torch kernel set, with the same adapters and batches; includes one-token steps,
    which the Triton backend would run in fused kernels without LoRA."""
    if torch.cuda.is_available() and not INTERPRETED:
        device = torch.device("cuda")
    elif INTERPRETED:
        device = torch.device("cpu")
    else:
        pytest.skip("the Triton kernel set on CPU runs in the interpreter child (tests/kernels/test_interpreter.py)")
    folder, _, adapters = tiny
    ref_model = _ferrox_model(folder, torch.device("cpu"))
    ref = _manager(ref_model, adapters, torch.device("cpu"))
    model = _ferrox_model(folder, device, kernels="triton")
    manager = _manager(model, adapters, device)
    for lora_ids, prompts in [([0, 1, 2, 1], PROMPTS[:4]), ([3, 0, 2], PROMPTS[1:4]), ([1], PROMPTS[4:])]:
        expected = _run(ref_model, ref, prompts, lora_ids, torch.device("cpu"))
        got = _run(model, manager, prompts, lora_ids, device)
        for e, g in zip(expected, got, strict=True):
            assert relative_error(g, e) < 1e-4
            assert torch.equal(g.argmax(-1), e.argmax(-1))


@pytest.mark.gpu
def test_cuda_graph_replays_after_slot_swaps(tiny):
    """A projection captured in a CUDA graph replays with the slots of later steps, including an
    adapter copied into a slot after the capture (the buffers are rewritten in place)."""
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    folder, _, adapters = tiny
    model = _ferrox_model(folder, device, kernels="triton")
    manager = _manager(model, adapters, device)
    layers = [manager.layers[0], manager.layers[3]]  # layer 0's qkv_proj (3 slices) and down_proj
    xs = [torch.randn(8, layer.in_features, device=device) for layer in layers]
    manager.prepare_step(np.array([1, 1, 0, 2, 2, 2, 0, 1]))
    with torch.inference_mode():
        for layer, x in zip(layers, xs, strict=True):
            layer(x)  # warm up (Triton compiles outside the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [layer(x) for layer, x in zip(layers, xs, strict=True)]
        for lora_ids in ([3, 0, 0, 2, 3, 3, 2, 0], [0] * 8, [1] * 5 + [0] * 3):  # 3 evicts 1; then 1 is back
            manager.prepare_step(np.array(lora_ids))
            graph.replay()
            for layer, x, out in zip(layers, xs, outs, strict=True):
                torch.testing.assert_close(out, layer(x), atol=0, rtol=0)
