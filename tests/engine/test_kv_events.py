"""vLLM's KV cache events (--kv-events-config; ferrox/engine/kv_events.py, rust/kv_events.rs): a real
engine on a tiny Llama publishes, over ZeroMQ in vLLM's msgpack format, the prompt blocks it caches (hashes
chained by parent, their tokens), a reset's AllBlocksCleared, and answers a replay request; the config is
refused by name where it is wrong. (Eviction and the grouping of blocks: the Rust core's own test.)"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from ferrox import LLM, SamplingParams
from ferrox.config import EngineConfig
from ferrox.engine.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from ferrox.kv_events_config import offset_endpoint, parse_kv_events_config

from tests.helpers.tiny_models import make_tiny_llama

BLOCK = 16


def test_config_follows_vllm_and_names_what_is_wrong():
    assert parse_kv_events_config({"enable_kv_cache_events": True}).publisher == "zmq"
    assert not parse_kv_events_config({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    assert not parse_kv_events_config(None).publishes
    for raw, field in (({"enable_kv_cache_event": True}, "kv_events_config.enable_kv_cache_event"),
                       ({"publisher": "kafka"}, "kv_events_config.publisher"),
                       ({"hwm": 0}, "kv_events_config.hwm"),
                       ({"endpoint": "localhost:5557"}, "kv_events_config.endpoint")):
        with pytest.raises(ValueError, match=field):
            parse_kv_events_config(raw)
    with pytest.raises(ValueError, match="need enable_prefix_caching"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"


def _receive(sub: zmq.Socket, decoder: msgspec.msgpack.Decoder, until) -> list[tuple[int, KVEventBatch]]:
    got = []
    while sub.poll(10_000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), decoder.decode(payload)))
        if until(got):
            break
    return got


def test_engine_publishes_stored_blocks_clears_and_replays(tmp_path):
    folder = make_tiny_llama(tmp_path / "llama")
    pub, replay = f"ipc://{tmp_path}/kv-events", f"ipc://{tmp_path}/kv-replay"
    ctx = zmq.Context.instance()
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK,
              kv_events_config={"enable_kv_cache_events": True, "endpoint": pub, "replay_endpoint": replay,
                                "topic": "kv"})
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)  # (a PUB socket drops what it sends before the subscription arrives)
        prompt = [(7 * i + 3) % 300 + 3 for i in range(40)]
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        stored = []

        def three_blocks(got):
            stored[:] = [e for _, b in got for e in b.events if isinstance(e, BlockStored)]
            return sum(len(e.block_hashes) for e in stored) >= 3

        batches = _receive(sub, decoder, three_blocks)
        # 40 prompt tokens + 10 generated: blocks 0-1 of the prompt, then block 2 once token 48 is in.
        tokens = prompt + list(out.token_ids)
        hashes = [h for e in stored for h in e.block_hashes]
        assert [t for e in stored for t in e.token_ids] == tokens[:3 * BLOCK]
        assert stored[0].parent_block_hash is None and len(set(hashes)) == 3
        for earlier, later in zip(stored, stored[1:], strict=False):
            assert later.parent_block_hash == earlier.block_hashes[-1]
        assert all(e.block_size == BLOCK and e.medium == "GPU" and e.lora_id is None for e in stored)
        assert all(0 <= h < 1 << 64 for h in hashes)
        seqs = [s for s, _ in batches]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # The same prompt again hits the cache: nothing new is stored. A reset says so.
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        assert llm.reset_prefix_cache()
        cleared = _receive(sub, decoder, lambda got: any(isinstance(e, AllBlocksCleared) for e in got[-1][1].events))
        assert not [e for _, b in cleared for e in b.events if isinstance(e, BlockStored)]
        # A replay from sequence 0 returns every batch so far, then the end marker.
        # (A DEALER socket, which takes the reply's several messages; it frames the request as REQ would.)
        req = ctx.socket(zmq.DEALER)
        req.connect(replay)
        req.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while req.poll(10_000):
            _, seq, payload = req.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                break
            replayed.append(int.from_bytes(seq, "big"))
            decoder.decode(payload)
        req.close(linger=0)
        assert replayed[:len(seqs)] == seqs and replayed[-1] == cleared[-1][0]
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()


def test_an_endpoint_in_use_is_named(tmp_path):
    """A second publisher on a taken endpoint stops with the setting's name, not a bare ZeroMQ error."""
    from ferrox.engine.kv_events import ZmqEventPublisher
    from ferrox.kv_events_config import KVEventsConfig

    port = zmq.Context.instance().socket(zmq.PUB)
    try:
        taken = port.bind_to_random_port("tcp://*")
        config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{taken}")
        with pytest.raises(ValueError, match=f"kv_events_config.endpoint: tcp://\\*:{taken}"):
            ZmqEventPublisher(config)
    finally:
        port.close(linger=0)


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_cbor_hashes_are_the_numbers_vllm_publishes(tmp_path, monkeypatch, algo):
    """--prefix-caching-hash-algo sha256_cbor / xxhash_cbor with PYTHONHASHSEED set: a real engine's events
    name each block exactly as vLLM's do (the reference chain: tests/helpers/vllm_block_hash.py), with
    vLLM's per-block extra_keys (None for a plain prompt) on the wire; VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0
    (whole digests) is refused by name. (LoRA names, salts and images: tests/bindings/test_prefix_hash_cbor.py.)"""
    from tests.helpers.vllm_block_hash import vllm_chain

    monkeypatch.setenv("PYTHONHASHSEED", "42")
    folder = make_tiny_llama(tmp_path / "llama")
    pub = f"ipc://{tmp_path}/kv-events"
    events = {"enable_kv_cache_events": True, "endpoint": pub, "topic": "kv"}
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    with pytest.raises(ValueError, match="VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0"):
        EngineConfig(kv_events_config=events)
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
    llm = LLM(model=folder, dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK,
              prefix_caching_hash_algo=algo, kv_events_config=events)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.connect(pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.3)
        prompt = [(11 * i + 5) % 300 + 3 for i in range(50)]
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        stored: list[BlockStored] = []

        def three_blocks(got):
            stored[:] = [e for _, b in got for e in b.events if isinstance(e, BlockStored)]
            return sum(len(e.block_hashes) for e in stored) >= 3

        _receive(sub, msgspec.msgpack.Decoder(KVEventBatch), three_blocks)
        want, keys = vllm_chain(algo, "42", prompt, BLOCK)
        assert [h for e in stored for h in e.block_hashes] == want
        assert [k for e in stored for k in e.extra_keys] == keys == [None] * 3
    finally:
        sub.close(linger=0)
        llm.engine.shutdown()
