"""CUDA graphs for decode-only steps: capture once per batch size of a ladder, replay with padding.

A decode step of a small batch is dominated by kernel-launch overhead (hundreds of launches for
an 8B model), so the whole `model.forward` is captured into a CUDA graph for each batch size of
a ladder (1, 2, 4, 8, 16, 24, 32, ... max_num_seqs). At run time the batch is padded up to the
next captured size: padded rows get slot -1 (the KV write skips them), seq_len 0 and
query_len 1, so attention produces zeros for them and touches no live block.

Everything a graph reads lives in static buffers allocated here once, sized for the largest
batch; `run` copies the step's inputs into them and replays. The attention metadata's
max_seq_len is fixed to the engine's max_model_len, so the kernel's launch shape (grid and
split-KV count) is the same at capture and at every replay.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ferrox.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class CudaGraphRunner:
    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        batch_sizes: list[int] | None = None,
    ) -> None:
        if torch.device(device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.batch_sizes = sorted(batch_sizes) if batch_sizes else batch_size_ladder(max_num_seqs)
        self.max_batch = self.batch_sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per request
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=batch,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_table=self.block_table[:batch],
            query_start_loc_cpu=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens_cpu=torch.ones(batch, dtype=torch.int32),  # shape only: graph-safe backends read no host data
            decode_only=True,
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every ladder size (largest first, so smaller graphs reuse its memory pool)."""
        start = time.perf_counter()
        pool = None
        for batch in reversed(self.batch_sizes):
            meta = self._meta(batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, meta)
            self.model.forward(*args)  # warm-up: Triton compiles and cuBLAS picks kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model.forward(*args)
            pool = graph.pool()
            self.graphs[batch] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch sizes %s) in %.1f s",
                    len(self.graphs), self.batch_sizes, self.capture_seconds)
        return self.capture_seconds

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            bool(self.graphs)
            and meta.decode_only
            and meta.num_reqs <= self.max_batch
            and meta.max_seq_len <= self.max_model_len
            and meta.block_table.shape[1] <= self.block_table.shape[1]
        )

    def padded_size(self, batch: int) -> int:
        for size in self.batch_sizes:
            if size >= batch:
                return size
        raise ValueError(f"batch of {batch} exceeds the largest captured size {self.max_batch}")

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [batch, hidden] of a decode-only step. The result is a view of the graph's
        static output: consume it (compute logits) before the next `run`."""
        batch = input_ids.shape[0]
        padded = self.padded_size(batch)
        graph, out = self.graphs[padded]
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping[:batch], non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_table.shape[1]
        self.block_table[:batch, :width].copy_(meta.block_table, non_blocking=True)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)  # padding writes no KV
            self.seq_lens[batch:padded].zero_()  # and attends to nothing
            self.positions[batch:padded].zero_()
        graph.replay()
        return out[:batch]
