"""Data-parallel routing, placement and stats merging, without starting an engine core."""

from __future__ import annotations

import os

import pytest
from ferrox.config import EngineConfig
from ferrox.engine.dp_client import aggregate_stats
from ferrox.engine.dp_placement import place_cores, visible_cuda_devices
from ferrox.engine.dp_router import WAITING_WEIGHT, DPRouter, prefix_keys
from ferrox.errors import EngineStartupError

BLOCK = 16


def prompt(seed: int, length: int = 48) -> list[int]:
    return [(seed * 1000 + i) % 49152 for i in range(length)]


def test_least_loaded_core_wins():
    router = DPRouter(3, BLOCK)
    assert [router.route(f"r{i}", prompt(i)) for i in range(3)] == [0, 1, 2]
    router.release("r1")
    assert router.route("r3", prompt(3)) == 1  # the only core with nothing in flight
    # Waiting requests in a core's stats weigh more than in-flight ones: the queue means it is full.
    router.update_stats(0, {"num_waiting": 1})
    assert router.load(0) == 1 + WAITING_WEIGHT
    router.release("r2")
    assert router.route("r4", prompt(4)) == 2


def test_ties_go_to_the_core_holding_the_prefix():
    router = DPRouter(2, BLOCK)
    system = prompt(7, 64)  # a shared 4-block system prompt
    first = router.route("a", system + [1, 2, 3])
    router.release("a")
    # Equal load (nothing in flight): a prompt sharing the prefix goes back to the same core,
    # again and again, while prompts with no known prefix rotate over the cores.
    for i in range(4):
        assert router.route(f"same{i}", system + [100 + i]) == first
        router.release(f"same{i}")
    spread = set()
    for i in range(4):
        spread.add(router.route(f"new{i}", prompt(100 + i)))
        router.release(f"new{i}")
    assert spread == {0, 1}
    # Load still comes first: once the prefix's core is busier, the other one gets the request.
    assert router.route("held", system + [9]) == first
    assert router.route("other", system + [10]) == 1 - first


def test_longest_shared_prefix_decides_and_short_prompts_have_none():
    router = DPRouter(2, BLOCK)
    base = prompt(3, 32)
    router.assign("x", 0)
    router._remember_prefix(prefix_keys(base, BLOCK), 0)  # two blocks on core 0
    router._remember_prefix(prefix_keys(base + prompt(4, 32), BLOCK), 1)  # four blocks on core 1
    router.release("x")
    assert router.route("long", base + prompt(4, 32) + [5]) == 1
    router.release("long")
    assert prefix_keys(prompt(5, BLOCK - 1), BLOCK) == []
    # Chained: the same block after a different prefix is a different key.
    assert prefix_keys(prompt(1, 16) + prompt(2, 16), BLOCK)[1] != prefix_keys(prompt(3, 16) + prompt(2, 16), BLOCK)[1]


def test_siblings_abort_and_release():
    router = DPRouter(2, BLOCK)
    engine = router.route("0_r", prompt(1))
    router.assign("1_r", engine)  # an n=2 sibling follows its first sample
    assert router.in_flight[engine] == 2 and sorted(router.owned_by(engine)) == ["0_r", "1_r"]
    with pytest.raises(ValueError, match="already routed"):
        router.assign("1_r", engine)
    with pytest.raises(ValueError, match="not a core index"):
        router.assign("2_r", 5)
    assert router.release("0_r") == engine and router.release("0_r") is None
    assert router.in_flight[engine] == 1


def test_aggregate_stats_sums_counts_and_weighs_kv_usage():
    a = {"num_running": 2, "num_waiting": 1, "num_total_blocks": 100, "kv_cache_usage": 0.5,
         "prefix_cache_hits": 10, "block_size": 16, "max_model_len": 1024}
    b = {"num_running": 1, "num_waiting": 0, "num_total_blocks": 300, "kv_cache_usage": 0.1,
         "prefix_cache_hits": 5, "block_size": 16, "max_model_len": 1024}
    merged = aggregate_stats([a, b])
    assert merged["num_running"] == 3 and merged["num_waiting"] == 1 and merged["prefix_cache_hits"] == 15
    assert merged["block_size"] == 16 and merged["max_model_len"] == 1024
    assert merged["kv_cache_usage"] == pytest.approx((50 + 30) / 400)
    assert merged["engines"] == [a, b]


def test_placement_on_cpu_splits_the_cpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cpus = sorted(os.sched_getaffinity(0))
    placements = place_cores(EngineConfig(device="cpu", data_parallel_size=2, kv_cache_memory=64 << 20))
    assert [p.index for p in placements] == [0, 1]
    assert all(p.config.data_parallel_size == 1 and p.env == {} for p in placements)
    if len(cpus) >= 2:
        assert placements[0].cpus and placements[1].cpus
        assert not set(placements[0].cpus) & set(placements[1].cpus)
    else:
        assert all(p.config.num_threads == 1 for p in placements)
    # The default KV-cache share of RAM is split; an explicit size is each core's own.
    assert placements[0].config.kv_cache_memory == 64 << 20
    default = place_cores(EngineConfig(device="cpu", data_parallel_size=2))
    assert default[0].config.kv_cache_memory <= EngineConfig(device="cpu").resolved_cpu_kv_cache_memory()
    # One core: nothing changes.
    single = place_cores(EngineConfig(device="cpu"))
    assert len(single) == 1 and single[0].cpus is None and single[0].env == {}


def test_placement_on_gpus_gives_each_core_its_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert visible_cuda_devices() == ["3", "5", "6", "7"]
    placements = place_cores(EngineConfig(device="cuda", data_parallel_size=2, tensor_parallel_size=2))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["3,5", "6,7"]
    placements = place_cores(EngineConfig(device="cuda", data_parallel_size=4))
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placements] == ["3", "5", "6", "7"]
    with pytest.raises(EngineStartupError, match="data_parallel_size 3 x tensor_parallel_size 2 needs 6 GPUs, but 4"):
        place_cores(EngineConfig(device="cuda", data_parallel_size=3, tensor_parallel_size=2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")
    assert visible_cuda_devices() == ["0"]


def test_a_prompt_cache_key_keeps_a_conversation_on_its_core():
    """OpenAI's prompt_cache_key: between equally loaded cores the key decides, so one conversation's
    turns stay together even though every conversation shares the system prompt (whose blocks would
    send each new turn to wherever that prefix went last)."""
    router = DPRouter(2, BLOCK)
    system = prompt(5, 64)
    homes = {}
    for conv in ("a", "b", "c", "d"):
        homes[conv] = router.route(f"{conv}0", system + [1], cache_key=conv)
        router.release(f"{conv}0")
    assert set(homes.values()) == {0, 1}  # new keys spread over the cores
    for turn in range(1, 4):
        for conv in ("a", "b", "c", "d"):
            assert router.route(f"{conv}{turn}", system + [1, 2 + turn], cache_key=conv) == homes[conv]
            router.release(f"{conv}{turn}")
    # Load still comes first.
    busy = homes["a"]
    assert router.route("x", system, cache_key="a") == busy
    assert router.route("y", system, cache_key="a") == 1 - busy
