"""A random PEFT adapter on the embedded SmolLM2: ferrox's greedy tokens with the adapter (base and
adapter requests in one batch) equal transformers' with the adapter merged by peft."""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams
from ferrox.lora.request import LoRARequest

from tests.lora.adapters import make_peft_adapter, merged_reference
from tests.models.conftest import cut_at_eos, hf_greedy

pytest.importorskip("peft")


def test_embedded_model_with_adapter_matches_peft(hf_smollm, smollm_tokenizer, smollm_source, tmp_path):
    folder = make_peft_adapter(hf_smollm, tmp_path / "adapter", r=8, lora_alpha=32,
                               target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], seed=3)
    merged = merged_reference(hf_smollm, folder)
    prompts = [smollm_tokenizer.encode("The capital of France is"), smollm_tokenizer.encode("def fibonacci(n):")]
    # float32: the reference's precision (the default keeps the GGUF's weights quantized on CPU).
    llm = LLM(dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=64 << 20, max_model_len=512)
    eos = llm.engine.eos_token_ids
    want_base = [cut_at_eos(hf_greedy(hf_smollm, p, 8), eos) for p in prompts]
    want_lora = [cut_at_eos(hf_greedy(merged, p, 8), eos) for p in prompts]
    assert want_base != want_lora, "the adapter should change the output"

    adapter = LoRARequest("smol-adapter", 1, folder)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], SamplingParams(temperature=0, max_tokens=8),
                        lora_request=[None, None, adapter, adapter], use_tqdm=False)
    got = [cut_at_eos(list(o.outputs[0].token_ids), eos) for o in outs]
    assert got == want_base + want_lora
