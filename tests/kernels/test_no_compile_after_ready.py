"""Nothing compiles after ready (worker/warmup.py).

CPU: the warm-up plan schedules, through the real core scheduler, one step of every shape class
(request-count and block-table-width classes, split-KV contexts, long prompts, mixed steps, eager
decodes), and running it through a real model runner leaves no trace: a warmed engine samples
exactly what a fresh one does. GPU: Triton's JIT hooks see a new variant compile, and serving
first-time shapes after an engine is ready (prefix hits, long prompts, mixed prefill and decode,
every CUDA-graph size, every sampling kind) compiles nothing, with and without CUDA graphs.

The compile counting itself has no CPU test: the Triton interpreter never calls the JIT hooks.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from ferrox import LLM, SamplingParams
from ferrox.worker.warmup import (
    LONG_QUERY_LENS,
    CompileWatch,
    EngineLimits,
    build_step,
    sampling_variants,
    warm_up,
    warmup_plan,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
cpu_only = pytest.mark.skipif(INTERPRETED, reason="no Triton kernel here: runs once, in the parent pytest")


def _cls(n: int) -> str:
    """Triton's specialisation class of an integer argument."""
    return "1" if n == 1 else "16k" if n % 16 == 0 else "other"


def _limits(engine, *, cuda_graphs: bool) -> EngineLimits:
    sched = engine.config
    max_num_seqs = sched.resolved_max_num_seqs(engine.device.type)
    return EngineLimits(max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=sched.resolved_max_num_batched_tokens(engine.device.type),
                        max_model_len=engine.max_model_len, block_size=engine.block_size,
                        num_blocks=engine.num_kv_blocks, decode_graph_max=max_num_seqs if cuda_graphs else 0)


# ---- the plan (CPU) ------------------------------------------------------------------------------
@cpu_only
@pytest.mark.parametrize("graph_max", [512, 0, 4], ids=["graphs", "eager", "graphs-to-4"])
def test_plan_covers_every_class_at_the_gpu_defaults(graph_max):
    """At the GPU defaults (512 sequences, 8192-token budget, 128k context) the steps the core
    schedules cover every (request count, block-table width) class, unsplit and split-KV, short and
    long queries, long prompts and mixed steps; eager decodes of the request counts no CUDA graph holds
    (all without graphs; past 4 with cudagraph_capture_sizes 1 2 4: the first past them and 16)."""
    limits = EngineLimits(512, 8192, 131072, 16, 1 << 20, graph_max)
    short, long_, chunks, mixed, decodes = set(), set(), [], set(), set()
    for recipe in warmup_plan(limits):
        step = build_step(recipe, limits, vocab_size=128256)  # raises if the core scheduled anything else
        so = step.so
        query = np.asarray(so.num_scheduled_tokens)
        seq = np.asarray(so.seq_lens)
        width = np.asarray(so.block_table).shape[1]
        assert int(np.asarray(so.block_table).max()) < step.num_blocks <= limits.num_blocks
        assert so.num_reqs <= limits.max_num_seqs and so.num_tokens <= limits.max_num_batched_tokens
        key = (_cls(so.num_reqs), _cls(width))
        if query.max() == 1:
            decodes.add(key)
        elif (query == 1).any():
            # Decodes lead; the prefill rows' slices of seq_lens / block_table (int32) start 16-byte
            # aligned when 4 | decodes, resp. 4 | decodes x width.
            d = int((query == 1).sum())
            mixed.add((int(query.max()) >= 256, d % 4 == 0, d * width % 4 == 0, int(seq.max()) >= 4096))
        elif seq.max() < 512:
            short.add(key)
        elif query.max() >= limits.max_num_batched_tokens // 2:
            chunks.append(int(seq.max() - query.max()))  # context before the chunk
        else:
            long_.add((*key, int(query.max())))
    every = {(n, w) for n in ("1", "other", "16k") for w in ("1", "other", "16k")}
    assert short == every
    assert long_ == {(n, w, q) for n in ("1", "other", "16k") for w in ("other", "16k") for q in LONG_QUERY_LENS}
    assert sorted(chunks) == [0, 8192]  # a whole-budget prompt, then its next chunk
    assert {m[:3] for m in mixed if m[0]} == {(True, False, False), (True, False, True), (True, True, True)}
    assert (False, False, False, False) in mixed and any(m[3] for m in mixed)  # short, and split-KV context
    eager = {"1", "other", "16k"} if graph_max == 0 else {"other", "16k"} if graph_max == 4 else set()
    assert decodes == {(n, w) for n, w in every if n in eager}


