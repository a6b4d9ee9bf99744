"""The runner's side of custom logits processors (ferrox/logits_processor.py): which request holds which
logits row, told to each processor as vLLM's BatchUpdate before every step, and each request's output
tokens kept current in the list the processors were handed.

A step's logits rows are its requests in the scheduler's order, which changes from step to step (a
request finishes, another arrives, one is not scheduled this step and comes back later). The update from
the last step's rows to this step's is written as: removed (rows whose request is not in this step), added
(new requests, each at a row free after the removals), then moves (swaps, or a move into an empty row)
that put every request on its row of this step. Rows stay below the larger of the two steps' sizes,
so a processor may keep per-row state in a table of max_num_seqs rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from ferrox.sampling_params import SamplingParams


@dataclass(eq=False, slots=True)
class _Request:
    params: SamplingParams
    prompt_ids: list[int] | None
    output_ids: list[int] = field(default_factory=list)  # the list processors hold: appended in place


class CustomLogitsProcessors:
    def __init__(self, classes: Sequence[type[LogitsProcessor]], config: Any, device: torch.device) -> None:
        pinned = device.type == "cuda"
        self.processors = [cls(config, device, pinned) for cls in classes]
        self.names = [cls.__name__ for cls in classes]
        self._by_slot: dict[int, _Request] = {}
        self._rows: list[_Request] = []  # the last step's row -> request

    def add(self, slot: int, params: SamplingParams, prompt_ids: list[int] | None) -> None:
        self._by_slot[slot] = _Request(params, prompt_ids)

    def remove(self, slots: Sequence[int] | npt.NDArray[np.int32]) -> None:
        """The requests left the core; their rows are reported removed at the next step."""
        for slot in np.asarray(slots).tolist():
            self._by_slot.pop(int(slot), None)

    def batch_update(self, slots: npt.NDArray[np.int32]) -> BatchUpdate | None:
        """From the last step's rows to this step's (`slots`, one per row); None when they are the same."""
        cur = [self._by_slot[int(s)] for s in slots.tolist()]
        prev = self._rows
        self._rows = cur
        if len(cur) == len(prev) and all(a is b for a, b in zip(cur, prev, strict=True)):
            return None
        live = {id(r) for r in cur}
        removed = [i for i, r in enumerate(prev) if id(r) not in live]
        at: dict[int, _Request] = {i: r for i, r in enumerate(prev) if id(r) in live}  # row -> request
        pos: dict[int, int] = {id(r): i for i, r in at.items()}
        # New requests go to rows free after the removals (their own row when it is free); there is always
        # one below the larger size, as the requests placed so far are fewer than this step's.
        bound = max(len(prev), len(cur))
        added = []
        for row, req in enumerate(cur):
            if id(req) in pos:
                continue
            index = row if row not in at else next(i for i in range(bound) if i not in at)
            at[index], pos[id(req)] = req, index
            added.append((index, req.params, req.prompt_ids, req.output_ids))
        moved = []
        for row, req in enumerate(cur):
            src = pos[id(req)]
            if src == row:
                continue
            other = at.get(row)
            if other is None:
                moved.append((src, row, MoveDirectionality.UNIDIRECTIONAL))
                del at[src]
            else:
                moved.append((src, row, MoveDirectionality.SWAP))
                at[src], pos[id(other)] = other, src
            at[row], pos[id(req)] = req, row
        return BatchUpdate(batch_size=len(cur), removed=removed, added=added, moved=moved)

    def begin_step(self, slots: npt.NDArray[np.int32]) -> None:
        update = self.batch_update(slots)
        for processor in self.processors:
            processor.update_state(update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Every processor over the step's logits (rows as in begin_step), in place."""
        for processor in self.processors:
            out = processor.apply(logits)
            if out is not logits:
                logits.copy_(out)
        return logits

    def record(self, slots: npt.NDArray[np.int32], sample_mask: npt.NDArray[np.bool_],
               token_ids: npt.NDArray[Any]) -> None:
        """The step's sampled tokens into their requests' output lists (rows that sampled)."""
        for slot, sampled, token in zip(slots.tolist(), sample_mask.tolist(), token_ids.tolist(), strict=True):
            req = self._by_slot.get(int(slot))
            if sampled and req is not None:
                req.output_ids.append(int(token))
