"""Recurrent states of hybrid models: one row of state per running request, beside the paged KV cache.

A hybrid model (Qwen3-Next, Qwen3.5 / 3.6: Gated DeltaNet layers between full-attention layers) keeps, for
each request, a fixed-size state per linear-attention layer: the short convolution's last W-1 inputs and the
delta rule's [heads, key dim, value dim] matrix. Those do not grow with the sequence, so they live in a pool
of rows, not in KV blocks: row r of every layer's pool belongs to one request while it runs.

- Rows: max_num_seqs + 1 (then the snapshot slots, below). Row 0 is scratch: the profiling and warm-up steps,
  CUDA-graph capture and a graph's padding requests read and write it, never a request. A running request holds
  a row from the step that first schedules it until it finishes or is preempted (then its state is gone: a
  preempted request is recomputed, from its first token or a snapshot, like its KV), so running <= max_num_seqs
  rows always suffice.
- Whether a row's content is used: a request whose step starts at position 0 (nothing computed before)
  starts from zeros whatever its row holds; one that continues (a later prefill chunk, decode) reads its row.
  The layers decide this on the device from the step's seq_lens and query lengths
  (AttentionMetadata.state_rows), so the rows need no zeroing and CUDA graphs replay it.
- Speculative decoding: a verify step runs a request's last token and its k drafts, and the state to go on
  from is the one after the drafts that are accepted, known only after sampling. The pools end with k draft
  rows per request row (request row r's are fixed, never handed out); the layers also write the state after each
  of a verify query's first d tokens there (AttentionMetadata.draft_state_rows), and once the drafts are
  verified the runner copies the accepted one's into the request's row (on the device: `keep_accepted`; the
  other ranks under tensor parallelism with the driver's accepted counts, broadcast).
- Prefix caching (vLLM's mamba_cache_mode "align"): a cached block restores K/V but not the state after it, so
  the pools have max_num_seqs more rows, snapshot slots, after the requests' rows. The core
  (rust/state_snapshots.rs) cuts a prompt's chunks to end on a grid of mamba_block_size tokens, has the state
  there saved into a slot after the step's forward, and resumes a later request sharing that prefix from it (a
  copy into its row before the forward). A hit ends at the last grid point with both K/V blocks and a state.

Element types follow vLLM's --mamba-cache-dtype / --mamba-ssm-cache-dtype ("auto": the model's dtype).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from ferrox.kv_events_config import parse_kv_events_config

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RecurrentLayer(Protocol):
    """A layer with per-request recurrent state (layers/gated_delta_net.py)."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(conv state, delta-rule state) shapes of one request on this rank."""

    def bind_states(self, conv_states: torch.Tensor, ssm_states: torch.Tensor) -> None:
        """The pools [rows, *shape] this layer reads and writes by AttentionMetadata.state_rows."""


def state_dtypes(mamba_cache_dtype: str, mamba_ssm_cache_dtype: str, model_dtype: torch.dtype,
                 hf_config: dict[str, Any] | None = None) -> tuple[torch.dtype, torch.dtype]:
    """(conv state dtype, recurrence state dtype) as vLLM resolves its two flags: mamba_ssm_cache_dtype "auto" takes
    the checkpoint's config.json mamba_ssm_cache_dtype where it names one (Nemotron-H's releases ask for float32,
    their scan's sums being kept exact over long contexts), else the conv state's."""
    conv = model_dtype if mamba_cache_dtype == "auto" else _DTYPES[mamba_cache_dtype]
    named = (hf_config or {}).get("mamba_ssm_cache_dtype")
    if mamba_ssm_cache_dtype == "auto" and named not in (None, "auto"):
        if named not in _DTYPES:
            raise ValueError(f"config.json: mamba_ssm_cache_dtype {named!r} is not one of {sorted(_DTYPES)}")
        mamba_ssm_cache_dtype = named
    ssm = conv if mamba_ssm_cache_dtype == "auto" else _DTYPES[mamba_ssm_cache_dtype]
    return conv, ssm


# The default snapshot grid, in tokens (rounded up to whole KV blocks): coarse enough that a prompt shorter than
# it is not cut (no extra step) and that the slots turn over slowly, fine enough that a resumed conversation
# recomputes little.
DEFAULT_STATE_GRID = 256


@dataclasses.dataclass(frozen=True)
class StateCachePlan:
    """How prefix caching keeps these states: snapshots every `grid` tokens into `snapshot_slots` pool rows
    (0 and 0: prefix caching is off for the model)."""

    grid: int = 0
    snapshot_slots: int = 0


