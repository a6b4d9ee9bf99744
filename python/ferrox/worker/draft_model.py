"""Draft-model speculation: a second (smaller) model with the target's vocabulary proposes k tokens
per request per step; the core schedules them as drafts (Scheduler.schedule(draft_slots=...)) and
the target verifies them like n-gram drafts.

The draft model's KV cache is a twin of the target's: the same num_blocks and block_size, indexed by
the same block ids, so the core's block tables serve both (the draft model has its own layers and
heads, but the same token positions). Two passes keep it right:

- shadow(so): after the target's forward pass of a step, the draft model runs over exactly the same
  tokens, positions and slots. So every twin slot holds what the target's slot holds (the same token
  at the same position), through prefix-cache hits (the block was computed, and shadowed, by
  another request), preemption (recomputed, and shadowed again) and rejected drafts (overwritten
  when the position is computed again). A twin slot is written by nothing else.
- propose(): before the next schedule(), for each request that just sampled its last token at
  position p (its KV not computed yet), the draft model runs k one-token steps at p, p+1, ...,
  feeding back its own argmax. Those positions go to per-request scratch blocks past the twin
  range (the target may not have allocated their blocks yet, and a twin slot must only ever mirror
  the target): the partial block holding p's predecessors is copied to the first scratch block, and
  the proposal's block table is the request's blocks before it, then its scratch blocks.

Drafts are the draft model's argmax (deterministic given the context), so the verifier treats them
like prompt-lookup drafts (draft_probs=None): exact for greedy and sampled requests alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.attention.kv_cache import allocate_kv_caches
from ferrox.distributed.parallel_state import get_tp_group
from ferrox.loader.model_loader import load_model_spec
from ferrox.loader.source import resolve_model
from ferrox.model_spec import spec_for_context
from ferrox.worker.cuda_graphs import CudaGraphRunner
from ferrox.worker.step_inputs import Uploader, attention_metadata


def scratch_blocks_per_request(block_size: int, k: int) -> int:
    """Proposal scratch blocks of one request: from the start of the block holding p to position p + k - 1."""
    return (block_size - 1 + k - 1) // block_size + 1


def scratch_block_tables(pos0: npt.NDArray[np.int64], blocks: list[npt.NDArray[np.int32]], block_size: int,
                         num_blocks: int, scratch_per_req: int,
                         kv_caches: list[torch.Tensor]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32]]:
    """Block tables for proposal steps at positions pos0[i], pos0[i] + 1, ... of request i: its own blocks before
    the one holding pos0[i], then its scratch blocks past the twin range (the first scratch block of request i
    is num_blocks + i * scratch_per_req), into which the positions before pos0[i] in its block are copied
    (module docstring). Returns (each request's first scratch block, the tables)."""
    scratch, table, src, dst = scratch_plan(pos0, blocks, block_size, num_blocks, scratch_per_req)
    copy_blocks(kv_caches, src, dst)
    return scratch, table


def scratch_plan(pos0: npt.NDArray[np.int64], blocks: list[npt.NDArray[np.int32]], block_size: int, num_blocks: int,
                 scratch_per_req: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64],
                                                npt.NDArray[np.int64]]:
    """scratch_block_tables' plan without the copy: (first scratch blocks, tables, the blocks to copy, where to)."""
    bs, n = block_size, len(blocks)
    first_block = pos0 // bs
    scratch = num_blocks + np.arange(n, dtype=np.int64) * scratch_per_req
    partial = np.flatnonzero(pos0 % bs)
    src = np.array([blocks[i][first_block[i]] for i in partial], dtype=np.int64)
    table = np.zeros((n, int(first_block.max()) + scratch_per_req), dtype=np.int32)
    for i in range(n):
        fb = int(first_block[i])
        table[i, :fb] = blocks[i][:fb]
        table[i, fb : fb + scratch_per_req] = scratch[i] + np.arange(scratch_per_req)
    return scratch, table, src, scratch[partial]


