"""From a step's hidden states to one vector per request.

A step is a flat batch: request i's tokens are rows starts[i]:starts[i + 1] of `hidden`, every prompt
whole (pooling runs with chunked prefill off). The reduction runs on the model's device in float32
(mean pooling sums many rows: bf16 would lose digits); the per-request finish (Matryoshka
truncation, L2 normalisation) runs on the host copy, where each request may want something else.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

# sentence-transformers and torch's F.normalize clamp the norm from below with this.
_NORM_EPS = 1e-12


def pool(hidden: torch.Tensor, starts: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """float32 [num_reqs, hidden_size]. starts: int [num_reqs + 1] row offsets on hidden's device.
    MEAN: the average of a request's rows (sentence-transformers' mean_tokens: every token of the prompt,
    special tokens included); CLS: its first row; LAST: its last row."""
    if pooling_type == "CLS":
        return hidden.index_select(0, starts[:-1].long()).float()
    if pooling_type == "LAST":
        return hidden.index_select(0, starts[1:].long() - 1).float()
    if pooling_type != "MEAN":
        raise ValueError(f"pooling_type: {pooling_type!r} is not MEAN, CLS or LAST")
    lengths = (starts[1:] - starts[:-1]).long()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=hidden.device), lengths)
    sums = torch.zeros(lengths.numel(), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, segment, hidden.float())
    return sums / lengths.clamp(min=1).unsqueeze(1).float()


def finish_vector(vector: npt.NDArray[np.float32], *, dimensions: int | None,
                  normalize: bool) -> npt.NDArray[np.float32]:
    """One request's pooled vector as it asked for it: the first `dimensions` values (Matryoshka), then
    divided by its L2 norm when normalised (truncating first keeps a shortened vector unit length)."""
    out = vector[:dimensions] if dimensions is not None else vector
    if normalize:
        out = out / max(float(np.linalg.norm(out)), _NORM_EPS)
    return np.ascontiguousarray(out, dtype=np.float32)
