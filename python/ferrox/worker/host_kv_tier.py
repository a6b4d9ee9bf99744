"""The host memory of the prefix cache's second tier (--kv-offloading-size; the Rust core's host_tier.rs
decides which slot holds which block): one pinned tensor per layer shaped like the device cache with a
slot axis in place of the block axis, and the step's copies between the two.

Each step's copies are queued before its forward, on the same stream, in the core's order: every offload
(a device block the core evicted from its cache -> a host slot), then every load (a host slot -> a device
block a request took for its prefix). A device block evicted and refilled in one step is thus read before
it is written, and the forward reads loaded blocks like computed ones. Every tensor-parallel rank runs
the same copies on its own KV heads (the driver sends the four index arrays with the step).

On a GPU a copy is one kernel per layer and direction that reads or writes the pinned host rows itself
(kernels/block_copy.py): no host thread waits for it, and the stream orders a slot's write before any
later step's read of it. The cost of the tier is the bus time of the blocks moved, paid only in steps
that evict or reuse cached blocks. On a CPU the same copies are torch index ops.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ferrox.kernels.block_copy import copy_blocks
from ferrox.kv_transfer_config import parse_kv_transfer_config

TRANSFER_ARRAYS = ("kv_offload_blocks", "kv_offload_slots", "kv_load_slots", "kv_load_blocks")


def block_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes one block takes over every layer of this rank's cache."""
    return sum(c[:, :1].numel() * c.element_size() for c in kv_caches)


def host_tier_slots(size_gib: float | None, kv_caches: list[torch.Tensor], tp_size: int) -> int:
    """Blocks a rank's share of size_gib (vLLM's: summed over the tensor-parallel ranks) holds; 0 without."""
    if not size_gib:
        return 0
    return int(size_gib * (1 << 30)) // max(1, tp_size) // block_bytes(kv_caches)


def configured_slots(config: Any, kv_caches: list[torch.Tensor]) -> int:
    """Blocks this rank's tier holds, from --kv-offloading-size or --kv-transfer-config's OffloadingConnector
    (kv_transfer_config.py); 0 without a tier. A size that holds no block is refused naming its setting."""
    tier = parse_kv_transfer_config(config.kv_transfer_config, config.block_size)
    if tier is not None and tier.blocks_per_rank is not None:
        return tier.blocks_per_rank
    gib = tier.gib if tier is not None else config.kv_offloading_size
    slots = host_tier_slots(gib, kv_caches, config.tensor_parallel_size)
    if gib and not slots:
        name = "kv_transfer_config" if tier is not None else "kv_offloading_size"
        raise ValueError(f"{name}: {gib} GiB holds no block (one block of every layer takes "
                         f"{block_bytes(kv_caches)} bytes on each rank)")
    return slots


def transfer_arrays(step: Any) -> dict[str, np.ndarray]:
    """A SchedulerOutput's copies for the other ranks' step message (none when it has none)."""
    if not step.num_kv_transfers:
        return {}
    return {name: np.asarray(getattr(step, name)) for name in TRANSFER_ARRAYS}


class HostKvTier:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"kv_offloading_size: holds no block (one block of every layer needs "
                             f"{block_bytes(kv_caches)} bytes on each rank)")
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        pin = self.device.type == "cuda"
        # [planes, slots, block_size, heads, head_dim] per layer, as the device cache's [planes, blocks, ...]
        self.host = [torch.zeros((c.shape[0], num_slots, *c.shape[2:]), dtype=c.dtype, pin_memory=pin)
                     for c in kv_caches]
        self.num_slots = num_slots

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    def apply(self, step: Any) -> None:
        """Run a step's copies (a SchedulerOutput, or StepArrays on another rank), offloads first."""
        if not getattr(step, "num_kv_transfers", 0):
            return
        blocks, slots = self._indices(step.kv_offload_blocks), self._indices(step.kv_offload_slots)
        if blocks.numel():
            for cache, host in zip(self.kv_caches, self.host, strict=True):
                self._copy(cache, host, blocks, slots)
        slots, blocks = self._indices(step.kv_load_slots), self._indices(step.kv_load_blocks)
        if blocks.numel():
            for cache, host in zip(self.kv_caches, self.host, strict=True):
                self._copy(host, cache, slots, blocks)

    def _indices(self, array: Any) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device, non_blocking=True)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        if self.device.type == "cuda":
            copy_blocks(src, dst, src_index, dst_index)  # the device reads / writes the pinned rows itself
        else:
            dst.index_copy_(1, dst_index, src.index_select(1, src_index))
