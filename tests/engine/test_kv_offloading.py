"""The prefix cache's host tier (--kv-offloading-size, vLLM's native KV offloading; rust/host_tier.rs,
worker/host_kv_tier.py) on a real engine (on a GPU too: kernels/block_copy.py's copies): a prompt whose cached blocks other prompts evicted from a small
device cache is served again from the host copies (the host tier's hit counter moves, the device cache's
does not) with exactly the tokens and logprobs it got when computed, which are also those of an engine
without the tier; over 2 tensor-parallel ranks (gloo) each rank copies its own KV heads. Refusals named."""

from __future__ import annotations

import pytest
import torch
from ferrox import LLM, SamplingParams
from ferrox.config import EngineConfig

from tests.helpers.tiny_models import make_tiny_llama

ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
LONG = [(13 * i + 7) % 250 + 3 for i in range(70)]  # 4 full blocks of 16 + 6 tokens
OTHERS = [[(31 * i + k) % 250 + 3 for i in range(90)] for k in range(3)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("llama"), hidden_size=64, num_layers=2)


def _run(llm: LLM, prompts: list[list[int]]):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                           o.outputs[0].token_ids, strict=True)])
            for o in outs]


SIZE = {"kv_offloading_size": 0.01}
# vLLM's longer spelling of the same tier: its OffloadingConnector (kv_transfer_config.py), 40 blocks a rank.
CONNECTOR = {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"num_cpu_blocks": 40}}}


@pytest.mark.parametrize(("tp", "device", "tier"), [
    (1, "cpu", SIZE), (1, "cpu", CONNECTOR), pytest.param(2, "cpu", SIZE, marks=pytest.mark.slow),
    pytest.param(1, "cuda", SIZE, marks=ON_GPU)])  # (on a GPU: the copy kernels)
def test_evicted_prefix_comes_back_from_host_memory(folder, tp, device, tier):
    common = dict(dtype="float32", device=device, num_gpu_blocks_override=12, max_model_len=160, max_num_seqs=1,
                  tensor_parallel_size=tp)
    plain = LLM(folder, **common)
    try:
        want = _run(plain, [LONG])[0]
    finally:
        plain.engine.shutdown()  # (one tensor-parallel engine at a time in a process)
    tiered = LLM(folder, disable_log_stats=False, **tier, **common)
    try:
        first = _run(tiered, [LONG])[0]
        for other in OTHERS:  # each needs 6 of the 11 usable blocks: LONG's cached blocks are evicted
            _run(tiered, [other])
        before = tiered.engine.stats()
        assert before["host_cache_blocks"] >= 4
        again = tiered.generate([{"prompt_token_ids": LONG}], GREEDY, use_tqdm=False)[0]
        after = tiered.engine.stats()
        assert after["host_cache_hits"] - before["host_cache_hits"] == 64  # 4 blocks loaded, not computed
        assert after["prefix_cache_hits"] == before["prefix_cache_hits"]  # (none on the device)
        assert again.num_cached_tokens == 64
        got = (list(again.outputs[0].token_ids),
               [lp[t].logprob for lp, t in zip(again.outputs[0].logprobs, again.outputs[0].token_ids, strict=True)])
        assert got[0] == first[0] == want[0]
        assert got[1] == pytest.approx(first[1], abs=1e-5) and got[1] == pytest.approx(want[1], abs=1e-5)
        # vLLM's metrics for its offloading connector: the tier's tokens are external hits, by source too.
        metrics = {(m.name, m.labels.get("source")): m.value for m in tiered.get_metrics() if hasattr(m, "value")}
        assert metrics[("vllm:external_prefix_cache_hits", None)] == 64
        assert metrics[("vllm:external_prefix_cache_queries", None)] == metrics[("vllm:prefix_cache_queries", None)]
        assert metrics[("vllm:prompt_tokens_by_source", "external_kv_transfer")] == 64
        assert metrics[("vllm:prompt_tokens_by_source", "local_cache_hit")] == 0
        assert tiered.reset_prefix_cache() and tiered.engine.stats()["host_cache_blocks"] == 0
    finally:
        tiered.engine.shutdown()


