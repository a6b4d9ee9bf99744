"""Multi-LoRA through the whole engine on families whose loader rewrites projection rows (lora/rewrite.py): the
hybrid Qwen3.5 (recurrent states, prefix caching by state snapshots) and GLM-4-0414, each request's greedy tokens
against transformers + peft with its adapter merged.

- Prefix caching on a hybrid: a snapshot of the recurrent states is keyed by the prefix hash of the block it ends
  on, which the request's adapter seeds (rust/prefix_cache.rs root_hash). The same prompt under the base model,
  then under two adapters, then under all three again: the adapters' first run hits nothing the base model left
  (a hit would hand them its states and K/V), the last run resumes each request from its own snapshots.
- Tensor parallelism (2 gloo ranks): each rank packs its share of each adapter, the hybrid's linear attention cut
  by key-head groups as its weights are (MergedLinear.checkpoint_rows), GLM-4's permuted q/k rows by heads, the
  Mamba2 hybrids' in_proj B by heads and B / C groups in each of its five segments.
- On a GPU (CUDA graphs, default settings), the hybrids' answers (Qwen3.5, Granite 4.0-H, Nemotron-H) as the CPU
  engine's.
"""

from __future__ import annotations

import pytest
from ferrox import LLM, SamplingParams

from tests.helpers.tiny_models import EOS_TOKEN_ID
from tests.lora.adapters import merged_greedy
from tests.models.conftest import cut_at_eos

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# 40 tokens: two full 16-token blocks on the 16-token snapshot grid, then a tail; and a short one.
PROMPTS = [[(7 * i) % 300 + 3 for i in range(40)], [1, 77, 78, 5]]
MAX_TOKENS = 8
COMMON = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_num_seqs=8)


@pytest.fixture(scope="module")
def hybrid(lora_checkpoint):
    """(folder, {"a1", "a2": LoRARequest}, {"base", "a1", "a2": greedy tokens per prompt from transformers})."""
    folder, base, adapters = lora_checkpoint("qwen3_5")
    return folder, adapters, merged_greedy(base, adapters, PROMPTS, MAX_TOKENS, EOS_TOKEN_ID)


def _greedy(llm, prompts, loras):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [cut_at_eos(list(o.outputs[0].token_ids), [EOS_TOKEN_ID]) for o in outs]


def test_prefix_cache_hits_stay_with_their_adapter_on_a_hybrid(hybrid):
    folder, adapters, refs = hybrid
    prompt = PROMPTS[0]
    llm = LLM(folder, kv_cache_memory=8 << 20, mamba_block_size=16, **COMMON)
    try:
        assert _greedy(llm, [prompt], None) == [refs["base"][0]]
        assert _greedy(llm, [prompt, prompt], [adapters["a1"], adapters["a2"]]) == [refs["a1"][0], refs["a2"][0]]
        restored, _, _ = llm.engine.scheduler.state_snapshot_counts
        assert restored == 0 and llm.engine.stats()["prefix_cache_hits"] == 0  # (nothing of the base model's)
        names = ["a2", "base", "a1"]
        assert _greedy(llm, [prompt] * 3, [adapters.get(n) for n in names]) == [refs[n][0] for n in names]
        restored, _, _ = llm.engine.scheduler.state_snapshot_counts
        assert restored == 3 and llm.engine.stats()["prefix_cache_hits"] == 3 * 32  # (each its own, at 32 of 40)
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5", "glm4", "granitemoehybrid", "nemotron_h"])
def test_sharded_adapters_match_peft_merged(lora_checkpoint, hybrid, name):
    """Two gloo ranks, base and both adapters mixed in one batch, chunked prefill (16-token budget)."""
    if name == "qwen3_5":
        folder, adapters, refs = hybrid
    else:
        folder, base, adapters = lora_checkpoint(name)
        refs = merged_greedy(base, adapters, PROMPTS, MAX_TOKENS, EOS_TOKEN_ID)
    names = ["a1", "base", "a2", "a2", "a1", "base"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    llm = LLM(folder, tensor_parallel_size=2, device="cpu", kv_cache_memory=8 << 20, max_num_batched_tokens=16,
              **COMMON)
    try:
        got = _greedy(llm, prompts, [adapters.get(n) for n in names])
    finally:
        llm.engine.shutdown()
    assert got == [refs[n][i % len(PROMPTS)] for i, n in enumerate(names)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_5", "granitemoehybrid", "nemotron_h"])
def test_cuda_engine_matches_cpu(lora_checkpoint, name):
    """The hybrid with LoRA on CUDA (default settings: CUDA graphs, the Triton LoRA kernels, async scheduling)
    against the CPU engine: each request's greedy tokens and logprobs, then the same prompts again, resumed from
    each adapter's own state snapshots. (Not the `hybrid` fixture: its transformers reference cannot run on a GPU
    machine whose transformers takes fla's Triton kernels for Qwen3.5's layers, CPU tensors included.)"""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, _, adapters = lora_checkpoint(name)
    names = ["a1", "base", "a2", "a2", "a1", "base"]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(names))]
    loras = [adapters.get(n) for n in names]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(folder, device=device, kv_cache_memory=32 << 20, mamba_block_size=16, **COMMON)
        try:
            outs[device] = [o.outputs[0] for _ in range(2)
                            for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]
            assert llm.engine.scheduler.state_snapshot_counts[0] > 0  # (the second round resumed)
        finally:
            llm.engine.shutdown()
    for cpu, cuda in zip(outs["cpu"], outs["cuda"], strict=True):
        assert list(cuda.token_ids) == list(cpu.token_ids)
        for a, b, t in zip(cpu.logprobs, cuda.logprobs, cpu.token_ids, strict=True):
            assert abs(a[t].logprob - b[t].logprob) < 2e-3
