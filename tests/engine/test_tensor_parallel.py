"""Tensor parallelism on CPU (gloo): a model sharded over 2 (or 3) rank processes generates what the
unsharded model generates.

Each TP engine starts real rank processes (mp executor: `python -m ferrox.executor.worker_main`,
or Ray actors) that load their shards of the same checkpoint and run every step the driver
broadcasts. Greedy tokens must be identical to tensor_parallel_size=1 (fp32: the sharded sums
differ from the unsharded ones only in rounding), through chunked prefill and preemption;
logprobs agree to rounding.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.attention.kv_cache import kv_cache_bytes_per_block
from ferrox.errors import UnsupportedModelError
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model

from tests.helpers.tiny_models import (
    make_tiny_gemma2,
    make_tiny_granite,
    make_tiny_llama,
    make_tiny_phi3,
    make_tiny_qwen2,
    make_tiny_qwen3,
)

pytestmark = pytest.mark.slow

# A 70-token prompt is prefilled in 3 chunks of max_num_batched_tokens=32.
PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 73)), [2, 8, 100, 41, 41, 41, 9, 3, 77], [5] * 23]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
KV_BLOCKS = 10  # the 4 requests need 14 blocks at once: some are preempted


def _generate(folder: str, tp: int, **kw):
    """(token ids, sampled-token logprobs, preemptions) of PROMPTS, on an engine whose KV cache
    holds KV_BLOCKS blocks per rank whatever the TP size."""
    spec = load_model_spec(resolve_model(folder))
    kv_bytes = KV_BLOCKS * kv_cache_bytes_per_block(spec, 16, torch.float32, tp)
    llm = LLM(model=folder, tensor_parallel_size=tp, kv_cache_memory=kv_bytes, max_num_batched_tokens=32,
              max_model_len=KV_BLOCKS * 16, **kw)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        preemptions = llm.engine.stats()["num_preemptions"]
    finally:
        llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]
                for o in outs]
    return tokens, logprobs, preemptions


def _assert_same(reference, sharded, atol: float = 1e-4):
    ref_tokens, ref_lp, ref_preempted = reference
    tokens, lp, preempted = sharded
    assert ref_preempted > 0 and preempted > 0, "the KV cache was meant to force preemption"
    assert tokens == ref_tokens
    for a, b in zip(ref_lp, lp, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol), (a, b)


@pytest.mark.parametrize("family", ["llama", "qwen2-one-kv-head", "qwen3", "phi3-granite", "gemma2"])
def test_tp2_matches_tp1(tmp_path, family):
    if family == "llama":
        folder = make_tiny_llama(tmp_path, tie_word_embeddings=False)
    elif family == "qwen2-one-kv-head":  # 2 ranks, 1 KV head: each rank caches a replica of it
        folder = make_tiny_qwen2(tmp_path, num_kv_heads=1)
    elif family == "phi3-granite":
        # Phi-3: each rank cuts its rows out of the fused qkv / gate_up tensors without reading the rest;
        # Granite (tied): its folded multipliers are applied to each rank's slices as they are read.
        phi3, granite = make_tiny_phi3(tmp_path / "phi3"), make_tiny_granite(tmp_path / "granite",
                                                                             tie_word_embeddings=True)
        _assert_same(_generate(phi3, 1), _generate(phi3, 2), atol=0.05)
        _assert_same(_generate(granite, 1), _generate(granite, 2), atol=0.05)
        return
    elif family == "gemma2":  # soft caps on each rank's heads and on the gathered logits
        folder = make_tiny_gemma2(tmp_path, sliding_window=256)
    else:
        folder = make_tiny_qwen3(tmp_path)  # tied embeddings: the LM head is the embedding's shard
    _assert_same(_generate(folder, 1), _generate(folder, 2), atol=0.05)


def test_tp2_on_ray_matches_tp1(tmp_path):
    pytest.importorskip("ray")
    folder = make_tiny_llama(tmp_path)
    try:
        sharded = _generate(folder, 2, distributed_executor_backend="ray")
    finally:
        import ray

        ray.shutdown()
    _assert_same(_generate(folder, 1), sharded)


def test_embedded_model_tp3_matches_tp1():
    """SmolLM2 (9 query heads, 3 KV heads): 3 ranks of 3 query heads and 1 KV head each."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ref = [o.outputs[0].token_ids for o in LLM(dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024).generate(prompts, params, use_tqdm=False)]
    llm = LLM(dtype="float32", tensor_parallel_size=3, kv_cache_memory=64 << 20, max_model_len=1024)
    try:
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert out == ref


def test_unsplittable_model_fails_at_start_naming_the_numbers():
    with pytest.raises(UnsupportedModelError, match=r"num_attention_heads \(9\) is not divisible by "
                                                    r"tensor_parallel_size \(2\)"):
        LLM(tensor_parallel_size=2)


def test_pipeline_parallelism_is_refused_by_name():
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(pipeline_parallel_size=2)


