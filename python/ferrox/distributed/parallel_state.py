"""The tensor-parallel group of this process, and the collectives model code calls.

A model is built under `use_tp_group(group)`; its parallel layers read `get_tp_group()` once, at
construction, and keep it. Outside any TP setup the group is the trivial one (rank 0 of 1) and
every collective is a no-op, so single-device code pays nothing.

Two torch.distributed groups per TP group:
- `device_group`: the collectives of the forward pass (all-reduce after row-parallel layers,
  the logits gather, the input-ids broadcast): NCCL on CUDA (captured by CUDA graphs), gloo on CPU.
- `cpu_group`: gloo, for host-side traffic between ranks (the per-step arrays, the KV block
  count agreed at start-up). On CPU it is the same group as `device_group`.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# A collective that waits longer than this means a peer is gone (its process died or hung);
# gloo then raises instead of waiting forever. Generous: a start-up phase (weight loading,
# CUDA-graph capture) of one rank may run long before the next collective.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    # MoE layers: split the experts across the ranks (each rank holds E/N whole experts) instead of
    # sharding every expert's intermediate dimension (vLLM's --enable-expert-parallel).
    expert_parallel: bool = False

    @property
    def is_driver(self) -> bool:
        """Rank 0 schedules, samples and returns tokens; the others only run their shard."""
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (the same shape and dtype on each), in rank order (the data-parallel vision
        encoder's embeddings: worker/multimodal.py)."""
        if self.size == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.device_group)
        return parts

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's list of ints (the same length on each), host side, in rank order."""
        if self.size == 1:
            return [list(values)]
        t = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.cpu_group)
        return [p.tolist() for p in parts]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=src, group=self.device_group)
        return x

    def min_int(self, value: int) -> int:
        """The smallest of every rank's value (host side): e.g. the KV blocks every rank can hold."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.cpu_group)


_TRIVIAL = TPGroup()
_current: TPGroup = _TRIVIAL


def get_tp_group() -> TPGroup:
    return _current


@contextlib.contextmanager
def use_tp_group(group: TPGroup) -> Iterator[TPGroup]:
    """Build models inside this block to shard them over `group`."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def check_no_tp_group() -> None:
    """Refuse a second tensor-parallel engine while this process is in a process group (called
    before any rank starts, so a refused engine leaves no rank process behind)."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        raise ValueError("tensor_parallel_size: a tensor-parallel engine in this process still holds the process "
                         "group; shut it down (llm.engine.shutdown()) before starting another")
    raise ValueError("tensor_parallel_size: this process already ran a tensor-parallel engine on the GPU, whose "
                     "NCCL group lives until the process exits; start the next one in a new process")


def init_tp_group(rank: int, size: int, init_method: str, device_type: str, expert_parallel: bool = False) -> TPGroup:
    """Join the process group of `size` ranks (every rank calls this with the same init_method,
    e.g. tcp://127.0.0.1:PORT). NCCL carries the forward's collectives on CUDA, gloo on CPU."""
    if size == 1:
        return _TRIVIAL
    backend = "nccl" if device_type == "cuda" else "gloo"
    check_no_tp_group()
    dist.init_process_group(backend=backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    world = dist.group.WORLD
    cpu_group = world if backend == "gloo" else dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return TPGroup(rank=rank, size=size, device_group=world, cpu_group=cpu_group, expert_parallel=expert_parallel)


# Leaving the process group must not hang shutdown: NCCL's teardown can wait on a peer that is
# already gone. It runs in a daemon thread and is abandoned after this long.
DESTROY_TIMEOUT_S = 10.0


def destroy_tp_group(group: TPGroup, timeout_s: float = DESTROY_TIMEOUT_S) -> None:
    """Leave the process group (so a later engine in this process can form a new one). Every
    rank calls it at about the same time (after the driver's SHUTDOWN).

    Only gloo groups (CPU) are torn down. Tearing down NCCL here stalled (H200 x2, torch 2.11:
    destroy_process_group waited forever once a peer had exited) or aborted the process when run
    beside CUDA work; so on GPUs the group stays until the process exits, and a second
    tensor-parallel engine in the same process is refused (init_tp_group)."""
    if group.size == 1 or not dist.is_initialized() or dist.get_backend() != "gloo":
        return

    def destroy() -> None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    thread = threading.Thread(target=destroy, name="ferrox-tp-destroy", daemon=True)
    thread.start()
    thread.join(timeout_s)
