"""Device state of the requests with repetition / frequency / presence penalties: one row each of
two persistent tensors, the occurrence counts of every token in the request's output and the
mask of the tokens in its prompt.

Rows live in one [rows, V] tensor each (not one [V] tensor per request) so that a step touches
them in bulk: the accepted tokens of every penalty request are counted with one `index_add_`,
and the sampler's [R, V] inputs are one `index_select` each. Per-request tensors cost a stack and
an accumulating `index_put_` (a sort and several launches) per request per step, which showed in
batches mixing penalties with plain requests (benches/RESULTS.md, twelfth session).

A row is taken when a penalty request joins the batch and given back when it leaves (preemption
keeps it). The tensors grow by doubling, copying the rows in use on the device, in stream order,
so a step already queued still reads the old tensors it gathered from.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


class PenaltyRows:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)  # [rows, V]
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [rows, V]
        self._free: list[int] = []
        self._ones = torch.ones(0, dtype=torch.float32, device=device)

    def acquire(self, prompt_token_ids: list[int]) -> int:
        """A zeroed row for a joining request, its prompt mask written (without blocking: the mask
        is built on the host and copied from pinned memory while a step may be in flight)."""
        if not self._free:
            self._grow(max(8, 2 * self.counts.shape[0]))
        row = self._free.pop()
        self.counts[row].zero_()
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        if prompt_token_ids:
            mask[torch.tensor(prompt_token_ids, dtype=torch.int64).clamp(max=self.vocab_size - 1)] = True
        if self.device.type == "cpu":
            self.prompt_mask[row] = mask
        else:
            self.prompt_mask[row].copy_(mask.pin_memory(), non_blocking=True)
        return row

    def release(self, row: int) -> None:
        self._free.append(row)

    def _grow(self, rows: int) -> None:
        old = self.counts.shape[0]
        counts = torch.zeros(rows, self.vocab_size, dtype=torch.float32, device=self.device)
        mask = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        mask[:old] = self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self._free.extend(range(rows - 1, old - 1, -1))  # lowest rows first

    def ones(self, n: int) -> torch.Tensor:
        """n ones on the device (the increments of `index_add_`), from one persistent buffer."""
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 256), dtype=torch.float32, device=self.device)
        return self._ones[:n]

    def count(self, flat_index: torch.Tensor) -> None:
        """Add one occurrence per entry of flat_index (row * V + token, int64 on the device)."""
        self.counts.view(-1).index_add_(0, flat_index, self.ones(flat_index.numel()))


def flat_indices(rows: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64], vocab_size: int) -> npt.NDArray[np.int64]:
    """row * V + token for each (row, token) pair, the index into a [rows, V] tensor's flat view."""
    return rows.astype(np.int64) * vocab_size + tokens.astype(np.int64)