@cpu_only
@pytest.mark.parametrize("limits", [
    EngineLimits(8, 256, 1024, 16, 1000, 8),  # small budget: wide steps become prefix hits
    EngineLimits(4, 512, 4096, 32, 2000, 0),
    EngineLimits(1, 64, 300, 16, 40, 0),
    EngineLimits(256, 32, 256, 16, 4000, 0),  # eager decodes whose prompts exceed the budget together
    EngineLimits(64, 512, 4096, 16, 4000, 4),  # graphs up to 4 requests (cudagraph_capture_sizes 1 2 4)
])
def test_plan_fits_small_engines(limits):
    plan = warmup_plan(limits)
    assert plan
    for recipe in plan:
        step = build_step(recipe, limits, vocab_size=384)
        assert step.so.num_reqs <= limits.max_num_seqs
        assert step.so.num_tokens <= limits.max_num_batched_tokens
        assert max(np.asarray(step.so.seq_lens)) < limits.max_model_len


@cpu_only
@pytest.mark.parametrize("graph_max", [0, 4, 15, 64])
def test_plan_names_each_step_once(graph_max):
    """Decode steps past the captured graphs are planned once each, the first batch past them included
    (graphs to 15: 16 is that batch and one of the usual counts)."""
    names = [r.name for r in warmup_plan(EngineLimits(64, 8192, 4096, 16, 1 << 20, graph_max))]
    assert len(names) == len(set(names))
    decodes = {int(n.split()[1].split("x")[0]) for n in names if n.startswith("decode ")}
    assert decodes == {0: {1, 2, 16}, 4: {5, 16}, 15: {16}, 64: set()}[graph_max]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("warmup-llama")), hidden_size=64, num_layers=2)


PROMPTS = ["hello world", "the cat sat on", "one two three four", "a b c d e f g", "tiny model says"]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),  # the default generator
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, min_p=0.05, max_tokens=8, ignore_eos=True),
    ]


@cpu_only
def test_warm_up_leaves_no_trace(tiny_llama):
    """Every planned step runs through the real runner and sampler (CPU kernels), then the runner
    holds no request, the KV cache is all zeros again, and the engine samples exactly what a fresh
    one does (greedy, unseeded and seeded random, penalties, min-p, logprobs)."""
    kwargs = dict(device="cpu", kv_cache_memory=64 << 20, max_num_seqs=32, max_num_batched_tokens=1024, seed=7)
    warmed = LLM(tiny_llama, **kwargs)
    engine = warmed.engine
    assert engine.warmup is None  # the engine warms up on CUDA only
    limits = _limits(engine, cuda_graphs=False)
    report = warm_up(engine.runner, limits, vocab_size=engine.vocab_size, seed=7)
    plan = [r.name for r in warmup_plan(limits)]
    assert report.steps[: len(plan)] == plan and not report.skipped and len(plan) > 30
    assert len(report.steps) == len(plan) + len(sampling_variants(engine.vocab_size))
    assert all(state is None for state in engine.runner.input_batch.states)
    assert not any(kv.any() for kv in engine.runner.kv_caches)

    fresh = LLM(tiny_llama, **kwargs)
    params = _mixed_params()
    got = warmed.generate(PROMPTS, params, use_tqdm=False)
    want = fresh.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].outputs[0].logprobs == want[0].outputs[0].logprobs


