"""LoRA on the Mamba2 hybrids, Granite 4.0-H (models/granitemoehybrid.py) and Nemotron-H (models/nemotron_h.py), on
tiny random checkpoints (tests/helpers/tiny_granitemoehybrid.py) with two PEFT adapters each (tests/lora/adapters.py
FAMILIES: the attention, the Mamba2 in_proj and out_proj, the shared / ReLU^2 MLPs). The model-level mixed batch
against transformers + peft merged is tests/lora/test_lora_families.py's, tensor parallelism
test_lora_families_engine.py's; here:

- each checkpoint projection, fed through the family's lora_rewrite as a lora_B, lands in the rows its loader gave
  the layer (in_proj's five segments, Granite's input_linear cut, residual_multiplier through output_scale);
- the real engine (Rust scheduler, state rows per request, chunked prefill under a 16-token budget) serving the base
  model and both adapters in one batch: each request's greedy tokens equal transformers' with its adapter merged;
- modules LoRA is not built for (MoE experts, routers, the conv) refused naming the tensor.
"""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.lora.adapter import LoRAAdapterError
from ferrox.lora.manager import LoRAManager
from ferrox.lora.request import LoRARequest

from tests.helpers.tiny_models import EOS_TOKEN_ID, load_float32
from tests.lora.adapters import assert_lora_rows_follow_the_loader, merged_greedy, write_adapter
from tests.models.conftest import cut_at_eos

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

HYBRIDS = ["granitemoehybrid", "nemotron_h"]
PROMPTS = [[(7 * i) % 300 + 3 for i in range(30)], [1, 77, 78, 5], [5, 9, 11, 40, 41]]
MAX_TOKENS = 6


@pytest.mark.parametrize("name", HYBRIDS)
def test_adapter_rows_follow_the_loader(lora_checkpoint, name):
    assert_lora_rows_follow_the_loader(lora_checkpoint(name)[0])


@pytest.mark.parametrize("name", HYBRIDS)
def test_engine_mixed_batch_matches_peft_merged(lora_checkpoint, name):
    folder, base, adapters = lora_checkpoint(name)
    refs = merged_greedy(base, adapters, PROMPTS, MAX_TOKENS, EOS_TOKEN_ID)
    names = ["a1", "base", "a2", "a2", "a1", "base"]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(names))]
    llm = LLM(folder, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory=8 << 20)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False,
                            lora_request=[adapters.get(n) for n in names])
    finally:
        llm.engine.shutdown()
    got = [cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID]) for o in outs]
    assert got == [refs[n][i % len(PROMPTS)] for i, n in enumerate(names)]
    assert refs["a1"] != refs["base"] and refs["a2"] != refs["base"]  # (the adapters do change the answers)


@pytest.mark.parametrize("name, module, shape, match", [
    ("granitemoehybrid", "model.layers.0.block_sparse_moe.router.layer", (4, 32), "not a projection of this model"),
    ("granitemoehybrid", "model.layers.0.mamba.conv1d", (128, 4), "not a projection of this model"),
    ("granitemoehybrid", "model.layers.0.mamba.in_proj", (192, 32), r"shape \(192, 4\), model expects \(196, 4\)"),
    ("nemotron_h", "backbone.layers.2.mixer.experts.0.up_proj", (24, 32), "not a projection of this model"),
    ("nemotron_h", "backbone.layers.0.mixer.conv1d", (128, 4), "not a projection of this model"),
])
def test_what_lora_does_not_apply_to_is_refused_by_name(lora_checkpoint, tmp_path, name, module, shape, match):
    folder = lora_checkpoint(name)[0]
    manager = LoRAManager(load_float32(folder), max_loras=1, max_lora_rank=8, max_cpu_loras=None, device="cpu",
                          dtype=torch.float32, max_num_tokens=8)
    adapter = write_adapter(tmp_path / "adapter", {module: shape})
    tensor = f"base_model.model.{module}.lora_"
    with pytest.raises(LoRAAdapterError, match=f"tensor '{tensor}[AB].weight'.*{match}"):
        manager.add_adapter(LoRARequest("x", 1, adapter))
    assert manager.list_adapters() == []
