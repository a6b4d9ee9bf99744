"""Per-step attention metadata: the explicit object every attention backend reads.

Built once per step by the model runner from the scheduler's flat arrays
(`ferrox._core.SchedulerOutput`) and passed down through the model's forward call, never
through a global. All backends share one paged KV layout, per layer:

    kv_cache: Tensor[2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

Token t of the batch writes its K/V at slot `slot_mapping[t]`, i.e. block
`slot // block_size`, offset `slot % block_size`. Request r's queries are rows
`query_start_loc[r]:query_start_loc[r+1]`; it attends causally over `seq_lens[r]` KV
positions whose blocks are `block_table[r, :ceil(seq_lens[r] / block_size)]`; its queries are
the last `query_len` of those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int  # tokens in this step (rows of q), without padding
    max_query_len: int
    max_seq_len: int
    slot_mapping: torch.Tensor  # int64 [num_tokens] on the model's device
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1] on device
    seq_lens: torch.Tensor  # int32 [num_reqs] on device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks] on device (null block 0 pads)
    # Host copies for backends that loop over requests (the torch reference) and for planning.
    query_start_loc_cpu: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # int32 [num_reqs]
    decode_only: bool = False  # every request has query_len == 1 (CUDA-graph eligible)
    # Request row -> position ranges [start, end) whose tokens also attend to each other's later tokens
    # (Gemma 3's images: each image's tokens attend bidirectionally; the scheduler computes a range
    # within one step). Only the torch backend masks it; the Triton backend hands such steps to it.
    bidirectional: dict[int, list[tuple[int, int]]] | None = None
    # Hybrid models (worker/recurrent_states.py): each request's row in the recurrent-state pools, int32
    # [num_reqs] on device. None (profiling, warm-up): every request uses scratch row 0.
    state_rows: torch.Tensor | None = None
    # ... and with speculative drafts, [num_reqs, K] int64 rows that keep the state after each of a request's first
    # K tokens (-1: none), so the state after the accepted drafts can be kept (worker/recurrent_states.py)
    draft_state_rows: torch.Tensor | None = None
    # ... and in a CUDA graph's verify step, padded per request to k + 1 tokens (worker/cuda_graphs.py): int32
    # [num_reqs] on device, the tokens of each query that are real. The rest are pad rows: they must not advance the
    # request's recurrent state (None: every row of every query is real).
    live_query_lens: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return int(self.seq_lens_cpu.shape[0])
