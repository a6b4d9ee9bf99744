"""A step's grammar mask, waited for by the device instead of the host (CUDA, async scheduling).

A constrained step samples under a mask that can only be filled once the previous step's tokens
are on the host and have advanced the grammars. If the host waited for the fill, then queued the
sampling and only then the next step's launch, the device would idle for the fill *and* for all
that queueing (about 2 ms a step on the H200: benches/RESULTS.md, "Mixed batches"). Instead the
host queues everything at once, behind a one-program kernel that waits for a counter in pinned host
memory (kernels/host_flag.py); the mask thread writes the mask into pinned memory, then raises the
counter, and the device goes on by itself: the mask's upload, the sampling, the next forward.

Each gate has a sequence number; the counter only grows, so raising it for gate k releases every
gate up to k. The mask thread raises it whether or not its fill succeeded (a failed fill must not
hang the device); the host then fails the constrained rows of that step (`PendingMask.problem`).
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from ferrox.kernels.host_flag import DEFAULT_MAX_POLLS, wait_for_host_flag

# How long the host waits for a fill whose step the device has already finished (it only happens
# when the device gave up waiting, so something is badly wrong with the mask thread).
_FILL_RESULT_TIMEOUT_S = 60.0


@dataclass(slots=True)
class PendingMask:
    """One gated mask: the mask thread fills `host`, then calls release()."""

    seq: int
    rows: npt.NDArray[np.int64]  # the batch rows it constrains, ascending
    host: torch.Tensor  # int32 [len(rows), words], pinned: row i is rows[i]'s allow-bits
    device: torch.Tensor  # its copy on the device, queued behind the wait
    seen: torch.Tensor  # int64 [1], pinned: the counter value that ended the device's wait
    gate: MaskGate
    fill: cf.Future[None] | None = None  # the fill on the mask thread, set by its submitter

    def release(self) -> None:
        """Let the device go past this gate (from the mask thread, once `host` is written)."""
        self.gate.raise_to(self.seq)

    def problem(self) -> str | None:
        """Once the step's tokens are on the host: None if its rows were sampled under the filled
        mask, else why not (the fill failed, or the device stopped waiting for it). Waits for the
        fill to end, so that the matchers are free again for accept_tokens."""
        if self.fill is not None:
            try:
                self.fill.result(timeout=_FILL_RESULT_TIMEOUT_S)
            except cf.TimeoutError:
                return f"the grammar mask was not filled within {_FILL_RESULT_TIMEOUT_S:.0f} s"
            except Exception as e:  # noqa: BLE001 - reported on the request, not raised
                return f"the grammar mask could not be filled: {e}"
        if int(self.seen[0]) < self.seq:
            return "the device stopped waiting for the grammar mask"
        return None


class MaskGate:
    """The counter, and pinned buffers for the masks (two, alternating by gate: a gate's buffer is
    read by the device before the next gate's fill can start, so two leave a step of slack)."""

    def __init__(self, device: torch.device, words: int, max_polls: int = DEFAULT_MAX_POLLS) -> None:
        self.device = device
        self.words = words
        self.max_polls = max_polls
        self._counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._counter_np = self._counter.numpy()
        # Two slots, 16 bytes apart: the kernel's pointers keep one alignment (one compiled variant).
        self._seen = torch.zeros(2, 2, dtype=torch.int64, pin_memory=True)
        self._buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.int32)] * 2
        self._seq = 0

    def open(self, rows: npt.NDArray[np.int64]) -> PendingMask:
        """Queue, on the current stream, the wait for the next gate and the upload of its mask."""
        self._seq += 1
        parity = self._seq & 1
        buf = self._buffers[parity]
        if buf.numel() < rows.size * self.words:
            buf = torch.empty(max(2 * rows.size, 16) * self.words, dtype=torch.int32, pin_memory=True)
            self._buffers[parity] = buf
        host = buf[: rows.size * self.words].view(rows.size, self.words)
        seen = self._seen[parity, :1]
        seen.fill_(0)
        wait_for_host_flag(self._counter, seen, self._seq, self.max_polls)
        device = host.to(self.device, non_blocking=True)
        return PendingMask(self._seq, rows, host, device, seen, self)

    def raise_to(self, seq: int) -> None:
        # The mask thread runs the fills in order; max() keeps a late call from lowering the counter.
        self._counter_np[0] = max(int(self._counter_np[0]), seq)

    def release_all(self) -> None:
        """Nothing may stay waiting (shutdown)."""
        self.raise_to(self._seq)
