"""vLLM's KV cache events (--kv-events-config): what enters and leaves the prefix cache, published over
ZeroMQ in vLLM's wire format, for routers that send a request to the engine already holding its prefix.

The Rust scheduler records the events (rust/kv_events.rs: BlockStored when full blocks are cached,
with their tokens and the hash of the block before them; BlockRemoved when cached blocks are evicted or
dropped; AllBlocksCleared on reset_prefix_cache); the engine core drains them once a step
(`Scheduler.take_kv_events`) and hands them here as one batch. Block hashes are the prefix hashes cut to
64 bits. Under ferrox's own hashes (sha256, xxhash) they are opaque ids a consumer matches between a
block's stored and removed events (its own prefix keys come from the token ids); under vLLM's
(sha256_cbor, xxhash_cbor; rust/cbor_block_hash.rs) they are exactly the numbers vLLM publishes for the
same blocks (with the same PYTHONHASHSEED), and each stored block's extra keys come along, as vLLM's.

Wire format, as vLLM publishes it: a multipart message (topic, 8-byte big-endian sequence number,
msgpack payload) on a PUB socket; the payload is a map {ts, events, data_parallel_rank} whose events
are maps tagged by "type" (BlockStored, BlockRemoved, AllBlocksCleared). With a replay endpoint, a
ROUTER socket answers a request for the batches from sequence N on (the last `buffer_steps` kept),
then an end marker (sequence -1, empty payload). A data-parallel core publishes on the endpoints'
ports plus its index. Publishing runs on a thread of its own, so a step never waits on a socket.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec

from ferrox.kv_events_config import KVEventsConfig, offset_endpoint

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's name for the device cache (a CPU engine's cache is its device cache too)
MEDIUM_CPU = "CPU"  # vLLM's name for the host tier (--kv-offloading-size)
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # vLLM's: one entry per block (its extra keys as hashed, or None), under the CBOR hashes only.
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_batch(raw: list[tuple[Any, ...]], block_size: int, lora_names: dict[int, str],
             rank: int | None) -> KVEventBatch:
    """Scheduler.take_kv_events' tuples as vLLM's event batch."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for event in raw:
        kind = event[0]
        if kind == "stored":
            _, hashes, parent, tokens, lora_id, extra_keys = event
            events.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                      block_size=block_size, lora_id=lora_id or None, medium=MEDIUM_GPU,
                                      lora_name=lora_names.get(lora_id) if lora_id else None,
                                      extra_keys=extra_keys))
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=event[1], medium=MEDIUM_GPU))
        elif kind == "stored_host":  # as vLLM's offloading connector: hashes only, no tokens or parent
            events.append(BlockStored(block_hashes=event[1], parent_block_hash=None, token_ids=[],
                                      block_size=block_size, lora_id=None, medium=MEDIUM_CPU, lora_name=None))
        elif kind == "removed_host":
            events.append(BlockRemoved(block_hashes=event[1], medium=MEDIUM_CPU))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=rank)


class ZmqEventPublisher:
    """PUB socket (and optional ROUTER for replays) fed from a queue by one thread."""

    def __init__(self, config: KVEventsConfig, rank: int = 0) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        endpoint = offset_endpoint(config.endpoint, rank)
        assert endpoint is not None
        self._replay = None
        replay = offset_endpoint(config.replay_endpoint, rank)
        try:
            # A wildcard host or a local transport binds; an address of a collector elsewhere connects.
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
            else:
                self._pub.connect(endpoint)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay)
        except zmq.ZMQError as exc:  # a port in use, a bad address: say which setting
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            key = "replay_endpoint" if self._replay is not None else "endpoint"
            raise ValueError(f"kv_events_config.{key}: {replay if self._replay is not None else endpoint}: "
                             f"{exc}") from None
        self.endpoint = endpoint
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s%s", endpoint, f" (replays on {replay})" if replay else "")

    def publish(self, batch: KVEventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:  # a stalled thread must not stall the engine: drop, and say so
            logger.warning("KV cache events: the queue is full (max_queue_size); a batch was dropped")

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = self._encoder.encode(batch)
            seq = self._seq
            self._seq += 1
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except self._zmq.ZMQError as exc:
                logger.warning("KV cache events: send failed (%s)", exc)
            self._sent.append((seq, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: a replay request of %d frames ignored (expected 3)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Sends what is queued (for up to timeout_s), then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
