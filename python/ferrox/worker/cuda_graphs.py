"""CUDA graphs for decode-only steps: capture once per batch size of a ladder, replay with padding.

A decode step of a small batch is dominated by kernel-launch overhead (hundreds of launches for
an 8B model), so the whole `model.forward` is captured into a CUDA graph for each batch size of
a ladder (1, 2, 4, 8, 16, 24, 32, ... max_num_seqs). At run time the batch is padded up to the
next captured size: padded rows get slot -1 (the KV write skips them), seq_len 0 and
query_len 1, so attention produces zeros for them and touches no live block.

Everything a graph reads lives in static buffers allocated here once, sized for the largest
batch (a graph replays fixed addresses); `stage` copies a step's inputs into them. Both `run`
(a real step) and `capture` go through it: each ladder size is captured on a dummy decode step
of that size, scheduled by a throwaway core scheduler in the first blocks of this KV cache
(worker/dummy_batch.py), so a graph is captured on the same kind of inputs it replays.

The graph's attention metadata is the captured step's own (step_inputs.attention_metadata),
pointed at the static buffers, with one change: max_seq_len is fixed to the engine's
max_model_len, so the kernel's launch shape (grid and split-KV count) is the same at capture and
at every replay. A decode-only step's query_start_loc is always 0..batch, so that buffer is
filled once; host-side fields (seq_lens_cpu...) are baked in at capture, which is why only
backends that read no host data per step (Triton) may run inside a graph.

Verify graphs (speculative decoding, `verify_len` = k + 1): a verify step runs up to k + 1 query
tokens per request (the last sampled token and its drafts). Such steps replay a second ladder of
graphs captured with every request's query exactly verify_len tokens long. A step with shorter
queries (fewer drafts for some requests, or a short prefill chunk) is padded per request: its
tokens move to rows [i * verify_len, i * verify_len + q_i) of the static buffers, the pad rows get
slot -1 (no KV write), and the request's seq_len grows by the pad, so that its real rows keep
their causal positions (the kernel places row j of a query of length Q at seq_len - Q + j) and
never see the pad positions, which come after them. The hidden rows are gathered back into the
step's own layout after the replay. Pad positions may run past the request's blocks: the static
block table has a spare zeroed block column per verify_len tokens so those reads stay inside it.
Per-token state kept outside these buffers in step order must follow the padding: the model's
`verify_row_hooks` (LoRA's token slots, lora/slots.py TokenSlots.relayout) are called with the
token -> row map after each verify step is staged.

A hybrid model's verify steps (worker/recurrent_states.py) replay the same graphs, with each request's
real query length in a static buffer the graph's metadata carries (AttentionMetadata.live_query_lens):
the recurrent layers' kernels stop a request's state at its last real token, so its pad rows (zero
outputs) do not advance it -- queries with fewer drafts than k (n-gram's usual case) replay too. The
step's state rows and draft-state rows go to static buffers as well (padding requests: scratch row 0,
no draft rows, no live tokens).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from ferrox.attention.kv_cache import zero_kv_blocks
from ferrox.attention.metadata import AttentionMetadata
from ferrox.compilation_config import GraphPlan
from ferrox.worker.dummy_batch import (
    decode_step,
    min_decode_blocks,
    min_prefill_blocks,
    prefill_step,
    upload_step,
)
from ferrox.worker.recurrent_states import recurrent_layers
from ferrox.worker.step_inputs import Uploader

logger = logging.getLogger(__name__)

# KV length of the dummy decode steps captured: one prompt token and the new one (one block per
# request). The value does not shape the graph (max_seq_len does); a short context keeps the
# dummy requests cheap and lets the largest batch fit in a small cache.
CAPTURE_CONTEXT_LEN = 2


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (always included)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def decode_capture_sizes(plan: GraphPlan, max_num_seqs: int) -> list[int] | None:
    """The decode batch sizes a plan (ferrox/compilation_config.py) asks to capture: its explicit sizes up to
    max_num_seqs, the ladder up to its largest size, or None for the ladder up to max_num_seqs."""
    if plan.sizes is not None:
        return [s for s in plan.sizes if s <= max_num_seqs]
    if plan.max_size is not None:
        return batch_size_ladder(min(max_num_seqs, plan.max_size))
    return None


# Only this thread's forbidden calls fail a capture. In "global" mode any thread's would: the engine's
# other threads (output, structured-output masks) and an earlier engine's, still winding down in the same
# process, may query events or free pinned memory while graphs are captured at start-up; the capture then
# failed and the engine ran every step eagerly (seen on the H200: a second LLM in one process).
CAPTURE_ERROR_MODE = "thread_local"


@contextlib.contextmanager
def capture_guard() -> Iterator[None]:
    """Garbage collected before the captures and not during them: an object freed by the collector mid-capture
    (an earlier engine's graphs or pinned buffers) runs CUDA calls a capture forbids on this thread."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def next_captured_size(sizes: list[int], n: int, what: str) -> int:
    """The smallest of the ascending captured `sizes` that holds n (a step pads up to it); ValueError
    naming `what` when n exceeds them all. Shared by the decode, verify and piecewise ladders."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{what} {n} exceeds the largest captured size {sizes[-1] if sizes else 0}")
    return sizes[i]


def capturable_batch_sizes(batch_sizes: list[int], block_size: int, num_blocks: int) -> list[int]:
    """The sizes of `batch_sizes` whose dummy decode step fits in a KV cache of num_blocks blocks.
    A larger batch could never run anyway: every running request holds at least one block."""
    return [b for b in sorted(batch_sizes) if min_decode_blocks(b, CAPTURE_CONTEXT_LEN, block_size) <= num_blocks]


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
        verify_len: int = 0,
    ) -> None:
        """verify_len: k + 1 for speculative decoding with k draft tokens (also captures verify
        graphs, module docstring), 0 for none."""
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not kv_caches:
            raise ValueError("CUDA graphs need the KV cache (one tensor per layer)")
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.num_blocks = int(kv_caches[0].shape[1])
        self.max_model_len = max_model_len
        if batch_sizes:
            wanted = sorted(set(batch_sizes))
            sizes = capturable_batch_sizes(wanted, block_size, self.num_blocks)
        else:
            fits = [b for b in range(1, max_num_seqs + 1)
                    if min_decode_blocks(b, CAPTURE_CONTEXT_LEN, block_size) <= self.num_blocks]
            wanted = batch_size_ladder(max_num_seqs)
            sizes = batch_size_ladder(fits[-1]) if fits else []
        if not sizes:
            raise ValueError(f"a KV cache of {self.num_blocks} blocks holds no decode batch to capture")
        if sizes[-1] < wanted[-1]:
            logger.warning("CUDA graphs: a KV cache of %d blocks holds decode batches of at most %d requests; "
                           "capturing up to %d instead of %d", self.num_blocks, sizes[-1], sizes[-1], wanted[-1])
        self.batch_sizes = sizes
        self.max_batch = sizes[-1]
        self.verify_len = verify_len if verify_len > 1 else 0
        # Verify batches: the ladder sizes whose dummy step (fresh prompts of verify_len tokens) fits
        # the cache and stays within 8192 tokens (larger verify batches are rare and run eagerly).
        self.verify_sizes = [b for b in sizes if b * self.verify_len <= 8192 and min_prefill_blocks(
            b * self.verify_len, b, block_size) <= self.num_blocks] if self.verify_len else []
        rows = max(self.max_batch, self.max_batch * self.verify_len)
        max_blocks = -(-max_model_len // block_size) + (-(-self.verify_len // block_size))
        n = self.max_batch
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per request
        self.verify_query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device) * self.verify_len
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        # A hybrid model's recurrent-state rows (worker/recurrent_states.py); padding requests use scratch row 0.
        self.recurrent = bool(recurrent_layers(model))
        self.state_rows = torch.zeros(n, dtype=torch.int32, device=device)
        # ... and where a verify step keeps the state after each of a query's first k tokens (-1: nowhere)
        self.draft_state_rows = torch.full((n, max(self.verify_len - 1, 0)), -1, dtype=torch.int64, device=device)
        # ... and each request's real query length in a verify step (the rest of its rows are padding)
        self.live_query_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.verify_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._rows: torch.Tensor | None = None  # the last verify step's token -> static row map
        self.capture_seconds = 0.0

    def _graph_meta(self, meta: AttentionMetadata, query_len: int = 1) -> AttentionMetadata:
        """The metadata a graph reads: that of the step staged for its capture (a ladder size, so
        no padding), pointed at the static buffers, with the fixed max_seq_len (module docstring;
        a verify graph's pad rows may reach query_len - 1 positions past max_model_len)."""
        n = meta.num_reqs
        starts = self.query_start_loc if query_len == 1 else self.verify_query_start_loc
        return dataclasses.replace(
            meta,
            max_seq_len=self.max_model_len + query_len - 1,
            slot_mapping=self.slot_mapping[: n * query_len],
            query_start_loc=starts[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_table=self.block_table[:n],
            state_rows=self.state_rows[:n] if self.recurrent else None,
            draft_state_rows=self.draft_state_rows[:n] if self.recurrent and query_len > 1 else None,
            live_query_lens=self.live_query_lens[:n] if self.recurrent and query_len > 1 else None,
        )

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode-only step (its attention metadata from step_inputs.attention_metadata) into
        the static buffers, padded up to the next captured size; returns that size."""
        batch = input_ids.shape[0]
        padded = self.padded_size(batch)
        self.input_ids[:batch].copy_(input_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(meta.slot_mapping[:batch], non_blocking=True)
        self.seq_lens[:batch].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_table.shape[1]
        self.block_table[:batch, :width].copy_(meta.block_table, non_blocking=True)
        if self.recurrent:
            self._stage_state_rows(meta.state_rows, batch, padded)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)  # padding writes no KV
            self.seq_lens[batch:padded].zero_()  # and attends to nothing
            self.positions[batch:padded].zero_()
        return padded

    def _stage_state_rows(self, state_rows: torch.Tensor | None, batch: int, padded: int) -> None:
        """The step's recurrent-state rows; scratch row 0 for padding requests and capture's dummy steps."""
        if state_rows is not None:
            self.state_rows[:batch].copy_(state_rows, non_blocking=True)
        else:
            self.state_rows[:batch].zero_()
        self.state_rows[batch:padded].zero_()

    def stage_verify(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a step whose queries are at most verify_len tokens into the static buffers, each
        request's tokens at its own verify_len rows (module docstring); returns the padded batch.
        Device ops only: the token -> row map comes from query_start_loc on the device."""
        q, batch, tokens = self.verify_len, meta.num_reqs, input_ids.shape[0]
        padded = self.padded_verify_size(batch)
        starts = meta.query_start_loc[:batch].to(torch.int64)
        lens = meta.query_start_loc[1 : batch + 1].to(torch.int64) - starts
        req = torch.repeat_interleave(torch.arange(batch, device=self.device), lens, output_size=tokens)
        rows = req * q + torch.arange(tokens, device=self.device) - starts[req]
        self._rows = rows
        span = padded * q
        self.input_ids[:span].zero_()
        self.positions[:span].zero_()
        self.slot_mapping[:span].fill_(-1)  # pad rows write no KV
        self.input_ids.index_copy_(0, rows, input_ids)
        self.positions.index_copy_(0, rows, positions)
        self.slot_mapping.index_copy_(0, rows, meta.slot_mapping[:tokens])
        self.seq_lens[:batch].copy_(meta.seq_lens + (q - lens).to(torch.int32), non_blocking=True)
        self.seq_lens[batch:padded].fill_(q)  # pad requests attend over their own q rows (block 0)
        width = meta.block_table.shape[1]
        self.block_table[:batch, :width].copy_(meta.block_table, non_blocking=True)
        self.block_table[:batch, width:].zero_()  # pad positions past the request's blocks read block 0
        if self.recurrent:
            self.live_query_lens[:batch].copy_(lens, non_blocking=True)
            self.live_query_lens[batch:padded].zero_()
            self._stage_state_rows(meta.state_rows, batch, padded)
            drafts = self.draft_state_rows
            if meta.draft_state_rows is not None:
                drafts[:batch].copy_(meta.draft_state_rows, non_blocking=True)
            else:  # (capture's dummy steps)
                drafts[:batch].fill_(-1)
            drafts[batch:padded].fill_(-1)
        for hook in getattr(self.model, "verify_row_hooks", ()):
            hook(rows, span)
        return padded

    def padded_verify_size(self, batch: int) -> int:
        return next_captured_size(self.verify_sizes, batch, "a verify batch of")

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every ladder size (largest first, so smaller graphs reuse its memory pool), each
        on a dummy decode step of that size staged like a real one. The dummy steps write K/V into
        a few blocks of the (still unused) cache; those blocks are zeroed again afterwards."""
        with capture_guard():
            return self._capture_all()

    def _capture_all(self) -> float:
        start = time.perf_counter()
        upload = Uploader(self.device)
        touched: set[int] = set()
        pool = None
        for batch in reversed(self.batch_sizes):
            step = decode_step(batch, CAPTURE_CONTEXT_LEN, self.block_size, num_blocks=self.num_blocks)
            touched.update(step.block_ids.tolist())
            upload.next_step()
            t = upload_step(step.so, upload)
            if not t.meta.decode_only or t.meta.num_reqs != batch:
                raise RuntimeError(f"the dummy step for CUDA-graph batch {batch} is not a decode step of {batch}")
            self.stage(t.input_ids, t.positions, t.meta)  # a ladder size: nothing to pad
            self.graphs[batch] = self._capture_one(batch, t.meta, 1, pool)
            pool = self.graphs[batch][0].pool()
        for batch in reversed(self.verify_sizes):
            # Fresh prompts of exactly verify_len tokens: the verify shape, with no context needed.
            step = prefill_step(batch * self.verify_len, batch, self.block_size, num_blocks=self.num_blocks)
            touched.update(step.block_ids.tolist())
            upload.next_step()
            t = upload_step(step.so, upload)
            self.stage_verify(t.input_ids, t.positions, t.meta)
            self.verify_graphs[batch] = self._capture_one(batch, t.meta, self.verify_len, pool)
            pool = self.verify_graphs[batch][0].pool()
        if touched:
            blocks = torch.tensor(sorted(touched), dtype=torch.int64, device=self.device)
            zero_kv_blocks(self.kv_caches, blocks)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d CUDA graphs (decode batch sizes %s%s) in %.1f s",
                    len(self.graphs) + len(self.verify_graphs), self.batch_sizes,
                    f"; verify steps of {self.verify_len} tokens, batches {self.verify_sizes}" if self.verify_graphs
                    else "", self.capture_seconds)
        return self.capture_seconds

    def _capture_one(self, batch: int, meta: AttentionMetadata, query_len: int,
                     pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward of the step staged in the static buffers (batch requests of
        query_len tokens each) into the shared memory pool: (graph, its static output)."""
        tokens = batch * query_len
        args = (self.input_ids[:tokens], self.positions[:tokens], self.kv_caches, self._graph_meta(meta, query_len))
        self.model.forward(*args)  # warm-up: Triton compiles and cuBLAS picks kernels outside capture
        torch.cuda.synchronize(self.device)  # also: the upload's pinned buffers are free again
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode=CAPTURE_ERROR_MODE):
            out = self.model.forward(*args)
        return graph, out

    def can_run(self, meta: AttentionMetadata) -> bool:
        fits = meta.max_seq_len <= self.max_model_len and meta.block_table.shape[1] <= self.block_table.shape[1]
        if meta.decode_only:
            return bool(self.graphs) and meta.num_reqs <= self.max_batch and fits
        return bool(self.verify_graphs and meta.max_query_len <= self.verify_len
                    and meta.num_reqs <= self.verify_sizes[-1] and fits)

    def padded_size(self, batch: int) -> int:
        return next_captured_size(self.batch_sizes, batch, "a batch of")

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [tokens, hidden] of a step `can_run` accepts. A decode step's result is a
        view of the graph's static output: consume it (compute logits) before the next `run`."""
        if not meta.decode_only:
            padded = self.stage_verify(input_ids, positions, meta)
            graph, out = self.verify_graphs[padded]
            graph.replay()
            assert self._rows is not None
            return out.index_select(0, self._rows)  # back to the step's own token order
        batch = input_ids.shape[0]
        padded = self.stage(input_ids, positions, meta)
        graph, out = self.graphs[padded]
        graph.replay()
        return out[:batch]
