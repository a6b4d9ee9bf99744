"""CUDA graphs for the MTP layer (worker/mtp_proposer.py): its pass over a step's pairs and its draft rounds.

Eagerly, each pass and each round is one decoder layer's worth of launches issued from Python (tens of them, plus
the MoE router's in the MoE models) for a few tokens of work: a batch-1 Qwen3.5-9B MTP step spent ~2.8 ms in the
pass and ~1.9 ms in each further round on an H100, most of it launch overhead. The layer is attention-only (no
recurrent state), so worker/cuda_graphs.py's runner takes it as it takes a target model: the rounds are decode
steps (one token per request) and replay the decode ladder; the pass of a decode step keeps 1 + accepted pairs per
request (at most 1 + k) and replays the verify graphs of verify_len k + 1, padded per request as a target's verify
step is. Prefill chunks' passes (longer queries) run eagerly.

The runner drives a model by forward(input_ids, positions, kv_caches, meta); the layer's third input, the target's
hidden states, is read from a static buffer here (PredictorGraphModel). A decode step's rows are copied into it in
step order; a verify-shaped step's go to the padded rows the runner picks, through its verify_row_hooks (the same
token -> row map it applies to input ids and positions). Pad rows read stale or zero rows: they write no KV and
their outputs are dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferrox.attention.metadata import AttentionMetadata
from ferrox.worker.cuda_graphs import CudaGraphRunner


class PredictorGraphModel(nn.Module):
    """The MTP layer behind the runner's model interface, its hidden-state input in `self.hidden` (module docstring)."""

    def __init__(self, predictor: Any, rows: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.predictor = predictor
        self.hidden = torch.zeros(rows, int(predictor.spec.hidden_size), dtype=dtype, device=device)
        self._pending: torch.Tensor | None = None  # a verify-shaped step's hidden rows, in step order
        self.verify_row_hooks = (self._relayout,)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        return self.predictor(input_ids, positions, self.hidden[: input_ids.shape[0]], kv_caches[0], meta)

    def _relayout(self, rows: torch.Tensor, span: int) -> None:
        """The runner's verify staging hook: each token's hidden row to its static row (pad rows zero)."""
        self.hidden[:span].zero_()
        if self._pending is not None:  # (None: capture's dummy steps)
            self.hidden.index_copy_(0, rows, self._pending)


class MtpGraphs:
    """The MTP layer's decode and verify graphs over its twin KV cache (one rank's shard under tensor parallelism)."""

    def __init__(self, predictor: Any, kv_cache: torch.Tensor, *, num_speculative_tokens: int, max_num_seqs: int,
                 max_model_len: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 batch_sizes: list[int] | None) -> None:
        verify_len = num_speculative_tokens + 1
        self.model = PredictorGraphModel(predictor, max_num_seqs * verify_len, dtype, device)
        self.runner = CudaGraphRunner(self.model, [kv_cache], max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                      block_size=block_size, device=device, batch_sizes=batch_sizes,
                                      verify_len=verify_len)

    def capture(self) -> float:
        return self.runner.capture()

    def can_run(self, meta: AttentionMetadata) -> bool:
        return self.runner.can_run(meta)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output rows of a step `can_run` accepts, in step order. A decode step's is a view of the
        graph's static output: consume it before the next run."""
        if meta.decode_only:
            self.model.hidden[: hidden.shape[0]].copy_(hidden)
            return self.runner.run(input_ids, positions, meta)
        self.model._pending = hidden
        try:
            return self.runner.run(input_ids, positions, meta)
        finally:
            self.model._pending = None
