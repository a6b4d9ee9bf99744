"""From the core's per-step numpy arrays to device tensors and the attention metadata.

One path for every step the model runs: real steps (the model runner), and the dummy steps of
memory profiling, kernel warm-up and CUDA-graph capture (worker/dummy_batch.py), which are
scheduled by a throwaway core `Scheduler` so their arrays come from the same code.
"""

from __future__ import annotations

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

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cpu":
            return _as_tensor(array, self.device)
        key = (name, self._parity)
        buf = self._pinned.get(key)
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        if buf is None or buf.numel() < array.size or buf.dtype != dtype:
            buf = torch.empty(max(2 * array.size, 1024), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        host = buf[: array.size].view(array.shape)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=True)


def attention_metadata(so: Any, upload: Uploader) -> AttentionMetadata:
    """The attention metadata of a scheduled step (`ferrox._core.SchedulerOutput`)."""
    dev = upload.device
    qsl_np = so.query_start_loc
    seq_lens_np = so.seq_lens
    max_query_len = int(so.num_scheduled_tokens.max())
    qsl_cpu = _as_tensor(qsl_np, torch.device("cpu"))
    seq_lens_cpu = _as_tensor(seq_lens_np, torch.device("cpu"))
    return AttentionMetadata(
        num_actual_tokens=int(so.num_tokens),
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens_np.max()),
        slot_mapping=upload("slot_mapping", so.slot_mapping),
        query_start_loc=qsl_cpu if dev.type == "cpu" else upload("query_start_loc", qsl_np),
        seq_lens=seq_lens_cpu if dev.type == "cpu" else upload("seq_lens", seq_lens_np),
        block_table=upload("block_table", so.block_table),
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=seq_lens_cpu,
        decode_only=max_query_len == 1,
    )
