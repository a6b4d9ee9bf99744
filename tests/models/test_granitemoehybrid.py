"""Mamba2 hybrids: IBM Granite 4.0-H (models/granitemoehybrid.py: Mamba2 layers with per-request conv and SSM states, NoPE or
rotary attention, a shared MLP plus routed experts, Granite's multipliers folded at load) against transformers on
tiny random checkpoints (tests/helpers/tiny_granitemoehybrid.py: mamba, attention, mamba, mamba; prompts of 3, 40
and 70 tokens, the last crossing the scan's 64-token chunk), and Nemotron-H (models/nemotron_h.py: M * - M -) on the
same mixer.

The model's own forward over a paged cache and a state pool (tests/helpers/driver.py): last-prompt logits and greedy
tokens, chunked prefill (the states carried between chunks) and batching; the real engine (Rust scheduler, state
rows handed out per request, chunked prefill under a 16-token budget, prefix caching resuming from state snapshots,
preemption by recompute beside n-gram drafts) against transformers' logprobs; the refusals; on a GPU, the CUDA
engine (the one-launch recurrence, fla's chunked scan, CUDA graphs over the state rows) against the CPU one."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block

from tests.helpers.tiny_granitemoehybrid import make_tiny_granitemoehybrid, make_tiny_nemotron_h
from tests.helpers.tiny_models import EOS_TOKEN_ID, models_with_references
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
)

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(70)]]
# dense: NoPE attention (the releases'), the shared MLP only; moe: rotary attention, 4 routed experts beside it;
# nemotron_h: Nemotron-H's single-mixer blocks (models/nemotron_h.py) on the same Mamba2 mixer.
FAMILIES = {"dense": lambda folder: make_tiny_granitemoehybrid(folder),
            "moe": lambda folder: make_tiny_granitemoehybrid(folder, experts=4, rope=True, seed=1),
            "nemotron_h": lambda folder: make_tiny_nemotron_h(folder, seed=2)}


def assert_same_answers(expected, got, tol: float) -> None:
    """Each completion's greedy tokens equal, and each sampled token's logprob (logprobs=0) within tol."""
    for a, b in zip(expected, got, strict=True):
        a, b = getattr(a, "outputs", [a])[0], getattr(b, "outputs", [b])[0]
        assert list(a.token_ids) == list(b.token_ids)
        for la, lb, t in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(la[t].logprob - lb[t].logprob) < tol


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, ferrox model, transformers model), float32 on the CPU."""
    return models_with_references(tmp_path_factory.mktemp("granitemoehybrid"), FAMILIES)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [EOS_TOKEN_ID], max_tokens=6, label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    """Chunks of 7 carry the conv and SSM states between steps; a prompt alone gets the same tokens."""
    _, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, slice(2, 3))


def test_engine_chunked_prefill_matches_transformers(tiny):
    folder, _, ref = tiny["moe"]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS))


def test_prefix_caching_resumes_from_state_snapshots(tiny):
    """A 16-token grid of state snapshots: the same prompt twice (the second resumes at 64 of its 70 tokens, from
    the state kept there) and a second turn (prompt, answer, 3 more tokens) get the tokens and logprobs of an engine
    that computes every prompt from its first token, which match transformers'."""
    folder, _, ref = tiny["dense"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    first = PROMPTS[2]

    def run(**kw):
        llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, **kw)
        try:
            one = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0]
            turn2 = [*first, *one.outputs[0].token_ids, 5, 9, 13]
            outs = llm.generate([{"prompt_token_ids": p} for p in (first, turn2)], params, use_tqdm=False)
            return [one, *outs], turn2, llm.engine.stats()
        finally:
            llm.engine.shutdown()

    cached, turn2, stats = run(mamba_block_size=16)
    fresh, _, fresh_stats = run(mamba_cache_mode="none")
    assert fresh_stats["prefix_cache_hits"] == 0
    assert cached[1].num_cached_tokens == 64 and cached[2].num_cached_tokens == 64
    assert_same_answers(cached, fresh, 1e-4)
    assert_outputs_match_transformers(ref, [first, first, turn2], cached)


