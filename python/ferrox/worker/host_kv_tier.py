"""The host memory of the prefix cache's second tier (--kv-offloading-size; the Rust core's host_tier.rs
decides which slot holds which block): one pinned tensor per layer shaped like the device cache with a
slot axis in place of the block axis, and the step's copies between the two.

Each step's copies run before its forward, on the same stream, in the core's order: every offload (a
device block the core evicted from its cache -> a host slot), then every load (a host slot -> a device
block a request took for its prefix). A device block evicted and refilled in one step is thus read before
it is written, and the forward reads loaded blocks like computed ones. Every tensor-parallel rank runs
the same copies on its own KV heads (the driver sends the four index arrays with the step).

The copies gather the step's blocks into one tensor per layer and move it in one transfer each way. They
wait for their own transfer (an offload's host write must land before a later step reads the slot), which
is the cost of the host tier, paid only in steps that evict or reuse cached blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

TRANSFER_ARRAYS = ("kv_offload_blocks", "kv_offload_slots", "kv_load_slots", "kv_load_blocks")


def block_bytes(kv_caches: list[torch.Tensor]) -> int:
    """Bytes one block takes over every layer of this rank's cache."""
    return sum(c[:, :1].numel() * c.element_size() for c in kv_caches)


def host_tier_slots(size_gib: float | None, kv_caches: list[torch.Tensor], tp_size: int) -> int:
    """Blocks a rank's share of size_gib (vLLM's: summed over the tensor-parallel ranks) holds; 0 without."""
    if not size_gib:
        return 0
    return int(size_gib * (1 << 30)) // max(1, tp_size) // block_bytes(kv_caches)


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
        self._stages: dict[tuple[int, bool], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    def apply(self, step: Any) -> None:
        """Run a step's copies (a SchedulerOutput, or StepArrays on another rank), offloads first."""
        if not getattr(step, "num_kv_transfers", 0):
            return
        blocks, slots = np.asarray(step.kv_offload_blocks), np.asarray(step.kv_offload_slots)
        if blocks.size:
            dev_idx = torch.from_numpy(blocks).to(self.device, non_blocking=True)
            host_idx = torch.from_numpy(slots)
            staged = [self._staging(host, blocks.size) for host in self.host]
            for cache, stage in zip(self.kv_caches, staged, strict=True):  # gathered on the device, one copy each
                stage.copy_(cache.index_select(1, dev_idx), non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the host rows must be there to scatter
            for host, stage in zip(self.host, staged, strict=True):
                host.index_copy_(1, host_idx, stage)
        slots, blocks = np.asarray(step.kv_load_slots), np.asarray(step.kv_load_blocks)
        if blocks.size:
            dev_idx = torch.from_numpy(blocks).to(self.device, non_blocking=True)
            host_idx = torch.from_numpy(slots)
            for cache, host in zip(self.kv_caches, self.host, strict=True):
                # Gathered on the host into pinned memory, then one asynchronous copy to the device.
                stage = torch.index_select(host, 1, host_idx, out=self._staging(host, blocks.size, load=True))
                cache.index_copy_(1, dev_idx, stage.to(self.device, non_blocking=True))
            if self.device.type == "cuda":
                # The load staging is reused by the next step's loads: their copies must have read it.
                torch.cuda.current_stream(self.device).synchronize()

    def _staging(self, host: torch.Tensor, blocks: int, load: bool = False) -> torch.Tensor:
        """A contiguous pinned [planes, blocks, ...] buffer like `host`'s rows (contiguous, so a copy from it is
        one asynchronous transfer), kept per layer and direction and grown as needed."""
        shape = (host.shape[0], blocks, *host.shape[2:])
        numel = int(np.prod(shape))
        key = (id(host), load)
        buf = self._stages.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 16 * numel // blocks), dtype=host.dtype,
                              pin_memory=self.device.type == "cuda")
            self._stages[key] = buf
        return buf[:numel].view(shape)
