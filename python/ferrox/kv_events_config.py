"""vLLM's --kv-events-config: whether and where the engine publishes its KV cache events
(ferrox/engine/kv_events.py). Read by EngineConfig (a bad key or value is refused by name) and by the
engine core, which starts the publisher."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# vLLM's switch between the events' two forms of a block hash: 1 (its default) the digest's low 64 bits
# as an integer, 0 the whole digest as bytes. ferrox's cache keeps 128-bit keys, not digests: only 1.
INT_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys (defaults: vLLM's)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" once events are enabled, unless given
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(raw: dict[str, Any] | None) -> KVEventsConfig:
    """The config from vLLM's JSON object; a key ferrox lacks or a bad value is a ValueError naming it."""
    if raw is None:
        return KVEventsConfig()
    if not isinstance(raw, dict):
        raise ValueError(f"kv_events_config: must be a JSON object, got {raw!r}")
    fields = KVEventsConfig.__dataclass_fields__
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ValueError(f"kv_events_config.{unknown[0]}: not a KV events setting (known: {', '.join(fields)})")
    values = dict(raw)
    if not isinstance(values.get("enable_kv_cache_events", False), bool):
        raise ValueError("kv_events_config.enable_kv_cache_events: must be true or false")
    publisher = values.get("publisher")
    if publisher is None:
        values["publisher"] = "zmq" if values.get("enable_kv_cache_events") else "null"
    elif publisher not in ("null", "zmq"):
        raise ValueError(f"kv_events_config.publisher: {publisher!r} is not one of null, zmq")
    for key in ("buffer_steps", "hwm", "max_queue_size"):
        value = values.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kv_events_config.{key}: must be a positive integer, got {value!r}")
    for key in ("endpoint", "topic"):
        if not isinstance(values.get(key, ""), str):
            raise ValueError(f"kv_events_config.{key}: must be a string")
    for key in ("endpoint", "replay_endpoint"):
        endpoint = values.get(key)
        if endpoint is not None and (not isinstance(endpoint, str) or "://" not in endpoint):
            raise ValueError(f"kv_events_config.{key}: {endpoint!r} is not a ZeroMQ endpoint (tcp://host:port, "
                             "ipc://path or inproc://name)")
    config = KVEventsConfig(**values)
    if config.publishes:
        check_int_hashes_env()
    return config


def check_int_hashes_env() -> None:
    """Refuses VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (whole digests in the events) by name."""
    raw = os.environ.get(INT_HASHES_ENV, "1").strip()
    try:
        as_int = bool(int(raw))
    except ValueError:
        raise ValueError(f"{INT_HASHES_ENV}={raw!r}: must be 0 or 1") from None
    if not as_int:
        raise ValueError(f"{INT_HASHES_ENV}=0: ferrox publishes block hashes as integers only (the digest's low "
                         "64 bits, vLLM's default form); unset it or set it to 1")


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """A data-parallel core's endpoint: tcp ports shifted by its index, other transports suffixed."""
    if endpoint is None or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