def test_settings_are_checked_by_name(folder):
    connector = CONNECTOR["kv_transfer_config"]
    extra = connector["kv_connector_extra_config"]
    bad_connectors = {
        "kv_connector: 'NixlConnector' is not supported": {**connector, "kv_connector": "NixlConnector"},
        "kv_role: 'kv_producer'": {**connector, "kv_role": "kv_producer"},
        "block_size: 64": {**connector, "kv_connector_extra_config": {**extra, "block_size": 64}},
        "kv_connector_extra_config: cpu_bytes_to_use and num_cpu_blocks": {
            **connector, "kv_connector_extra_config": {**extra, "cpu_bytes_to_use": 1 << 30}},
        "kv_connector_extra_config: the host tier needs a size": {**connector, "kv_connector_extra_config": {}},
        "kv_connector_extra_config.num_cpu_blocks: must be": {**connector, "kv_connector_extra_config": {
            "num_cpu_blocks": 0}},
        "kv_transfer_config.kv_ip: not supported": {**connector, "kv_ip": "10.0.0.1"},
        "eviction_policy: 'arc'": {**connector, "kv_connector_extra_config": {**extra, "eviction_policy": "arc"}},
    }
    for message, bad in bad_connectors.items():
        with pytest.raises(ValueError, match=message):
            EngineConfig(model=folder, kv_transfer_config=bad)
    with pytest.raises(ValueError, match="kv_transfer_config: sizes the host tier, as kv_offloading_size"):
        EngineConfig(model=folder, kv_offloading_size=1, **CONNECTOR)
    with pytest.raises(ValueError, match="kv_transfer_config: .*enable_prefix_caching"):
        EngineConfig(model=folder, enable_prefix_caching=False, **CONNECTOR)
    # cpu_bytes_to_use: bytes over every rank, as --kv-offloading-size's GiB (checked against host memory too).
    with pytest.raises(ValueError, match="kv_transfer_config: .* host memory"):
        EngineConfig(model=folder, kv_transfer_config={**connector, "kv_connector_extra_config": {
            "cpu_bytes_to_use": 1 << 60, "block_size": 16}})
    with pytest.raises(ValueError, match="kv_offloading_size: .*enable_prefix_caching"):
        EngineConfig(model=folder, kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offloading_backend: 'lmcache'"):
        EngineConfig(model=folder, kv_offloading_size=1, kv_offloading_backend="lmcache")
    for bad in (0, -1, "2", True):
        with pytest.raises(ValueError, match="kv_offloading_size: must be"):
            EngineConfig(model=folder, kv_offloading_size=bad)
    with pytest.raises(ValueError, match="kv_offloading_size: .* host memory"):
        EngineConfig(model=folder, kv_offloading_size=1 << 20)
    with pytest.raises(ValueError, match="kv_offloading_size: .* holds no block"):
        LLM(folder, dtype="float32", device="cpu", kv_offloading_size=1e-9)


def test_host_tier_events_follow_vllms_offloading_connector(folder, tmp_path):
    """With KV events on, blocks copied to the host tier are published as vLLM's offloading connector does
    (BlockStored, medium "CPU", hashes only: no tokens, no parent), under the same hashes as their device
    BlockStored / BlockRemoved events; a block loaded back is stored on the device again."""
    import time

    import msgspec
    import zmq
    from ferrox.engine.kv_events import BlockRemoved, BlockStored, KVEventBatch

    pub = f"ipc://{tmp_path}/kv-events"
    llm = LLM(folder, dtype="float32", device="cpu", num_gpu_blocks_override=12, max_model_len=160, max_num_seqs=1,
              kv_offloading_size=0.01, kv_events_config={"enable_kv_cache_events": True, "endpoint": pub})
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)
        for prompt in [LONG, *OTHERS, LONG]:
            _run(llm, [prompt])
        decoder, events = msgspec.msgpack.Decoder(KVEventBatch), []
        while sub.poll(2000):
            events += decoder.decode(sub.recv_multipart()[2]).events
        first_gpu = next(e for e in events if isinstance(e, BlockStored) and e.medium == "GPU")
        long_blocks = first_gpu.block_hashes[:4]  # LONG's 4 prompt blocks
        cpu_stored = [h for e in events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes]
        assert set(long_blocks) <= set(cpu_stored)
        assert all(e.token_ids == [] and e.parent_block_hash is None for e in events
                   if isinstance(e, BlockStored) and e.medium == "CPU")
        gpu_removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "GPU" for h in e.block_hashes]
        assert set(long_blocks) <= set(gpu_removed)
        def index(medium):
            return [i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == medium
                    and long_blocks[0] in e.block_hashes]

        assert index("GPU")[-1] > index("CPU")[0]  # loaded back: on the device again, after its offload
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()