def copy_blocks(kv_caches: list[torch.Tensor], src: npt.NDArray[np.int64], dst: npt.NDArray[np.int64]) -> None:
    """Whole KV blocks src[i] -> dst[i] in every cache."""
    if not src.size:
        return
    src_t, dst_t = torch.from_numpy(src), torch.from_numpy(dst)
    for cache in kv_caches:
        cache[:, dst_t] = cache[:, src_t.to(cache.device)]


@dataclass(slots=True)
class _DraftStep:
    """The arrays attention_metadata reads, for a proposal step (one token per request)."""

    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    num_scheduled_tokens: npt.NDArray[np.int32]
    slot_mapping: npt.NDArray[np.int64]
    block_table: npt.NDArray[np.int32]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.size)


@dataclass(slots=True)
class _Pending:
    slot: int  # the core's request slot
    token: int  # the last sampled token (its KV not computed yet)
    position: int  # its position
    blocks: npt.NDArray[np.int32]  # the request's block table row (covers every position before it)


class DraftProposer:
    def __init__(self, path: str, *, num_speculative_tokens: int, target_vocab_size: int, num_blocks: int,
                 block_size: int, max_num_seqs: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device, load_format: str, seed: int, cuda_graphs: bool = False,
                 graph_sizes: list[int] | None = None, keep_quantized: bool = False) -> None:
        """cuda_graphs: capture the proposal steps (one token per request, the target's decode shape)
        and the shadow pass's verify steps in CUDA graphs of their own, over the twin cache, at the
        target's decode batch sizes (graph_sizes; None: the ladder up to max_num_seqs).
        keep_quantized: a quantized GGUF draft stays quantized where it can (the target's rule, so a
        model drafting itself shares its weights and its kernels, and every draft is accepted)."""
        from ferrox.worker.model_setup import _shared_model  # the same weight sharing as the target's

        source = resolve_model(path)
        spec = load_model_spec(source)
        if int(spec.vocab_size) != target_vocab_size:
            raise ValueError(f"speculative_config.model: the draft model's vocabulary ({spec.vocab_size} tokens) is "
                             f"not the target's ({target_vocab_size}); it must use the same tokenizer")
        if int(spec.max_position_embeddings) < max_model_len:
            raise ValueError(f"speculative_config.model: the draft model's max_position_embeddings "
                             f"({spec.max_position_embeddings}) is below max_model_len ({max_model_len})")
        spec = spec_for_context(spec, max_model_len)
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.device = device
        self.model = _shared_model(source, spec, dtype, device, load_format, seed, get_tp_group(),
                                   keep_quantized=keep_quantized)
        from ferrox.worker.recurrent_states import recurrent_layers

        if recurrent_layers(self.model):
            raise ValueError(f"speculative_config.model: {spec.architecture} keeps recurrent states (a hybrid "
                             "linear-attention model), which the draft runner does not roll back; draft with an "
                             "attention-only model")
        self.scratch_per_req = scratch_blocks_per_request(block_size, self.k)
        self.kv_caches = allocate_kv_caches(spec, num_blocks + max_num_seqs * self.scratch_per_req, block_size,
                                            dtype, device)
        self.upload = Uploader(device)
        # One uploader per proposal round: the rounds queue on the device without waiting for one
        # another, so a round's pinned inputs must not be restaged until propose()'s final read.
        self._round_uploads = [Uploader(device) for _ in range(self.k)]
        self._pending: list[_Pending] = []
        self.graphs: CudaGraphRunner | None = None
        if cuda_graphs and graph_sizes != [] and torch.device(device).type == "cuda":
            # Verify-shaped graphs too: the shadow pass runs the target's steps, verify steps included.
            self.graphs = CudaGraphRunner(self.model, self.kv_caches, max_num_seqs=max_num_seqs,
                                          max_model_len=max_model_len, block_size=block_size, device=device,
                                          verify_len=self.k + 1, batch_sizes=graph_sizes)
            self.graphs.capture()

    @torch.inference_mode()
    def shadow(self, so: Any) -> None:
        """Run the draft model over a target step's tokens: fills the twin slots (see module docs)."""
        self.upload.next_step()
        meta = attention_metadata(so, self.upload)
        ids, pos = self.upload("input_ids", so.input_ids), self.upload("positions", so.positions)
        if self.graphs is not None and self.graphs.can_run(meta):
            self.graphs.run(ids, pos, meta)
        else:
            self.model.forward(ids, pos, self.kv_caches, meta)

    def record(self, handle: Any, outs: Any) -> None:
        """After update_from_output of the step `handle` (worker/model_runner.py StepHandle): the requests that
        may get drafts next step (decode state: they just sampled a token and did not finish), with what
        propose() needs."""
        self._pending = []
        so = handle.so
        row_of_slot = {int(s): i for i, s in enumerate(np.asarray(so.req_slots).tolist())}
        offsets, tokens = outs.token_offsets, outs.token_ids
        lengths = outs.num_prompt_tokens + outs.num_output_tokens
        for j, slot in enumerate(outs.slots.tolist()):
            row = row_of_slot.get(slot)
            if outs.finish_reasons[j] or offsets[j + 1] == offsets[j] or row is None:
                continue
            self._pending.append(_Pending(slot, int(tokens[offsets[j + 1] - 1]), int(lengths[j]) - 1,
                                          np.asarray(so.block_table[row], dtype=np.int32)))

    @torch.inference_mode()
    def propose(self) -> dict[str, npt.NDArray[Any]]:
        """schedule()'s draft_slots / draft_token_ids / draft_offsets for the recorded requests ({} if none)."""
        reqs = [r for r in self._pending if self.max_model_len - 1 - r.position > 0]
        self._pending = []
        if not reqs:
            return {}
        bs, n = self.block_size, len(reqs)
        budget = np.array([min(self.k, self.max_model_len - 1 - r.position) for r in reqs])
        pos0 = np.array([r.position for r in reqs], dtype=np.int64)
        scratch, table = scratch_block_tables(pos0, [r.blocks for r in reqs], bs, self.num_blocks,
                                              self.scratch_per_req, self.kv_caches)
        # Each round's token is the previous round's argmax, kept on the device: the k rounds queue
        # back to back, and the host reads the drafts once, at the end.
        first = self._round_uploads[0]
        first.next_step()
        last = first("last_tokens", np.array([r.token for r in reqs], dtype=np.int64)).clone()
        drafts_dev = torch.zeros((self.k, n), dtype=torch.int64, device=last.device)
        for j in range(int(budget.max())):
            upload = self._round_uploads[j]
            if j:
                upload.next_step()
            active = np.flatnonzero(budget > j)
            offset = pos0[active] % bs + j
            step = _DraftStep(
                query_start_loc=np.arange(active.size + 1, dtype=np.int32),
                seq_lens=(pos0[active] + j + 1).astype(np.int32),
                num_scheduled_tokens=np.ones(active.size, dtype=np.int32),
                slot_mapping=(scratch[active] + offset // bs) * bs + offset % bs,
                block_table=np.ascontiguousarray(table[active]),
            )
            meta = attention_metadata(step, upload)
            rows = upload("active", active.astype(np.int64))
            ids, pos = last.index_select(0, rows), upload("positions", pos0[active] + j)
            if self.graphs is not None and self.graphs.can_run(meta):
                hidden = self.graphs.run(ids, pos, meta)
            else:
                hidden = self.model.forward(ids, pos, self.kv_caches, meta)
            proposed = self.model.compute_logits(hidden).argmax(dim=-1)
            drafts_dev[j].index_copy_(0, rows, proposed)
            last.index_copy_(0, rows, proposed)
        drafts = drafts_dev.t().cpu().numpy()
        counts = budget.astype(np.int32)
        return {
            "draft_slots": np.array([r.slot for r in reqs], dtype=np.int32),
            "draft_token_ids": np.concatenate([drafts[i, : counts[i]] for i in range(n)]),
            "draft_offsets": np.concatenate(([0], np.cumsum(counts))).astype(np.int32),
        }
