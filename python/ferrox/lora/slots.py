"""GPU slots of multi-LoRA: which adapter sits in which slot, and which slot each token runs.

- `SlotTable`: max_loras slots on the device, assigned to adapter ids least-recently-used first.
  A step names the adapters it needs; the ones without a slot take a free slot, else the slot of
  the adapter used longest ago that this step does not need (the caller then copies the adapter's
  weights into it).
- `TokenSlots`: the persistent device buffers the wrapped layers read: each token's slot
  (`buffer`, -1: base model), and the same grouped by slot for the Triton kernels (`order`: the
  rows, base rows first, then each slot's; `sorted_slots`: their slots). They are allocated once
  (max_num_tokens entries) and rewritten in place each step, so a CUDA graph captured on them
  replays with the new step's slots; entries past the step's tokens hold slot -1, so a graph's
  padding rows get no delta. On the host it keeps each slot's rows for the torch path, which
  would otherwise read the buffer back (a device sync). A speculative verify step replayed in a
  CUDA graph moves its tokens to padded rows (worker/cuda_graphs.py): `relayout` moves the slots
  with them, on the device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from ferrox.lora.torch_delta import SlotGroups


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._free = list(range(num_slots))

    def slot_of(self, lora_int_id: int) -> int | None:
        return self._slot_of.get(lora_int_id)

    def assign(self, lora_int_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Give every id of a step a slot; returns the (id, slot) pairs whose weights must be copied
        in. The caller checks len(lora_int_ids) <= num_slots."""
        if len(lora_int_ids) > self.num_slots:
            raise ValueError(f"{len(lora_int_ids)} adapters for {self.num_slots} slots")
        for lora_int_id in lora_int_ids:
            if lora_int_id in self._slot_of:
                self._slot_of.move_to_end(lora_int_id)
        loads = []
        for lora_int_id in lora_int_ids:
            if lora_int_id in self._slot_of:
                continue
            if self._free:
                slot = self._free.pop(0)
            else:  # this step's ids were just moved to the end: the oldest entry is not one of them
                _, slot = self._slot_of.popitem(last=False)
            self._slot_of[lora_int_id] = slot
            loads.append((lora_int_id, slot))
        return loads

    def release(self, lora_int_id: int) -> None:
        slot = self._slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._free.append(slot)


class TokenSlots:
    def __init__(self, max_num_tokens: int, device: torch.device, *, keep_groups: bool) -> None:
        self.device = device
        # Rows: each token's slot, the order grouped by slot, the slots in that order.
        self._buffers = torch.full((3, max_num_tokens), -1, dtype=torch.int32, device=device)
        self.buffer, self.order, self.sorted_slots = self._buffers.unbind(0)
        self.order.copy_(torch.arange(max_num_tokens, dtype=torch.int32))
        self.keep_groups = keep_groups
        self._dirty = 0  # buffer[:_dirty] may hold slots other than -1
        self._groups: SlotGroups = []
        self._groups_tokens = 0

    @property
    def max_num_tokens(self) -> int:
        return int(self.buffer.shape[0])

    def write(self, slot_of_token: npt.NDArray[np.int32]) -> None:
        """Set the buffers for a step of T tokens; past T every slot is -1 (only the span that
        holds or held a slot is copied)."""
        num_tokens = int(slot_of_token.shape[0])
        used = np.flatnonzero(slot_of_token >= 0)
        end = num_tokens if used.size else 0  # sorted, the adapter rows end the order
        span = max(end, self._dirty)
        if span:
            host = np.full((3, span), -1, dtype=np.int32)
            host[0, :end] = slot_of_token[:end]
            host[1] = np.arange(span, dtype=np.int32)
            order = np.argsort(slot_of_token, kind="stable")
            host[1, :end] = order[:end]
            host[2, :end] = slot_of_token[order[:end]]
            staged = torch.from_numpy(host)
            if self.device.type == "cuda":
                # A fresh pinned block per step: the caching host allocator does not hand it out again
                # before these copies have run, so a step in flight never sees the next step's slots.
                staged = staged.pin_memory()
            for row in range(3):
                self._buffers[row, :span].copy_(staged[row], non_blocking=True)
        self._dirty = end
        self._groups_tokens = num_tokens
        if self.keep_groups:
            present = np.unique(slot_of_token[used])
            self._groups = [(int(s), self._rows(np.flatnonzero(slot_of_token == s))) for s in present]

    def relayout(self, rows: torch.Tensor, span: int) -> None:
        """Move the last step's token slots (T = rows.numel() of them, in step order) to the rows a
        verify graph runs them in (token t at rows[t]); the other rows of the first `span` get -1.
        Device ops only (the graph runner computed `rows` on the device)."""
        if span > self.max_num_tokens:
            raise ValueError(f"a verify step of {span} rows for LoRA token slots of {self.max_num_tokens}")
        slots = self.buffer[: rows.shape[0]].clone()
        self.buffer[:span].fill_(-1)
        self.buffer.index_copy_(0, rows, slots)
        sorted_slots, order = torch.sort(self.buffer[:span], stable=True)
        self.order[:span].copy_(order)
        self.sorted_slots[:span].copy_(sorted_slots)
        self._dirty = max(self._dirty, span)
        self._groups_tokens = -1  # the host's groups are in step order: the torch path reads the buffer

    def groups(self, num_tokens: int) -> SlotGroups | None:
        """Each slot's rows of the last step written, if it had num_tokens tokens (else None: the
        caller works them out from the buffer)."""
        if not self.keep_groups or num_tokens != self._groups_tokens:
            return None
        return self._groups

    def _rows(self, rows: npt.NDArray[np.intp]) -> torch.Tensor:
        tensor = torch.from_numpy(rows.astype(np.int64))
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)
