"""The vocabulary-parallel input embedding and LM head.

Each rank holds ceil(vocab / N) rows of the table (sharding.vocab_range). The embedding looks up
the ids that fall in its rows, zeroes the others, and one all-reduce sums the ranks' rows into
every token's embedding. The LM head multiplies by the same row split (a tied head *is* the
embedding shard) and the ranks' logit columns are gathered once, padding dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.sharding import Weight, materialize, narrow, shape_of, vocab_range


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str | None):
        super().__init__()
        self.tp: TPGroup = get_tp_group()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.num_rows, padded = vocab_range(vocab_size, self.tp.size, self.tp.rank)
        rows = vocab_size if self.tp.size == 1 else padded
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        mine = (local >= 0) & (local < self.num_rows)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out.mul_(mine.unsqueeze(-1).to(out.dtype))
        return self.tp.all_reduce(out)

    def load_weight(self, param_name: str, tensor: Weight, shard: str | None = None) -> None:
        if param_name != "weight":
            raise ValueError(f"{param_name} given for an embedding (it has only a weight)")
        shape = shape_of(tensor)
        if shape != (self.vocab_size, self.hidden_size):
            raise ValueError(f"weight: checkpoint shape {shape}, model expects {(self.vocab_size, self.hidden_size)}")
        if self.tp.size == 1:
            self.weight.data.copy_(materialize(tensor))
            return
        self.weight.data.zero_()  # padding rows past the vocabulary
        self.weight.data[: self.num_rows].copy_(narrow(tensor, 0, self.vocab_start, self.num_rows))

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """[rows, rows held by this rank] -> [rows, vocab] on every rank."""
        if self.tp.size == 1:
            return local_logits
        return self.tp.gather_last_dim(local_logits)[:, : self.vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same row split as the embedding, used only through its weight."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("an LM head is applied by the model's compute_logits, not called")
