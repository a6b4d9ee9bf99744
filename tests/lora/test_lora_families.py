"""LoRA on the families whose loader rewrites projection rows (lora/rewrite.py: each adapter's lora_B goes through
the family's lora_rewrite) against transformers + peft with the adapter merged: a mixed batch of base-model rows and
two adapters' rows, prefill then decode, every position's logits.

- Qwen3.5 (hybrid): partial-rotary q/k rows of the gated attention ([q | gate] rows per head), in_proj_qkv cut
  into q / k / v, adapters on both token mixers' projections and the dense MLP;
- Qwen3-Next: the fused in_proj_qkvz / in_proj_ba cut per key-head group;
- GLM-4-0414: interleaved partial-rotary q/k rows, the fused gate_up_proj cut into gate and up;
- GLM-4.5 (MoE): half-split partial-rotary q/k rows with q/k norms (its MTP layer's tensors dropped at load);
- Llama 4 (text): q/k rows from interleaved pairs to halves, adapters on the attention and the dense layers.
With the rewrite skipped, the q/k (and cut) rows land in the wrong places and every adapter row here differs.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.lora.adapter import LoRAAdapterError
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest

from tests.helpers.driver import StepRequest, bind_recurrent_states, build_step
from tests.helpers.tiny_models import load_float32
from tests.lora.adapters import FAMILIES, merged_reference

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

BLOCK = 4
PROMPTS = [[5, 17, 99, 3, 42, 7, 11], [8, 120, 66, 9], [250, 31, 77, 12, 4, 6], [19, 56, 201]]
LORA_IDS = [0, 1, 2, 1]  # base, a1, a2, a1 in one batch


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, lora_checkpoint):
    """(ferrox model with a LoRAManager holding a1 and a2, {lora id: transformers reference}, plain ferrox model)."""
    folder, base, adapters = lora_checkpoint(request.param)
    model = load_float32(folder)
    manager = LoRAManager(model, max_loras=2, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                          dtype=torch.float32, max_num_tokens=64)
    for adapter in adapters.values():
        manager.add_adapter(adapter)
    references = {0: base, **{r.lora_int_id: merged_reference(base, r.lora_path) for r in adapters.values()}}
    return model, manager, references, load_float32(folder)


@torch.inference_mode()
def run_logits(model, manager: LoRAManager | None, prompts: list[list[int]], lora_ids: list[int]) -> list[torch.Tensor]:
    """float32 logits [len(prompt), vocab] of every prompt position: all prompts but their last token prefilled in one
    mixed step, then one decode step of the last tokens (a hybrid model's states in rows 1..n)."""
    caches = allocate_kv_caches(model.spec, 1 + 3 * len(prompts), BLOCK, torch.float32, "cpu")
    bind_recurrent_states(model, len(prompts))
    tables = [[1 + 3 * i, 2 + 3 * i, 3 + 3 * i] for i in range(len(prompts))]
    steps = [[StepRequest(p[:-1], 0, t, i + 1) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))],
             [StepRequest(p[-1:], len(p) - 1, t, i + 1) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]]
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for reqs in steps:
        ids, pos, meta = build_step(reqs, BLOCK)
        if manager is not None:
            manager.prepare_step(np.repeat(lora_ids, [len(r.token_ids) for r in reqs]))
        logits = model.compute_logits(model(ids, pos, caches, meta))
        for i, (lo, hi) in enumerate(zip(meta.query_start_loc_cpu[:-1], meta.query_start_loc_cpu[1:], strict=True)):
            rows[i].append(logits[lo:hi])
    return [torch.cat(r) for r in rows]


@torch.inference_mode()
def hf_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0].float()


def test_mixed_batch_matches_peft_merged(family):
    model, manager, references, plain = family
    got = run_logits(model, manager, PROMPTS, LORA_IDS)
    base_rows = run_logits(plain, None, PROMPTS, LORA_IDS)
    for lora_id, prompt, logits, plain_logits in zip(LORA_IDS, PROMPTS, got, base_rows, strict=True):
        torch.testing.assert_close(logits, hf_logits(references[lora_id], prompt), atol=2e-4, rtol=2e-4)
        if lora_id == 0:  # base rows pass through the wrapped layers untouched (an MoE layer groups the batch's
            # rows by expert, which other rows' adapters change: equal to rounding)
            torch.testing.assert_close(logits, plain_logits, atol=1e-5, rtol=1e-5)
        else:  # and the adapters do change the output
            assert not torch.allclose(logits, plain_logits, atol=1e-2)


def _edited_adapter(source: str, dest, edit) -> str:
    """A copy of the PEFT folder `source` whose tensors are `edit(tensors)`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, dest)
    path = os.path.join(dest, "adapter_model.safetensors")
    save_file(edit(load_file(path)), path)
    return os.fspath(dest)


def test_multimodal_names_and_what_no_layer_takes(lora_checkpoint, tmp_path):
    """An adapter trained on the multimodal checkpoint names the layers model.language_model.layers.N: packed as the
    text model's (the family's checkpoint prefixes); one on the vision tower, or with rows that do not fit, is
    refused naming the tensor."""
    folder, _, adapters = lora_checkpoint("qwen3_5")
    a1 = adapters["a1"].lora_path
    manager = LoRAManager(load_float32(folder), max_loras=1, max_lora_rank=8, max_cpu_loras=3, device="cpu",
                          dtype=torch.float32, max_num_tokens=8)
    prefix = "base_model.model.model."
    multimodal = _edited_adapter(a1, tmp_path / "mm", lambda t: {
        k.replace(prefix, prefix + "language_model.", 1): v for k, v in t.items()})
    manager.add_adapter(LoRARequest("text", 1, a1))
    manager.add_adapter(LoRARequest("mm", 2, multimodal))
    for text, mm in zip(manager._cache[1].weights, manager._cache[2].weights, strict=True):
        assert text is not None and mm is not None and all(map(torch.equal, text, mm))

    tower = "base_model.model.model.visual.blocks.0.attn.qkv.lora_"
    vision = _edited_adapter(a1, tmp_path / "vision", lambda t: {
        **t, tower + "A.weight": torch.zeros(8, 64), tower + "B.weight": torch.zeros(192, 8)})
    with pytest.raises(LoRAAdapterError, match=r"'.*visual.blocks.0.attn.qkv.lora_B.weight' adapts .* does not run "
                                               r"with LoRA"):
        manager.add_adapter(LoRARequest("vision", 3, vision))
    short = _edited_adapter(a1, tmp_path / "short", lambda t: {
        k: v[:-8] if "layers.0.linear_attn.in_proj_qkv.lora_B" in k else v for k, v in t.items()})
    with pytest.raises(LoRAAdapterError, match=r"'.*layers.0.linear_attn.in_proj_qkv.lora_B.weight' shape \(88, 8\) "
                                               r"does not fit this model's rows"):
        manager.add_adapter(LoRARequest("short", 4, short))
    assert [r.lora_int_id for r in manager.list_adapters()] == [1, 2]
