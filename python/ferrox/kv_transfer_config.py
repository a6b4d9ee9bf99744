"""vLLM's --kv-transfer-config: the KV connector that moves KV blocks into and out of the engine.

ferrox has one of vLLM's connectors: the OffloadingConnector (CPU offloading), which is the prefix
cache's host tier (--kv-offloading-size is vLLM's shorthand for it; rust/host_tier.rs,
worker/host_kv_tier.py). Its size comes from `kv_connector_extra_config`: `cpu_bytes_to_use` (bytes over
all tensor-parallel ranks, as --kv-offloading-size's GiB) or `num_cpu_blocks` (host blocks on each rank,
vLLM's older key). Connectors for disaggregated prefill (NixlConnector, P2pNcclConnector, Mooncake...),
LMCache, storage and multi-connectors move KV between engines or to services ferrox does not have: they
are refused by name, as is every key ferrox would otherwise ignore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OFFLOADING_CONNECTOR = "OffloadingConnector"
_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")
_EXTRA_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "spec_name", "eviction_policy")


@dataclass(frozen=True, slots=True)
class HostTierSize:
    """The host tier a kv_transfer_config asks for: GiB over all ranks, or blocks on each rank."""

    gib: float | None = None
    blocks_per_rank: int | None = None


def parse_kv_transfer_config(raw: Any, block_size: int) -> HostTierSize | None:
    """The host tier the config asks for (None without a config); a ValueError naming what ferrox lacks."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"kv_transfer_config: must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - set(_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config.{unknown[0]}: not supported (ferrox's one connector, "
                         f"{OFFLOADING_CONNECTOR}, takes {', '.join(_KEYS)})")
    connector = raw.get("kv_connector")
    if connector != OFFLOADING_CONNECTOR:
        raise ValueError(f"kv_transfer_config.kv_connector: {connector!r} is not supported: ferrox has vLLM's "
                         f"{OFFLOADING_CONNECTOR} only (KV offloading to host memory; disaggregated prefill, LMCache "
                         "and storage connectors are not there)")
    if raw.get("kv_role", "kv_both") != "kv_both":
        raise ValueError(f"kv_transfer_config.kv_role: {raw['kv_role']!r}: the {OFFLOADING_CONNECTOR} both stores "
                         "and loads blocks ('kv_both'); producer / consumer roles belong to disaggregated prefill")
    extra = raw.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError("kv_transfer_config.kv_connector_extra_config: must be a JSON object")
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{unknown[0]}: not supported (known: "
                         f"{', '.join(_EXTRA_KEYS)})")
    _check_extra(extra, block_size)
    if "cpu_bytes_to_use" in extra and "num_cpu_blocks" in extra:
        raise ValueError("kv_transfer_config.kv_connector_extra_config: cpu_bytes_to_use and num_cpu_blocks both size "
                         "the host tier: give one")
    if "cpu_bytes_to_use" in extra:
        return HostTierSize(gib=extra["cpu_bytes_to_use"] / (1 << 30))
    if "num_cpu_blocks" in extra:
        return HostTierSize(blocks_per_rank=extra["num_cpu_blocks"])
    raise ValueError("kv_transfer_config.kv_connector_extra_config: the host tier needs a size: cpu_bytes_to_use "
                     "(bytes over all ranks) or num_cpu_blocks (blocks on each rank)")


def _check_extra(extra: dict[str, Any], block_size: int) -> None:
    where = "kv_transfer_config.kv_connector_extra_config"
    for key in ("cpu_bytes_to_use", "num_cpu_blocks"):
        value = extra.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{key}: must be a positive integer, got {value!r}")
    if "block_size" in extra and extra["block_size"] != block_size:
        # vLLM offloads groups of block_size tokens; ferrox's tier keeps the KV cache's own blocks, so a
        # group of another size would be accepted and not honoured.
        raise ValueError(f"{where}.block_size: {extra['block_size']!r}: ferrox's host tier keeps blocks of "
                         f"--block-size tokens ({block_size}); leave it out or give that")
    if extra.get("spec_name", "CPUOffloadingSpec") != "CPUOffloadingSpec":
        raise ValueError(f"{where}.spec_name: {extra['spec_name']!r}: ferrox has the one host-memory tier "
                         "(CPUOffloadingSpec)")
    if extra.get("eviction_policy", "lru") != "lru":
        raise ValueError(f"{where}.eviction_policy: {extra['eviction_policy']!r}: ferrox's host tier evicts the "
                         "least recently used block ('lru')")