def test_engine_preemption_and_ngram_drafts_keep_the_tokens(tiny):
    """A KV cache of 8 blocks for 5 requests of 30-54 tokens, with n-gram drafts verified beside them: requests are
    preempted and recomputed (fresh state rows), verify steps keep each draft's state and go on from the accepted
    one's; every output equals the one computed with room to spare and no drafts."""
    folder, model, _ = tiny["moe"]
    prompts = [[(5 * i + 11 * j) % 40 + 3 for j in range(30 + 6 * i)] for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    per_block = kv_cache_bytes_per_block(model.spec, 16, torch.float32)

    def run(blocks: int, **kw) -> tuple[list[list[int]], dict]:
        llm = LLM(model=folder, dtype="float32", max_num_batched_tokens=64, max_num_seqs=5, max_model_len=128,
                  kv_cache_memory=per_block * blocks, **kw)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs], llm.engine.stats()
        finally:
            llm.engine.shutdown()

    roomy, _ = run(64)
    tight, stats = run(8, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                              "prompt_lookup_min": 1})
    assert tight == roomy
    assert stats["num_preemptions"] > 0
    assert stats["spec_num_drafts"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1  # (no block leaked)


# (FP8 runs, and what is not FP8 is refused: tests/models/test_granitemoehybrid_fp8.py; LoRA on the attention, Mamba2
# and shared MLP layers runs: tests/lora/test_lora_mamba2.py)
@pytest.mark.parametrize("module, shape", [("model.layers.0.block_sparse_moe.input_linear", (48, 32)),
                                           ("model.layers.1.block_sparse_moe.router.layer", (4, 32))])
def test_lora_on_the_experts_is_refused_by_name(tiny, tmp_path, module, shape):
    from ferrox.lora.adapter import LoRAAdapterError
    from ferrox.lora.manager import LoRAManager
    from ferrox.lora.request import LoRARequest

    from tests.helpers.tiny_models import load_float32
    from tests.lora.adapters import write_adapter

    manager = LoRAManager(load_float32(tiny["moe"][0]), max_loras=1, max_lora_rank=8, max_cpu_loras=None,
                          device="cpu", dtype=torch.float32, max_num_tokens=8)
    with pytest.raises(LoRAAdapterError, match=rf"adapts '{module}', not a projection of this model"):
        manager.add_adapter(LoRARequest("experts", 1, write_adapter(tmp_path, {module: shape})))


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_engine_matches_cpu(tiny, name):
    """float32 on CUDA (the one-launch recurrence for decodes, fla's chunked scan or the torch one for prefill
    chunks, decode CUDA graphs reading the state rows, async scheduling) against the CPU engine: each of 12
    concurrent prompts' greedy tokens and logprobs, then their second turns, which resume from state snapshots on a
    16-token grid. The decode steps replay CUDA graphs."""
    folder, _, _ = tiny[name]
    batch = [[(7 * i + j * 13) % 300 + 3 for j in range(5 + 9 * (i % 9))] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    replays: list[int] = []
    for device in ("cpu", "cuda"):
        llm = LLM(model=folder, dtype="float32", device=device, kv_cache_memory=32 << 20, max_num_batched_tokens=64,
                  mamba_block_size=16)
        try:
            if device == "cuda":
                graphs = llm.engine.runner.graph_runner
                run = graphs.run

                def counting(input_ids, positions, meta, run=run):
                    replays.append(meta.num_reqs)
                    return run(input_ids, positions, meta)

                graphs.run = counting
            first = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            turn2 = [[*p, *o.outputs[0].token_ids, 5] for p, o in zip(batch, first, strict=True)]
            outs[device] = first + llm.generate([{"prompt_token_ids": p} for p in turn2], params, use_tqdm=False)
            assert llm.engine.scheduler.state_snapshot_counts[0] >= 8  # (restored: the second turns resumed)
        finally:
            llm.engine.shutdown()
    assert replays, "no decode step replayed a CUDA graph"
    assert_same_answers(outs["cpu"], outs["cuda"], 2e-3)


def test_config_json_ssm_state_dtype_is_honoured_under_auto():
    """Nemotron-H's releases name mamba_ssm_cache_dtype float32 in config.json: --mamba-ssm-cache-dtype auto takes
    it (as vLLM does), an explicit flag wins, and a value that is no dtype is refused naming the field."""
    import torch
    from ferrox.worker.recurrent_states import state_dtypes

    named = {"mamba_ssm_cache_dtype": "float32"}
    assert state_dtypes("auto", "auto", torch.bfloat16, named) == (torch.bfloat16, torch.float32)
    assert state_dtypes("auto", "bfloat16", torch.bfloat16, named) == (torch.bfloat16, torch.bfloat16)
    assert state_dtypes("auto", "auto", torch.bfloat16, {}) == (torch.bfloat16, torch.bfloat16)
    with pytest.raises(ValueError, match="config.json: mamba_ssm_cache_dtype 'fp7'"):
        state_dtypes("auto", "auto", torch.bfloat16, {"mamba_ssm_cache_dtype": "fp7"})