def _rank_pids(parent: int) -> list[int]:
    """Processes running ferrox.executor.worker_main whose parent is `parent`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().split(")")[-1].split()[1])
        except OSError:
            continue
        if ppid == parent and b"ferrox.executor.worker_main" in cmd:
            pids.append(int(entry))
    return pids


def test_second_engine_is_refused_while_the_first_holds_the_group(tmp_path):
    """A second TP engine while the first is alive fails at once, naming the field, before any rank
    of its own starts (no orphan rank process), and the first keeps serving."""
    folder = make_tiny_llama(tmp_path / "llama")
    first = LLM(model=folder, tensor_parallel_size=2, max_model_len=128, kv_cache_memory=8 << 20)  # not 2 GiB a rank
    try:
        ranks = _rank_pids(os.getpid())
        with pytest.raises(ValueError, match="tensor_parallel_size: a tensor-parallel engine in this process"):
            LLM(model=folder, tensor_parallel_size=2, max_model_len=128, kv_cache_memory=8 << 20)
        assert _rank_pids(os.getpid()) == ranks
        out = first.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0.0),
                             use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        first.engine.shutdown()


def test_killed_rank_fails_requests_and_the_server_exits(tmp_path):
    """A rank that dies mid-request takes the engine down cleanly: the stream gets an error, the
    server exits non-zero within seconds, nothing hangs."""
    import asyncio
    import json

    import aiohttp

    from tests.server.server_proc import ServerProcess

    folder = make_tiny_llama(tmp_path)
    srv = ServerProcess(folder, "--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB", "--max-model-len", "2048")
    try:
        assert srv.core_pid is not None
        ranks = _rank_pids(srv.core_pid)
        assert len(ranks) == 1, ranks

        async def stream() -> list[str]:
            body = {"prompt": "a b c", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            events: list[str] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
                async with session.post(srv.base_url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 3:
                                os.kill(ranks[0], signal.SIGKILL)
            return events

        start = time.monotonic()
        events = asyncio.run(stream())
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-2]
        try:
            code = srv.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("server kept running after a tensor-parallel rank died")
        assert code != 0
        assert time.monotonic() - start < 40
    finally:
        srv.stop()


@pytest.mark.parametrize(("family", "expert_parallel"), [
    ("qwen2-moe", False),  # every expert sharded by its intermediate rows; the shared expert too
    ("qwen3-moe", True),  # 8 experts split 4 + 4 over the ranks
    ("mixtral", True),
])
def test_moe_tp2_matches_tp1(tmp_path, family, expert_parallel):
    from tests.helpers.tiny_models import make_tiny_mixtral, make_tiny_qwen2_moe, make_tiny_qwen3_moe

    makers = {"qwen2-moe": make_tiny_qwen2_moe, "qwen3-moe": make_tiny_qwen3_moe, "mixtral": make_tiny_mixtral}
    folder = makers[family](tmp_path)
    _assert_same(_generate(folder, 1), _generate(folder, 2, enable_expert_parallel=expert_parallel))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_fp8_moe_tp2_matches_tp1(tmp_path, expert_parallel):
    """FP8 experts (layers/quant/fp8_moe.py) across two ranks: a block-wise checkpoint whose experts
    are sharded by 32-row blocks of their intermediate rows (each rank quantizes its half of the
    intermediate in whole groups, as one rank does) or split 4 + 4. Logprobs within 0.05: the
    row-parallel sums change an activation by ~1e-7 now and then, and when that moves an FP8 code
    the step moves by ~1e-2 (tokens stay identical). Per-row (channel) FP8 is not compared so: each
    rank quantizes its own part of a row-parallel input per token, as vLLM's does, which is not one
    rank's arithmetic."""
    from safetensors.torch import load_file

    from tests.helpers.fp8_moe_checkpoints import fp8_config, quantized_tensors
    from tests.helpers.quant_checkpoints import write_checkpoint
    from tests.helpers.tiny_models import make_tiny_qwen3_moe

    floats = make_tiny_qwen3_moe(tmp_path / "float", moe_intermediate_size=64, intermediate_size=128)
    tensors = quantized_tensors(load_file(f"{floats}/model.safetensors"), "block", (32, 32), "weight_scale_inv")
    folder = write_checkpoint(floats, tmp_path / "fp8", fp8_config("block", (32, 32)), tensors)
    _assert_same(_generate(folder, 1), _generate(folder, 2, enable_expert_parallel=expert_parallel), atol=0.05)


def test_sleep_mode_reaches_every_rank(tmp_path):
    """sleep / wake_up / reload_weights under tensor parallelism: the other rank drops and restores its KV
    cache and weights with the driver (distributed/step_channel.py SLEEP / WAKE / RELOAD), and the greedy
    tokens are those of before."""
    folder = make_tiny_llama(tmp_path / "llama")
    # An 8 MiB cache per rank (16k tokens of this model) instead of the CPU default of 2 GiB: every wake-up
    # allocates and zeroes the cache again, ~1.5 s a time at 2 GiB; what is dropped and restored is the same.
    llm = LLM(model=folder, tensor_parallel_size=2, max_model_len=128, enable_sleep_mode=True, kv_cache_memory=8 << 20)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        for tags in (None, ["kv_cache"]):
            llm.sleep(level=1, tags=tags)
            assert llm.is_sleeping()
            llm.wake_up()
            after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
            assert after == before
        # Level 2: every rank discards its shard, and reads it again on reload_weights.
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        assert llm.collective_rpc("reload_weights") == [None, None]
        llm.wake_up(tags=["kv_cache"])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before
    finally:
        llm.engine.shutdown()