def state_cache_plan(config: Any, max_num_seqs: int, *, pooling: bool = False) -> StateCachePlan:
    """vLLM's mamba_cache_mode ("align" by default with prefix caching) and mamba_block_size, checked."""
    caching = bool(config.enable_prefix_caching) and not pooling
    mode = config.mamba_cache_mode or ("align" if caching else "none")
    if mode == "all":
        raise ValueError("mamba_cache_mode: 'all' (a state at every mamba_block_size point inside a chunk) is not "
                         "supported; 'align' keeps the state where a step ends on that grid")
    if mode == "align" and not caching:
        raise ValueError("mamba_cache_mode: 'align' keeps recurrent states for the prefix cache, which is off "
                         + ("for a pooling model" if pooling else "(enable_prefix_caching)"))
    if config.mamba_block_size is not None and mode != "align":
        raise ValueError("mamba_block_size: the grid of prefix caching's state snapshots; it needs prefix caching "
                         "with mamba_cache_mode 'align'")
    if mode == "none":
        if caching:
            logger.warning("prefix caching: off for this hybrid model (mamba_cache_mode 'none')")
        return StateCachePlan()
    block = config.block_size
    grid = config.mamba_block_size or -(-DEFAULT_STATE_GRID // block) * block
    if grid % block:
        raise ValueError(f"mamba_block_size: must be a multiple of block_size ({block}), got {grid}: states are "
                         "kept where a KV block ends")
    return StateCachePlan(grid, max_num_seqs)


def check_recurrent_config(config: Any, num_speculative_tokens: int = 0) -> None:
    """Refuse by name what these states cannot follow yet."""
    from ferrox.layers.gated_delta_rule import RECURRENT_MAX_LEN

    if num_speculative_tokens >= RECURRENT_MAX_LEN:
        raise ValueError(f"speculative_config.num_speculative_tokens: at most {RECURRENT_MAX_LEN - 1} on a hybrid "
                         "linear-attention model (its verify steps run the token-by-token recurrence)")
    if config.kv_offloading_size or config.kv_transfer_config:
        raise ValueError("kv_offloading_size / kv_transfer_config: the host tier restores KV blocks of cached "
                         "prefixes, and a hybrid model's recurrent states cannot be restored from them")
    if parse_kv_events_config(config.kv_events_config).enable_kv_cache_events:
        raise ValueError("kv_events_config.enable_kv_cache_events: the events announce cached K/V blocks, while a "
                         "hybrid linear-attention model's prefix hit also needs a state snapshot they do not carry")
    # (LoRA needs nothing here: a state snapshot is keyed by its block's prefix hash, which the request's adapter
    # seeds, so a request never resumes from a state another adapter, or the base model, computed.)


def recurrent_layers(model: Any) -> list[RecurrentLayer]:
    return [m for m in model.modules() if hasattr(m, "bind_states") and hasattr(m, "state_shapes")]


def bytes_per_row(model: Any, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    conv_size = torch.empty((), dtype=conv_dtype).element_size()
    ssm_size = torch.empty((), dtype=ssm_dtype).element_size()
    total = 0
    for layer in recurrent_layers(model):
        conv, ssm = layer.state_shapes()
        total += math.prod(conv) * conv_size + math.prod(ssm) * ssm_size
    return total


def allocate_recurrent_states(model: Any, max_num_seqs: int, snapshot_slots: int, conv_dtype: torch.dtype,
                              ssm_dtype: torch.dtype, device: torch.device, num_speculative_tokens: int = 0) -> int:
    """Give every recurrent layer its pools of max_num_seqs + 1 rows (row 0: scratch), the snapshot slots after
    them, then num_speculative_tokens draft rows per request row; returns the bytes. Done before the KV cache is
    sized, so the profiled budget leaves them out."""
    rows = max_num_seqs + 1 + snapshot_slots + max_num_seqs * num_speculative_tokens
    per_row = bytes_per_row(model, conv_dtype, ssm_dtype)
    need = rows * per_row
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            extra = (f" and {snapshot_slots} prefix-cache snapshots" if snapshot_slots else "") + (
                f" and {num_speculative_tokens} draft states each" if num_speculative_tokens else "")
            raise ValueError(f"max_num_seqs: {max_num_seqs} requests' recurrent states{extra} take "
                             f"{need / 2**30:.2f} GiB ({per_row / 2**20:.1f} MiB each) and the GPU has "
                             f"{free / 2**30:.2f} GiB free; lower --max-num-seqs (or the state dtypes: "
                             "--mamba-ssm-cache-dtype; or --mamba-cache-mode none, fewer speculative tokens)")
    # Layers of one shape share one [layers, rows, ...] tensor per kind, each bound to its slice: a row copy for
    # every layer (keep_accepted after each verify step, the snapshots) is then two launches, not two per layer.
    by_shape: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]] = {}
    for layer in recurrent_layers(model):
        by_shape.setdefault(layer.state_shapes(), []).append(layer)
    for (conv, ssm), layers in by_shape.items():
        conv_stack = torch.zeros((len(layers), rows, *conv), dtype=conv_dtype, device=device)
        ssm_stack = torch.zeros((len(layers), rows, *ssm), dtype=ssm_dtype, device=device)
        for j, layer in enumerate(layers):
            layer.bind_states(conv_stack[j], ssm_stack[j])
    logger.info("recurrent states: %d rows of %.2f MiB (%s conv, %s delta rule; %d of them prefix-cache snapshots, "
                "%d draft states), %.2f GiB", rows, per_row / 2**20, str(conv_dtype).removeprefix("torch."),
                str(ssm_dtype).removeprefix("torch."), snapshot_slots, max_num_seqs * num_speculative_tokens,
                need / 2**30)
    return need