@cpu_only
def test_warm_up_off_and_budget(tiny_llama, monkeypatch):
    """FERROX_WARMUP=0 runs nothing; past the time budget the remaining steps are skipped, by name."""
    llm = LLM(tiny_llama, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256)
    limits = _limits(llm.engine, cuda_graphs=True)
    monkeypatch.setenv("FERROX_WARMUP", "0")
    off = warm_up(llm.engine.runner, limits, vocab_size=llm.engine.vocab_size, seed=0)
    assert off.steps == [] and off.skipped == ["all (FERROX_WARMUP=0)"]
    monkeypatch.delenv("FERROX_WARMUP")
    none = warm_up(llm.engine.runner, limits, vocab_size=llm.engine.vocab_size, seed=0, budget_s=0.0)
    assert none.steps == []
    assert len(none.skipped) == len(warmup_plan(limits)) + len(sampling_variants(llm.engine.vocab_size))
    assert all("budget" in s for s in none.skipped)


# ---- GPU -----------------------------------------------------------------------------------------
@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


@pytest.mark.gpu
def test_compile_watch_sees_a_new_variant(cuda_device):
    """The hooks count a variant the process has not launched before (compiled, or loaded from the
    disk cache), and nothing for a launch of a known one."""
    x = torch.zeros(64, device=cuda_device)
    with CompileWatch() as first:
        _add_one[(1,)](x, 64, BLOCK=64)
        _add_one[(1,)](x, 64, BLOCK=64)
    assert first.available
    assert [e.kernel for e in first.events] == ["_add_one"], first.summary()
    with CompileWatch() as again:
        _add_one[(1,)](x, 64, BLOCK=64)
        _add_one[(1,)](x, 33, BLOCK=64)  # n % 16 != 0: another specialisation
    assert [e.kernel for e in again.events] == ["_add_one"], again.summary()
    torch.cuda.synchronize()
    assert x.tolist() == [4.0] * 33 + [3.0] * 31


