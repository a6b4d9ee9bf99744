"""Qwen3.5 / Qwen3.6 and Qwen3-Next (models/qwen3_5.py: Gated DeltaNet layers with per-request recurrent states,
gated full attention) against transformers on tiny random checkpoints (tests/helpers/tiny_qwen3_5.py: three
linear-attention layers then one full-attention layer, partial rotary, grouped value heads; prompts of 3, 40 and
70 tokens, the last crossing the delta rule's 64-token chunk).

The model's own forward over a paged cache and a state pool (tests/helpers/driver.py): last-prompt logits and
greedy tokens, chunked prefill (the states carried between chunks) and batching; the real engine (Rust scheduler,
state rows handed out per request, chunked prefill under a 16-token budget, preemption by recompute) against
transformers' logprobs; the multimodal checkpoint's language model; the refusals; LoRA adapters' rows following the
loader's; tensor parallelism (2 gloo ranks, the engine against transformers; one rank's shard against the whole
model); on a GPU, the CUDA engine (fla's kernels, CUDA graphs over the state rows) against the CPU one."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.model_spec import UnsupportedModelError
from ferrox.worker.recurrent_states import StateRows

from tests.helpers import tiny_qwen3_5
from tests.helpers.tiny_models import EOS_TOKEN_ID, models_with_references
from tests.models.conftest import (
    assert_chunking_and_batching_keep_tokens,
    assert_greedy_and_logits_match,
    assert_outputs_match_transformers,
    chunked_engine_outputs,
)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

PROMPTS = [[5, 9, 11], list(range(3, 43)), [(7 * i) % 300 + 3 for i in range(70)]]
FAMILIES = {"qwen3_5": (tiny_qwen3_5.make_tiny_qwen3_5, "Qwen3_5ForCausalLM"),
            "qwen3_5_moe": (tiny_qwen3_5.make_tiny_qwen3_5_moe, "Qwen3_5MoeForCausalLM"),
            "qwen3_next": (tiny_qwen3_5.make_tiny_qwen3_next, "Qwen3NextForCausalLM")}


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
    return models_with_references(tmp_path_factory.mktemp("qwen3_5"), {k: v[0] for k, v in FAMILIES.items()},
                                  references={k: v[1] for k, v in FAMILIES.items()})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_and_logits_match_transformers(tiny, name):
    _, model, ref = tiny[name]
    assert_greedy_and_logits_match(model, ref, PROMPTS, [EOS_TOKEN_ID], max_tokens=8, label=name)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_chunked_prefill_and_batching_do_not_change_tokens(tiny, name):
    """Chunks of 7 carry the conv and delta-rule states between steps; a prompt alone gets the same tokens."""
    _, model, _ = tiny[name]
    assert_chunking_and_batching_keep_tokens(model, PROMPTS, slice(2, 3))


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_engine_chunked_prefill_matches_transformers(tiny, name):
    folder, _, ref = tiny[name]
    assert_outputs_match_transformers(ref, PROMPTS, chunked_engine_outputs(folder, PROMPTS))


def test_engine_preemption_recomputes_the_states(tiny):
    """A KV cache of 12 blocks for 6 requests of 40-70 tokens: requests are preempted and recomputed (fresh state
    rows, from their first token or a state snapshot), with n-gram drafts verified beside them; every output equals
    the one computed with room to spare and no drafts, no block leaks."""
    folder, model, _ = tiny["qwen3_5"]
    prompts = [[(5 * i + 11 * j) % 300 + 3 for j in range(40 + 6 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    per_block = kv_cache_bytes_per_block(model.spec, 16, torch.float32)

    def run(blocks: int, **kw) -> tuple[list[list[int]], LLM]:
        llm = LLM(model=folder, dtype="float32", max_num_batched_tokens=64, max_num_seqs=6, max_model_len=128,
                  kv_cache_memory=per_block * blocks, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], llm

    roomy, llm = run(64)
    llm.engine.shutdown()
    tight, llm = run(12, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                              "prompt_lookup_min": 1})
    try:
        assert tight == roomy
        assert llm.engine.stats()["num_preemptions"] > 0
        assert llm.engine.stats()["spec_num_drafts"] > 0
        stats = llm.engine.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1  # (no block leaked)
        # (the next step's schedule reports them finished: their rows come back; the new request holds one)
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
        assert len(llm.engine.runner.state_rows.row_of) <= 1
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rows_come_back_when_the_engine_goes_idle(tiny, async_scheduling):
    """An async engine's last schedule after its requests end runs nothing but reports them finished: their state
    rows must come back then (they were lost, and an engine serving max_num_seqs requests at a time failed its
    next round with "no free row"). Rounds of max_num_seqs requests, idle between them, answers unchanged."""
    folder = tiny["qwen3_5"][0]
    prompts = [{"prompt_token_ids": [(7 * i + j) % 300 + 3 for j in range(5 + 3 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(model=folder, dtype="float32", max_num_seqs=4, max_model_len=128, kv_cache_memory=8 << 20,
              async_scheduling=async_scheduling)
    try:
        rounds = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                  for _ in range(3)]
        assert rounds[0] == rounds[1] == rounds[2]
        llm.engine.step()  # (an idle step: its schedule reports what finished last)
        assert llm.engine.runner.state_rows.row_of == {}
    finally:
        llm.engine.shutdown()


def test_state_rows_follow_the_schedule():
    """Rows go to scheduled requests, come back on finish and preemption, and row 0 (scratch) is never given."""

    class Step:
        def __init__(self, req_ids, finished=(), preempted=()):
            self.req_ids, self.finished_req_ids, self.preempted_req_ids = list(req_ids), list(finished), list(preempted)

    rows = StateRows(max_num_seqs=3)
    assert rows.for_step(Step(["a", "b"])).tolist() == [1, 2]
    assert rows.for_step(Step(["a", "b", "c"])).tolist() == [1, 2, 3]
    with pytest.raises(RuntimeError, match="no free row"):
        rows.for_step(Step(["a", "b", "c", "d"]))
    # b finished, c preempted: d and c (resumed) take rows again, a keeps its own.
    got = rows.for_step(Step(["a", "d"], finished=["b"], preempted=["c"])).tolist()
    assert got[0] == 1 and got[1] in (2, 3)
    assert 0 not in rows.for_step(Step(["a", "d", "c"])).tolist()


def test_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Qwen3_5ForConditionalGeneration's text (model.language_model.* weights, text_config with mrope fields):
    the engine's greedy tokens and logprobs are transformers' on text prompts."""
    folder = tiny_qwen3_5.make_tiny_qwen3_5_multimodal(tmp_path / "mm")
    ref = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    assert_outputs_match_transformers(ref, PROMPTS[:2], chunked_engine_outputs(folder, PROMPTS[:2]))