class StateRows:
    """Which pool row each running request holds (module docstring). Driven by the step's SchedulerOutput:
    rows of finished and preempted requests go back first, then every scheduled request without one gets one."""

    def __init__(self, max_num_seqs: int, snapshot_slots: int = 0, num_speculative_tokens: int = 0) -> None:
        self.max_num_seqs = max_num_seqs
        self.num_speculative_tokens = num_speculative_tokens
        # Request row r's draft rows: draft_base + (r - 1) * k + t (allocate_recurrent_states' layout).
        self.draft_base = max_num_seqs + 1 + snapshot_slots
        self.reset()

    def reset(self) -> None:
        """Every row free (after the warm-up, whose throwaway scheduler never reports its requests finished)."""
        self.free = list(range(self.max_num_seqs, 0, -1))  # (popped from the end: row 1 first)
        self.row_of: dict[str, int] = {}

    def release(self, so: Any) -> None:
        """Rows of the requests `so` reports finished or preempted go back. Every schedule's report must come here,
        one that runs no request too (an async engine's last schedule once its requests end): the scheduler reports
        a request finished once, so a report dropped is a row held for good."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free.append(row)

    def for_step(self, so: Any) -> npt.NDArray[np.int32]:
        """[num_reqs] the rows of the step's requests, in batch order (after `release`)."""
        self.release(so)
        rows = np.empty(len(so.req_ids), dtype=np.int32)
        for i, req_id in enumerate(so.req_ids):
            row = self.row_of.get(req_id)
            if row is None:
                if not self.free:
                    raise RuntimeError(f"recurrent states: no free row for request {req_id!r} "
                                       f"({len(self.row_of)} held; more running requests than max_num_seqs)")
                row = self.row_of[req_id] = self.free.pop()
            rows[i] = row
        return rows

    def copies(self, so: Any, rows: npt.NDArray[np.int32]) -> dict[str, npt.NDArray[np.int64]] | None:
        """The step's snapshot copies as pool rows (None: none): restores (slot -> the request's row, before the
        forward) and saves (row -> slot, after it). Slot s is row max_num_seqs + 1 + s."""
        if not so.num_state_copies:
            return None
        base = self.max_num_seqs + 1
        return {"state_restore_src": base + np.asarray(so.state_restore_slots, dtype=np.int64),
                "state_restore_dst": rows[np.asarray(so.state_restore_index)].astype(np.int64),
                "state_save_src": rows[np.asarray(so.state_save_index)].astype(np.int64),
                "state_save_dst": base + np.asarray(so.state_save_slots, dtype=np.int64)}


    def draft_rows(self, rows: npt.NDArray[np.int32], num_drafts: npt.NDArray[np.int32]) -> npt.NDArray[np.int64]:
        """[num_reqs, k] the rows keeping the state after each of a verify query's first num_drafts[i] tokens (the
        last sampled token, then all drafts but the last), -1 past them."""
        k = self.num_speculative_tokens
        t = np.arange(k, dtype=np.int64)
        out = self.draft_base + (rows.astype(np.int64)[:, None] - 1) * k + t
        return np.where(t < np.asarray(num_drafts)[:, None], out, -1)


STATE_COPY_NAMES = ("state_restore_src", "state_restore_dst", "state_save_src", "state_save_dst")


def keep_accepted(layers: list[Any], rows: torch.Tensor, draft_rows: torch.Tensor, accepted: torch.Tensor) -> None:
    """After a verify step (device tensors: rows and accepted [num_reqs] int64, draft_rows [num_reqs, k]): a
    request that rejected some of its drafts goes on from the state after its last accepted token, kept in its
    draft rows (the layers wrote it); one that accepted all keeps its row, whose state is after every draft.
    No host sync. Under tensor parallelism every rank runs it with the driver's `accepted` (broadcast)."""
    num_drafts = (draft_rows >= 0).sum(dim=1)
    kept = draft_rows.gather(1, accepted.clamp(min=0, max=max(draft_rows.shape[1] - 1, 0)).unsqueeze(1)).squeeze(1)
    src = torch.where(accepted < num_drafts, kept, rows)
    copy_state_rows(layers, src, rows)


def _row_pools(layers: list[Any]) -> list[tuple[torch.Tensor, int]]:
    """(tensor, its row dim) for every pool of `layers` (all of a model's): the stacks allocate_recurrent_states binds
    slices of, once each, or a layer's own pool where it is not such a slice."""
    out: list[tuple[torch.Tensor, int]] = []
    seen: set[int] = set()
    for layer in layers:
        for pool in (layer.conv_states, layer.ssm_states):
            stack = pool._base
            if stack is not None and stack.dim() == pool.dim() + 1 and stack.shape[1:] == pool.shape:
                if id(stack) not in seen:
                    seen.add(id(stack))
                    out.append((stack, 1))
            else:
                out.append((pool, 0))
    return out


def copy_state_rows(layers: list[Any], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Row dst[i] of every layer's pools takes row src[i] (int64 device tensors; rows distinct within dst)."""
    for pool, dim in _row_pools(layers):
        pool.index_copy_(dim, dst, pool.index_select(dim, src))
