"""The driver rank's per-step message to the other tensor-parallel ranks.

The Rust scheduler runs once, on rank 0 (the driver). Every other rank runs the same forward
pass on its shard, so each step the driver sends it the step's flat arrays (input ids, positions,
slot mapping, block table, ...): one message of two gloo broadcasts over the TP group's CPU
group, a fixed header (command, payload bytes) then the arrays packed back to back. No
per-request objects travel, only numpy arrays, and the receiver rebuilds them without copying.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.distributed as dist

from ferrox.distributed.parallel_state import TPGroup

STEP = 1  # run the forward pass of these arrays
SHUTDOWN = 2  # leave the worker loop
SLEEP = 3  # release the memory of these tags (worker/sleep_control.py tag_array), then a barrier
WAKE = 4  # take that memory again
RELOAD = 5  # read the weights again from the checkpoint (reload_weights), then a barrier
MTP_PASS = 6  # the MTP layer's pass over the last step's pairs (worker/mtp_proposer.py run_pass)
MTP_ROUNDS = 7  # its chained drafts (run_rounds)


class StepChannel:
    def __init__(self, tp: TPGroup) -> None:
        if tp.size < 2:
            raise ValueError("a step channel needs at least two ranks")
        self.tp = tp
        self._header = torch.zeros(2, dtype=torch.int64)

    def send(self, command: int, arrays: dict[str, np.ndarray] | None = None) -> None:
        """Driver: broadcast one command (and its arrays) to every other rank."""
        payload = pack(arrays or {})
        self._header[0], self._header[1] = command, payload.size
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)
        if payload.size:
            dist.broadcast(torch.from_numpy(payload), src=0, group=self.tp.cpu_group)

    def recv(self) -> tuple[int, dict[str, np.ndarray]]:
        """Other ranks: wait for the driver's next command."""
        dist.broadcast(self._header, src=0, group=self.tp.cpu_group)
        command, size = int(self._header[0]), int(self._header[1])
        if not size:
            return command, {}
        buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.tp.cpu_group)
        return command, unpack(buf.numpy())


def _pad8(n: int) -> int:
    return -n % 8


def pack(arrays: dict[str, np.ndarray]) -> np.ndarray:
    """[u32 layout length][layout json][array bytes...] as one uint8 array; every array starts on
    an 8-byte boundary so the receiver's views are aligned."""
    layout = []
    chunks = []
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        layout.append((name, array.dtype.str, list(array.shape)))
        raw = array.reshape(-1).view(np.uint8)
        chunks.append(raw)
        chunks.append(np.zeros(_pad8(raw.size), dtype=np.uint8))
    head = len(json.dumps(layout).encode()).to_bytes(4, "little") + json.dumps(layout).encode()
    head += bytes(_pad8(len(head)))
    return np.concatenate([np.frombuffer(head, dtype=np.uint8), *chunks])


def unpack(buf: np.ndarray) -> dict[str, np.ndarray]:
    n = int.from_bytes(buf[:4].tobytes(), "little")
    layout = json.loads(buf[4 : 4 + n].tobytes())
    out: dict[str, np.ndarray] = {}
    offset = 4 + n + _pad8(4 + n)
    for name, dtype_str, shape in layout:
        dtype = np.dtype(dtype_str)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out[name] = buf[offset : offset + nbytes].view(dtype).reshape(shape)
        offset += nbytes + _pad8(nbytes)
    return out