@pytest.fixture(scope="module")
def repeating(tiny, tmp_path_factory):
    """The tiny Qwen3.5 with its residual branches scaled by 0.3 and lm_head = the embedding: its greedy answers
    fall into runs of one token (so n-gram drafts are accepted as well as rejected), while every layer and state
    still moves its logprobs."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("repeating") / "model"
    shutil.copytree(tiny["qwen3_5"][0], folder)
    for path in folder.glob("*.safetensors"):
        weights = load_file(path)
        for name in weights:
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                weights[name] = weights[name] * 0.3
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
        save_file(weights, path, metadata={"format": "pt"})
    return str(folder)


SPEC_PROMPTS = [[5, 9, 11, 13] * 6, [(7 * i) % 40 + 3 for i in range(37)], [21, 22] * 9]
SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def _spec_outputs(folder: str, **kw):
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, mamba_block_size=16, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], SPEC_PARAMS, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm.engine.stats()
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def plain_repeating(repeating):
    return _spec_outputs(repeating)[0]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculative_decoding_keeps_the_accepted_drafts_states(repeating, plain_repeating, async_scheduling):
    """n-gram drafts, about half accepted: each verify step keeps the state after every draft (draft rows) and the
    request goes on from the accepted one's, so the greedy tokens and logprobs are those of the engine without
    drafts (with state snapshots on a 16-token grid beside them)."""
    spec, stats = _spec_outputs(repeating, async_scheduling=async_scheduling, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3})
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert_same_answers(plain_repeating, spec, 1e-4)


@pytest.mark.parametrize("setting, match", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 3}},
     "num_speculative_tokens: at most 15"),
    ({"mamba_cache_mode": "all"}, "mamba_cache_mode: 'all'"),
    ({"mamba_cache_mode": "align", "enable_prefix_caching": False}, "mamba_cache_mode: 'align'"),
    ({"mamba_block_size": 24}, "mamba_block_size: must be a multiple of block_size"),
    ({"mamba_block_size": 32, "enable_prefix_caching": False}, "mamba_block_size: the grid"),
])
def test_what_the_states_cannot_follow_is_refused_by_name(tiny, setting, match):
    folder, _, _ = tiny["qwen3_5"]
    with pytest.raises(ValueError, match=match):
        LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, **setting)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lora_rows_follow_the_loader(tiny, name):
    """An adapter's lora_B rows go through the loader's row edits (partial-rotary q/k rows, in_proj_qkv cut into q /
    k / v, Qwen3-Next's fused projections cut): each checkpoint weight fed through lora_rewrite lands where the
    loader put it, on both token mixers' projections. (Against transformers + peft, the engine with prefix caching:
    tests/lora/test_lora_families*.py.)"""
    from tests.lora.adapters import assert_lora_rows_follow_the_loader

    assert_lora_rows_follow_the_loader(tiny[name][0])


def test_prefix_caching_resumes_from_state_snapshots(tiny):
    """vLLM's mamba_cache_mode 'align' on a 16-token grid: a conversation's second turn (the first's prompt, its
    answer and 5 new tokens) and a repeated prompt resume from the states kept where steps ended on the grid (the
    first prompt's chunk cut at 64 of 70, a decode ending at 80), and get the tokens and logprobs of an engine that
    computes every prompt from its first token."""
    folder, _, _ = tiny["qwen3_5"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    first = PROMPTS[2]

    def run(**kw):
        llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, **kw)
        try:
            one = llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)[0].outputs[0]
            turn2 = [*first, *one.token_ids, 5, 9, 13, 17, 19]
            outs = llm.generate([{"prompt_token_ids": p} for p in (turn2, first)], params, use_tqdm=False)
            return [one, *(o.outputs[0] for o in outs)], llm.engine.stats(), llm.engine.scheduler.state_snapshot_counts
        finally:
            llm.engine.shutdown()

    cached, stats, counts = run(mamba_block_size=16)
    fresh, fresh_stats, none = run(mamba_cache_mode="none")
    assert none is None and fresh_stats["prefix_cache_hits"] == 0
    restored, saved, _ = counts
    assert restored == 2 and saved >= 3
    # (turn 2 resumes at 80 of 87 tokens, the repeat at 64 of 70)
    assert stats["prefix_cache_hits"] == 80 + 64
    assert_same_answers(cached, fresh, 1e-4)


# ---- GPU ------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_cuda_engine_matches_cpu(tiny, name):
    """float32 on CUDA (fla's chunked and recurrent delta-rule kernels, decode CUDA graphs reading the state rows,
    async scheduling) against the CPU engine: each of 12 concurrent prompts' greedy tokens and logprobs, then their
    second turns (prompt, answer, one more token), which resume from state snapshots on a 16-token grid (restored
    before the forward, saved after it; under async scheduling, decode saves keyed a step late)."""
    folder, _, _ = tiny[name]
    batch = [[(7 * i + j * 13) % 300 + 3 for j in range(5 + 9 * (i % 9))] for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    outs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(model=folder, dtype="float32", device=device, kv_cache_memory=32 << 20, max_num_batched_tokens=64,
                  mamba_block_size=16)
        try:
            first = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            turn2 = [[*p, *o.outputs[0].token_ids, 5] for p, o in zip(batch, first, strict=True)]
            outs[device] = first + llm.generate([{"prompt_token_ids": p} for p in turn2], params, use_tqdm=False)
            assert llm.engine.scheduler.state_snapshot_counts[0] >= 8  # (restored: the second turns resumed)
        finally:
            llm.engine.shutdown()
    assert_same_answers(outs["cpu"], outs["cuda"], 2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_speculative_decoding_matches_cpu(repeating):
    """n-gram drafts on CUDA (async scheduling; verify steps keeping each draft's state through the one-launch
    recurrence, replayed as CUDA graphs whatever each request's draft count -- pad rows past a query's live tokens
    leave its state alone, worker/cuda_graphs.py --; decode graphs between them) against the CPU engine without
    drafts: greedy tokens and logprobs."""
    outs = {}
    verify_steps: list[tuple[int, int]] = []  # (requests, tokens) of each verify step replayed

    for device, spec in (("cpu", None), ("cuda", {"method": "ngram", "num_speculative_tokens": 3,
                                                  "prompt_lookup_max": 3})):
        llm = LLM(model=repeating, dtype="float32", device=device, kv_cache_memory=32 << 20,
                  speculative_config=spec)
        try:
            if spec:
                graphs = llm.engine.runner.graph_runner
                run = graphs.run

                def counting(input_ids, positions, meta, run=run):
                    if not meta.decode_only:
                        verify_steps.append((meta.num_reqs, input_ids.shape[0]))
                    return run(input_ids, positions, meta)

                graphs.run = counting
            outs[device] = llm.generate([{"prompt_token_ids": p} for p in SPEC_PROMPTS], SPEC_PARAMS, use_tqdm=False)
            if spec:
                assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
        finally:
            llm.engine.shutdown()
    assert_same_answers(outs["cpu"], outs["cuda"], 2e-3)
    # (queries of different lengths in one replayed step: requests with fewer than 3 drafts beside others)
    assert any(tokens != 4 * reqs for reqs, tokens in verify_steps), verify_steps


# ---- tensor parallelism ---------------------------------------------------------------------------
@pytest.mark.slow
# (Two shapes end to end: the MoE model under expert parallelism runs the attention and linear layers sharded too,
# Qwen3-Next its split fused projections and sharded experts; each rank's weights are checked below.)
@pytest.mark.parametrize(("name", "expert_parallel"), [("qwen3_5_moe", True), ("qwen3_next", False)],
                         ids=["qwen3_5_moe-expert-parallel", "qwen3_next"])
def test_tensor_parallel_matches_transformers(tiny, name, expert_parallel):
    """Two ranks (gloo): each holds one of the two linear-attention key heads with its two value heads (its
    state rows that wide), two of the four query heads and one KV head, half of each expert's rows (or four
    whole experts) and of the shared expert's; the chunked engine's tokens and logprobs as transformers'. The last
    prompt comes again: it resumes from a state snapshot (16-token grid) that every rank saved, and restores."""
    folder, _, ref = tiny[name]
    # (Qwen3-Next also verifies n-gram drafts: every rank keeps the accepted draft's state with the driver's counts)
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16, max_num_seqs=4,
              tensor_parallel_size=2, enable_expert_parallel=expert_parallel, mamba_block_size=16,
              speculative_config=spec if name == "qwen3_next" else None)
    try:
        params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outs += llm.generate([{"prompt_token_ids": PROMPTS[2]}], params, use_tqdm=False)
        if name == "qwen3_next":
            assert llm.engine.stats()["spec_num_drafts"] > 0
    finally:
        llm.engine.shutdown()
    assert outs[-1].num_cached_tokens == 64
    assert_outputs_match_transformers(ref, [*PROMPTS, PROMPTS[2]], outs)


def _load_rank(folder: str, rank: int, size: int):
    """Rank `rank` of `size` loaded as its engine process loads it (lazy safetensors slices), in this process."""
    from ferrox.distributed.parallel_state import TPGroup, use_tp_group
    from ferrox.loader.model_loader import load_model, load_model_spec
    from ferrox.loader.source import resolve_model

    source = resolve_model(folder)
    with use_tp_group(TPGroup(rank=rank, size=size)):
        return load_model(source, load_model_spec(source), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_rank_holds_its_heads_and_states_of_their_width(tiny, name):
    """Rank 1 of 2: linear attention key head 1 (rows 16-31 of q and of k) and value heads 2-3 (rows 16-31 of v
    and z, 2-3 of b and a, A_log and dt_bias), the conv kernel's matching channels of each of its q / k / v
    blocks, out_proj's columns of those value heads, state pools [rows, 48, 3] and [rows, 2, 16, 8]; full
    attention query heads 2-3 (each [q | gate]: rows 64-127) and KV head 1. Qwen3-Next's fused projections
    split into the same rows."""
    from ferrox.worker.recurrent_states import allocate_recurrent_states

    folder, _, _ = tiny[name]
    whole, part = _load_rank(folder, 0, 1), _load_rank(folder, 1, 2)
    a, b = whole.model.layers[0].linear_attn, part.model.layers[0].linear_attn
    assert a.state_shapes() == ((96, 3), (4, 16, 8))
    assert b.state_shapes() == ((48, 3), (2, 16, 8))
    # qkvz_proj rows: q 0-31 | k 32-63 | v 64-95 | z 96-127; ba_proj rows: b 0-3 | a 4-7
    rows = [*range(16, 32), *range(48, 64), *range(80, 96), *range(112, 128)]
    torch.testing.assert_close(b.qkvz_proj.weight, a.qkvz_proj.weight[rows], rtol=0, atol=0)
    torch.testing.assert_close(b.ba_proj.weight, a.ba_proj.weight[[2, 3, 6, 7]], rtol=0, atol=0)
    torch.testing.assert_close(b.conv1d.weight, a.conv1d.weight[rows[:48]], rtol=0, atol=0)
    torch.testing.assert_close(b.A_log, a.A_log[2:], rtol=0, atol=0)
    torch.testing.assert_close(b.dt_bias, a.dt_bias[2:], rtol=0, atol=0)
    torch.testing.assert_close(b.norm.weight, a.norm.weight, rtol=0, atol=0)  # (one head wide: replicated)
    torch.testing.assert_close(b.out_proj.weight, a.out_proj.weight[:, 16:], rtol=0, atol=0)
    fa, fb = whole.model.layers[3].self_attn, part.model.layers[3].self_attn
    assert (fb.num_heads, fb.num_kv_heads) == (2, 1)
    qkv = [*range(64, 128), *range(128 + 16, 160), *range(160 + 16, 192)]
    torch.testing.assert_close(fb.qkv_proj.weight, fa.qkv_proj.weight[qkv], rtol=0, atol=0)
    torch.testing.assert_close(fb.o_proj.weight, fa.o_proj.weight[:, 32:], rtol=0, atol=0)
    allocate_recurrent_states(part, 2, 0, torch.float32, torch.float32, torch.device("cpu"))
    assert tuple(b.conv_states.shape) == (3, 48, 3) and tuple(b.ssm_states.shape) == (3, 2, 16, 8)


def test_unsplittable_linear_attention_heads_are_refused_by_name(tiny, tmp_path):
    """One linear-attention key head (serving all four value heads) cannot go to two ranks: refused before the
    ranks start, naming the field."""
    from tests.helpers.config_edit import copy_with_config

    folder = copy_with_config(tiny["qwen3_5"][0], tmp_path / "one_key_head", linear_num_key_heads=1)
    with pytest.raises(UnsupportedModelError, match=r"linear_num_key_heads \(1\) is not divisible by "
                                                    r"tensor_parallel_size \(2\)"):
        LLM(model=folder, dtype="float32", tensor_parallel_size=2, kv_cache_memory=1 << 20)
