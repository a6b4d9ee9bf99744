"""From the core's per-step numpy arrays to device tensors and the attention metadata.

One path for every step the model runs: real steps (the model runner), and the dummy steps of
memory profiling, kernel warm-up and CUDA-graph capture (worker/dummy_batch.py), which are
scheduled by a throwaway core `Scheduler` so their arrays come from the same code.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ferrox.attention.metadata import AttentionMetadata


def _as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    if not array.flags.writeable:
        # torch.from_numpy warns on read-only buffers; a copy of a few KB is cheaper than the warning.
        array = array.copy()
    t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class Uploader:
    """Moves the core's per-step numpy arrays to the model's device.

    CPU: wraps them without a copy. GPU: stages them in reusable pinned host buffers so the copies
    are truly asynchronous. There are two sets of buffers, alternating by step (`next_step`): with
    async scheduling step N+1 is staged while step N (whose copies may still be queued) runs, and
    by then step N-1's sampled tokens have been read back, which waited for its copies.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}
        self._parity = 0

    def next_step(self) -> None:
        self._parity ^= 1

    def _staging(self, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
        """This parity's pinned buffer `name`, at least `size` elements of dtype."""
        key = (name, self._parity)
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < size or buf.dtype != dtype:
            buf = torch.empty(max(2 * size, 1024), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        return buf

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cpu":
            return _as_tensor(array, self.device)
        host = self._staging(name, array.size, _torch_dtype(array.dtype))[: array.size].view(array.shape)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=True)

    def many(self, name: str, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """Several arrays in one host-to-device copy: packed into one pinned buffer (`name`), each
        at a 16-byte boundary (the alignment Triton specialises pointers on, as a buffer of its own
        has), copied once, and returned as views of the one device buffer. On an H200 each copy
        costs ~4.5 us of a decode step's critical path whatever its size, and a step has ~10."""
        if self.device.type == "cpu":
            return [_as_tensor(a, self.device) for a in arrays]
        offsets = packed_offsets(arrays)
        host = self._staging(name, offsets[-1], torch.uint8)[: offsets[-1]]
        pack_arrays(arrays, offsets, host.numpy())
        return unpack_views(host.to(self.device, non_blocking=True), arrays, offsets)


_ALIGN = 16


def packed_offsets(arrays: list[np.ndarray]) -> list[int]:
    """Byte offsets of the arrays packed one after another at _ALIGN boundaries, and the end."""
    offsets = [0]
    for a in arrays:
        offsets.append(offsets[-1] + -(-a.nbytes // _ALIGN) * _ALIGN)
    return offsets


def pack_arrays(arrays: list[np.ndarray], offsets: list[int], out: np.ndarray) -> None:
    """Copy each array's elements into the uint8 buffer `out` at its offset."""
    for a, off in zip(arrays, offsets[:-1], strict=True):
        out[off:off + a.nbytes].view(a.dtype)[...] = a.reshape(-1)


def unpack_views(packed: torch.Tensor, arrays: list[np.ndarray], offsets: list[int]) -> list[torch.Tensor]:
    """Views of the uint8 tensor `packed` with each array's dtype and shape."""
    return [packed[off:off + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, off in zip(arrays, offsets[:-1], strict=True)]


@functools.cache
def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """(Cached: asked for every array of every step.)"""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def attention_metadata(so: Any, upload: Uploader) -> AttentionMetadata:
    """The attention metadata of a scheduled step (`ferrox._core.SchedulerOutput`)."""
    return step_tensors(so, upload)[0]


def step_tensors(so: Any, upload: Uploader, *extra: np.ndarray) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """The attention metadata of a scheduled step and the `extra` arrays (the step's input ids,
    positions, ...) on the device, all in one copy (`Uploader.many`)."""
    dev = upload.device
    qsl_np = so.query_start_loc
    seq_lens_np = so.seq_lens
    max_query_len = int(so.num_scheduled_tokens.max())
    slot_mapping, qsl, seq_lens, block_table, *rest = upload.many(
        "step", [so.slot_mapping, qsl_np, seq_lens_np, so.block_table, *extra])
    # On CPU those are the host tensors already (wrapped, not copied).
    qsl_cpu = qsl if dev.type == "cpu" else _as_tensor(qsl_np, torch.device("cpu"))
    seq_lens_cpu = seq_lens if dev.type == "cpu" else _as_tensor(seq_lens_np, torch.device("cpu"))
    meta = AttentionMetadata(
        num_actual_tokens=int(so.num_tokens),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens_np.max()),
        slot_mapping=slot_mapping,
        query_start_loc=qsl,
        seq_lens=seq_lens,
        block_table=block_table,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        decode_only=max_query_len == 1,
    )
    return meta, rest
