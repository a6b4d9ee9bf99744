"""The engine on a CUDA GPU (skipped without one): the same greedy tokens as on CPU in float32,
memory-profiled KV sizing, CUDA-graph decode (and vLLM's cudagraph modes and capture sizes), and every
sampling feature running on device."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

PROMPTS = ["hello world", "the cat sat on", "one two three", "a b c d e f g", "tiny model says"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("llama")), hidden_size=128, num_layers=2)


def test_gpu_float32_greedy_equals_cpu(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(tiny_llama, device="cpu", kv_cache_memory=32 << 20).generate(PROMPTS, params, use_tqdm=False)
    for eager in (True, False):  # plain forward, then decode steps replayed from CUDA graphs
        gpu = LLM(tiny_llama, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=8,
                  kv_cache_memory=64 << 20)
        outs = gpu.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cpu]


def test_seeded_draws_do_not_depend_on_the_batch(tiny_llama):
    """Seeded rows draw by (seed, steps sampled) in one launch (kernels/seeded_uniforms.py): the same
    tokens alone, beside plain random rows (the exponential-race path) and beside a top-p row (the
    top-k/top-p path, which redraws seeded rows by the race)."""
    llm = LLM(tiny_llama, device="cuda", max_num_seqs=16, gpu_memory_utilization=0.3)
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    for other in (SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_p=0.8, max_tokens=16, ignore_eos=True)):
        outs = llm.generate(PROMPTS, [seeded] + [other] * (len(PROMPTS) - 1), use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone
    reseeded = llm.generate(PROMPTS[0], seeded.clone(seed=12), use_tqdm=False)[0].outputs[0].token_ids
    assert reseeded != alone


def test_gpu_profiled_kv_and_sampling(tiny_llama):
    llm = LLM(tiny_llama, device="cuda", max_num_seqs=16, max_num_batched_tokens=1024,
              gpu_memory_utilization=0.3)
    assert llm.engine.num_kv_blocks > 1000  # sized from the profile, not a fixed default
    seeded = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=3, max_tokens=12,
                            ignore_eos=True)
    mixed = [
        seeded,
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5,
                       logit_bias={5: 3.0}, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, allowed_token_ids=[10, 11, 12], max_tokens=12, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, min_tokens=4),
    ]
    outs = llm.generate(PROMPTS, mixed, use_tqdm=False)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    lp = outs[1].outputs[0].logprobs
    assert lp is not None and len(lp) == 12 and outs[1].prompt_logprobs is not None
    assert set(outs[3].outputs[0].token_ids) <= {10, 11, 12}
    assert len(outs[4].outputs) == 2 and all(len(o.token_ids) >= 4 for o in outs[4].outputs)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - 1


def test_bad_words_and_named_logprobs_equal_cpu(tiny_llama):
    """bad_words of two tokens and logprob_token_ids on the GPU (async scheduling: a ban can hang on the
    token still in flight, decided on the device) give the CPU engine's tokens and logprobs."""
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cpu = LLM(tiny_llama, device="cpu", kv_cache_memory=32 << 20)
    free = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, plain, use_tqdm=False)]
    # Ban, per prompt, the pair its free output holds at positions 3-4 (first met at `first`), and one
    # token outright that the output holds later but not before that.
    firsts = [next(k for k in range(1, 5) if ids[k - 1:k + 1] == ids[3:5]) for ids in free]
    singles = [next((t for t in ids if t not in ids[:f + 1]), 3) for ids, f in zip(free, firsts, strict=True)]
    params = [plain.clone(bad_words_token_ids=[ids[3:5], [t]], logprob_token_ids=[1, ids[4], 7])
              for ids, t in zip(free, singles, strict=True)]
    ref = cpu.generate(PROMPTS, params, use_tqdm=False)
    gpu = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20)
    assert gpu.engine.async_scheduling
    outs = gpu.generate(PROMPTS, params, use_tqdm=False)
    for ids, first, t, r, o in zip(free, firsts, singles, ref, outs, strict=True):
        got = o.outputs[0].token_ids
        assert got == r.outputs[0].token_ids
        # The pair's second token is banned right after the first.
        assert got[:first] == ids[:first] and got[first] != ids[first] and t not in got
        for a, b in zip(r.outputs[0].logprobs, o.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_processed_logprobs_equal_cpu(tiny_llama):
    """--logprobs-mode processed_logprobs on the GPU: a penalized greedy row and a random top-k row report
    what their draw saw, as the CPU engine does (the greedy row's tokens too)."""
    params = [SamplingParams(temperature=0, max_tokens=8, logprobs=3, repetition_penalty=1.4, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=8, logprobs=3, ignore_eos=True)]
    cpu = LLM(tiny_llama, device="cpu", kv_cache_memory=32 << 20, logprobs_mode="processed_logprobs")
    gpu = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20,
              logprobs_mode="processed_logprobs")
    ref = cpu.generate(PROMPTS[:2], params, use_tqdm=False)
    outs = gpu.generate(PROMPTS[:2], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    for a, b in zip(ref[0].outputs[0].logprobs, outs[0].outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    for pos in outs[1].outputs[0].logprobs:  # top-k 5: five finite alternatives at most, the rest -inf
        assert sum(v.logprob > float("-inf") for v in pos.values()) <= 5 and all(v.rank <= 5 for v in pos.values()
                                                                                  if v.rank is not None)


def test_a_second_engine_in_one_process_captures_its_graphs(tmp_path, caplog):
    """Two engines one after the other in one process (a notebook, a test module's parametrized fixture):
    the first, dropped but not yet collected, must not make the second's CUDA-graph captures fail (they
    did, on the H200: the second engine then ran every step eagerly, with only an error in the log)."""
    import logging

    from tests.helpers.tiny_models import make_tiny_qwen3

    folder = make_tiny_qwen3(tmp_path / "qwen3", qwen_tokens=True)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level(logging.ERROR):
        for async_scheduling in (False, True):  # as tests/engine/test_thinking_budget.py builds them
            llm = LLM(folder, reasoning_parser="deepseek_r1", async_scheduling=async_scheduling, max_model_len=256,
                      kv_cache_memory=16 << 20)
            llm.generate([[5, 6, 7]] * 3, params, use_tqdm=False)
            assert llm.engine.runner.graph_runner is not None
            assert llm.engine.runner.forward.piece_runner is not None
            del llm
    assert "capture failed" not in caplog.text, caplog.text[-3000:]


def test_num_gpu_blocks_override_sizes_the_cuda_cache(tiny_llama):
    """vLLM's num_gpu_blocks_override: the cache gets exactly that many blocks instead of the profiled count,
    and generation runs in it (a request that outgrows it preempts, as with any small cache)."""
    llm = LLM(tiny_llama, device="cuda", num_gpu_blocks_override=24, max_model_len=256, max_num_seqs=8)
    assert llm.engine.num_kv_blocks == 24 and llm.engine.sleeper is None
    assert int(llm.engine.runner.kv_caches[0].shape[1]) == 24
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)


# ---- vLLM's cudagraph_mode and capture sizes (ferrox/compilation_config.py; parsing: tests/test_compilation_config.py):
# each mode captures what it names at the sizes asked for, steps past them run eagerly, every mode generates
# the CPU's greedy tokens (float32).
@pytest.fixture(scope="module")
def cpu_tokens(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = LLM(tiny_llama, device="cpu", kv_cache_memory=32 << 20).generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kwargs,decode,pieces", [
    (dict(), [1, 2, 4, 8], [8, 16, 32, 48, 64]),
    (dict(compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}, cudagraph_capture_sizes=[1, 2]), [1, 2], []),
    (dict(compilation_config={"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 16}), [], [8, 16]),
    # piecewise graphs not of one token (ferrox's one-token path has no attention call to cut around):
    # such a step pads to 4
    (dict(cudagraph_capture_sizes=[1, 4, 32]), [1, 4], [4, 32]),
    (dict(max_cudagraph_capture_size=4), [1, 2, 4], [4]),
    (dict(compilation_config={"mode": 0}), [], []),  # vLLM: no piecewise compilation, no graphs
    (dict(compilation_config={"cudagraph_mode": "NONE"}), [], []),
], ids=["default", "full-decode-only", "piecewise", "sizes", "max", "mode-0", "none"])
def test_modes_capture_what_they_name(tiny_llama, cpu_tokens, kwargs, decode, pieces):
    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=64,
              kv_cache_memory=64 << 20, **kwargs)
    forward = llm.engine.runner.forward
    assert forward.decode_graph_sizes() == decode
    assert forward.piecewise_graph_sizes() == pieces
    # 5 prompts: decode batches of 5 and fewer (past 2 or 4 eager where those are the graphs' top)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens


def test_capture_sizes_reach_verify_and_draft_graphs(tiny_llama, cpu_tokens):
    """With a draft model, the target's verify graphs and the draft's own graphs take the decode sizes too;
    larger batches (5 prompts) verify and draft eagerly, with the same greedy tokens."""
    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20,
              cudagraph_capture_sizes=[1, 2], speculative_config={"method": "draft_model", "model": tiny_llama,
                                                                  "num_speculative_tokens": 3})
    assert llm.engine.runner.graph_runner.batch_sizes == [1, 2]
    assert llm.engine.runner.graph_runner.verify_sizes == [1, 2]
    assert llm.engine.drafter is not None and llm.engine.drafter.graphs.batch_sizes == [1, 2]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens
    one = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert one[0].outputs[0].token_ids == cpu_tokens[0]  # batch 1: the graphs


# ---- vLLM's cpu_offload_gb (loader/cpu_offload.py): parameters in host memory the GPU reads in place.
@pytest.mark.parametrize("gib", [0.0005, 10.0], ids=["some", "all"])
def test_cpu_offload_keeps_greedy_tokens(tiny_llama, cpu_tokens, gib):
    from ferrox.loader.cpu_offload import is_host_mapped, offloaded_bytes

    llm = LLM(tiny_llama, device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory=64 << 20, cpu_offload_gb=gib)
    model = llm.engine.runner.model
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    offloaded = offloaded_bytes(model)
    assert 0 < offloaded <= gib * (1 << 30)
    assert is_host_mapped(params[0])  # the first registered (the embedding) goes first
    if gib == 10.0:
        assert offloaded == total and all(is_host_mapped(p) for p in params)
    else:
        assert offloaded < total
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cpu_tokens  # CUDA graphs read host memory too
