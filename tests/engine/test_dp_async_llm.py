"""AsyncLLM with two data-parallel engine cores: utility calls reach every core, the n samples of a
request stay on one core, stats are per core and summed, and disable_log_stats is honoured."""

from __future__ import annotations

import asyncio

import pytest
from ferrox import AsyncLLM, SamplingParams
from ferrox.metrics.log_stats import LoggingStatLogger

PROMPT = " ".join(f"granite{i} willow{i}" for i in range(20))  # several full blocks


@pytest.fixture(scope="module")
def engine():
    eng = AsyncLLM(max_model_len=256, kv_cache_memory=32 << 20, data_parallel_size=2, disable_log_stats=True)
    yield eng
    eng.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def run(engine: AsyncLLM, prompt: str, params: SamplingParams, rid: str):
    return [out async for out in engine.generate(prompt, params, rid)][-1]


def per_engine(stats: dict, key: str) -> list[int]:
    return [int(s[key]) for s in stats["engines"]]


def test_two_cores_and_no_log_line(engine):
    assert len(set(engine.client.pids)) == 2
    assert not any(isinstance(s, LoggingStatLogger) for s in engine.stat_loggers)


def test_samples_of_one_request_share_a_core(engine):
    async def go():
        before = await engine.get_stats()
        out = await run(engine, PROMPT, greedy(3, n=2), "n2")
        return before, out, await engine.get_stats()

    before, out, after = asyncio.run(go())
    assert sorted(c.index for c in out.outputs) == [0, 1]
    generated = [a - b for a, b in zip(per_engine(after, "num_generation_tokens"),
                                       per_engine(before, "num_generation_tokens"), strict=True)]
    assert sorted(generated) == [0, 6], generated
    # The aggregate is the sum of the cores.
    assert after["num_generation_tokens"] == sum(per_engine(after, "num_generation_tokens"))
    assert after["num_running"] == 0 and len(after["engines"]) == 2


def test_reset_prefix_cache_reaches_every_core(engine):
    async def both(tag: str) -> None:
        # Two at once: the second goes to the other core (the first one is busier).
        await asyncio.gather(run(engine, PROMPT, greedy(4), f"{tag}-a"), run(engine, PROMPT, greedy(4), f"{tag}-b"))

    async def go():
        await both("warm")  # each core now holds the prompt's blocks
        hits_before = per_engine(await engine.get_stats(), "prefix_cache_hits")
        await both("hit")
        hits_warm = per_engine(await engine.get_stats(), "prefix_cache_hits")
        assert await engine.reset_prefix_cache()
        await both("cold")
        return hits_before, hits_warm, per_engine(await engine.get_stats(), "prefix_cache_hits")

    before, warm, cold = asyncio.run(go())
    assert all(w > b for w, b in zip(warm, before, strict=True)), (before, warm)
    assert cold == warm, (warm, cold)  # no core found anything after the reset