def _first_time_traffic(llm: LLM, seed: int) -> None:
    """Prefix hits (short and long queries, 1 and 16 at once), a chunked long prompt, mixed prefill
    and decode steps, every CUDA-graph batch size and some off the ladder, each sampling kind and a
    grammar, then random mixes."""
    from ferrox.structured.params import StructuredOutputsParams

    rng = random.Random(seed)
    engine = llm.engine
    budget = engine.config.resolved_max_num_batched_tokens("cuda")
    max_seqs = engine.config.resolved_max_num_seqs("cuda")

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, engine.vocab_size) for _ in range(n)]

    def run(prompts: list[list[int]], params: list[SamplingParams]) -> None:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason is not None for o in outs)

    kinds = [
        dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.0, min_p=0.1), dict(temperature=1.0, seed=11), dict(temperature=0.0, logprobs=3),
        dict(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.3),
        dict(temperature=1.0, logit_bias={5: 4.0}, allowed_token_ids=[5, 6, 7], min_tokens=1),
        dict(temperature=0.0, prompt_logprobs=1),
    ]

    def params(n: int, max_tokens: int) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kinds[(i + rng.randrange(9)) % len(kinds)])
                for i in range(n)]

    long_prompt = ids(budget + budget // 2)
    run([long_prompt], params(1, 2))  # two chunks
    run([ids(2 * budget + 10)], params(1, 2))  # whole chunks: the second's context part takes its exact cuDNN plan
    run([long_prompt[: budget + 100] + ids(5)], params(1, 2))  # prefix hit, short query
    run([long_prompt[: budget + 100] + ids(120)], params(1, 2))  # prefix hit, query past the prefill-kernel cut
    run([long_prompt[:budget] + ids(3) for _ in range(16)], params(16, 2))  # 16 hits in one step
    run([ids(20), ids(budget - 100), ids(budget // 2)], params(3, 12))  # decodes beside prefill chunks
    ladder = engine.runner.graph_runner.batch_sizes if engine.runner.graph_runner is not None else [1, 2, 16, 64]
    for batch in sorted({*ladder, 3, 5, 13, min(33, max_seqs)}):
        run([ids(rng.randrange(4, 40)) for _ in range(batch)], params(batch, 4))
    grammar = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[a-z]{2,5}"))
    run([ids(10), ids(30)], [grammar, params(1, 6)[0]])
    for _ in range(4):
        n = rng.randrange(1, max_seqs + 1)
        run([ids(rng.randrange(2, budget // 4)) for _ in range(n)], params(n, rng.randrange(1, 6)))


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["all", "eager", "to-4"])
def test_first_time_shapes_compile_nothing_after_ready(cuda_device, tmp_path_factory, graphs):
    """Serve shapes this process has never run after the engine is ready: no Triton kernel (and no
    torch.compile graph) compiles -- with CUDA graphs, without, and with decode graphs for 1-4 requests
    only (cudagraph_capture_sizes: larger decode steps run eagerly). The engines have different head
    layouts, so none finds another's variants in the in-memory JIT cache."""
    from tests.helpers.tiny_models import make_tiny_llama

    shape = {"all": dict(hidden_size=256, num_heads=8), "eager": dict(hidden_size=192, num_heads=6),
             "to-4": dict(hidden_size=320, num_heads=10)}[graphs]
    folder = make_tiny_llama(str(tmp_path_factory.mktemp("warm")), num_layers=2, num_kv_heads=2,
                             intermediate_size=256, max_position_embeddings=8192, **shape)
    sizes = dict(cudagraph_capture_sizes=[1, 2, 4]) if graphs == "to-4" else {}
    llm = LLM(folder, device="cuda", enforce_eager=graphs == "eager", max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=8192, kv_cache_memory=1 << 30, **sizes)
    report = llm.engine.warmup
    assert report is not None and report.steps and not report.skipped, report
    with CompileWatch() as watch:
        _first_time_traffic(llm, seed=1)
    assert watch.available
    assert not watch.events, f"{watch.summary()}:\n" + "\n".join(e.signature for e in watch.events)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3", "qwen3_vl"])
def test_image_steps_compile_nothing_after_ready(cuda_device, tmp_path_factory, family):
    """Image steps run eagerly from input embeddings (Qwen's on [3, T] multimodal rotary positions, Gemma 3's
    through the torch attention with bidirectional image spans, Qwen3-VL's with DeepStack additions), cut across
    chunked-prefill steps: after ready they compile no Triton kernel either."""
    from PIL import Image

    from tests.helpers import tiny_models
    from tests.helpers.tiny_qwen3_vl import make_tiny_qwen3_vl

    folder = str(tmp_path_factory.mktemp(family))
    folder = {"qwen2_vl": tiny_models.make_tiny_qwen2_vl, "gemma3": tiny_models.make_tiny_gemma3_vision,
              "qwen3_vl": make_tiny_qwen3_vl}[family](folder)
    # 512: the tiny Gemma 3 checkpoint's max_position_embeddings (the smallest of the three).
    llm = LLM(folder, device="cuda", max_num_batched_tokens=64, max_model_len=512, kv_cache_memory=256 << 20)
    assert llm.engine.warmup is not None and llm.engine.warmup.steps
    rng = np.random.default_rng(3)
    images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 60), (90, 50), (33, 33))]
    chats = [[{"role": "user", "content": [*({"type": "image_pil", "image_pil": im} for im in ims),
                                           {"type": "text", "text": "What is this?"}]}]
             for ims in ([images[0]], [images[1], images[2]], [images[2]], images)]
    with CompileWatch() as watch:
        outs = llm.chat(chats, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        outs += llm.chat(chats[:1], SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True),
                         use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert watch.available
    assert not watch.events, f"{watch.summary()}:\n" + "\n".join(e.signature for e in watch.events)
