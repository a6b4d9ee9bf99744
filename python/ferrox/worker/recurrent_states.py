"""Recurrent states of hybrid models: one row of state per running request, beside the paged KV cache.

A hybrid model (Qwen3-Next, Qwen3.5 / 3.6: Gated DeltaNet layers between full-attention layers) keeps, for
each request, a fixed-size state per linear-attention layer: the short convolution's last W-1 inputs and the
delta rule's [heads, key dim, value dim] matrix. Those do not grow with the sequence, so they live in a pool
of rows, not in KV blocks: row r of every layer's pool belongs to one request while it runs.

- Rows: max_num_seqs + 1. Row 0 is scratch: the profiling and warm-up steps, CUDA-graph capture and a
  graph's padding requests read and write it, never a request. A running request holds a row from the
  step that first schedules it until it finishes or is preempted (then its state is gone: a preempted
  request is recomputed from its first token, like its KV), so running <= max_num_seqs rows always suffice.
- Whether a row's content is used: a request whose step starts at position 0 (nothing computed before)
  starts from zeros whatever its row holds; one that continues (a later prefill chunk, decode) reads its row.
  The layers decide this on the device from the step's seq_lens and query lengths
  (AttentionMetadata.state_rows), so the rows need no zeroing and CUDA graphs replay it.
- The prefix cache cannot serve these models: a cached block restores K/V but not the state after it (vLLM's
  hybrid prefix caching snapshots states per block; ferrox does not yet), so the engine turns it off for them.

Element types follow vLLM's --mamba-cache-dtype / --mamba-ssm-cache-dtype ("auto": the model's dtype).
"""

from __future__ import annotations

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


def state_dtypes(mamba_cache_dtype: str, mamba_ssm_cache_dtype: str,
                 model_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(conv state dtype, delta-rule state dtype) as vLLM resolves its two flags."""
    conv = model_dtype if mamba_cache_dtype == "auto" else _DTYPES[mamba_cache_dtype]
    ssm = conv if mamba_ssm_cache_dtype == "auto" else _DTYPES[mamba_ssm_cache_dtype]
    return conv, ssm


def check_recurrent_config(config: Any, *, pooling: bool = False) -> None:
    """Refuse by name what these states cannot follow yet; say that the prefix cache is off for them."""
    if config.speculative_config:
        raise ValueError("speculative_config: a hybrid linear-attention model's recurrent states would take in "
                         "rejected draft tokens (vLLM keeps a state per draft position; ferrox not yet)")
    if config.kv_offloading_size or config.kv_transfer_config:
        raise ValueError("kv_offloading_size / kv_transfer_config: the host tier restores KV blocks of cached "
                         "prefixes, and a hybrid model's recurrent states cannot be restored from them")
    if parse_kv_events_config(config.kv_events_config).enable_kv_cache_events:
        raise ValueError("kv_events_config.enable_kv_cache_events: the events are the prefix cache's, which a "
                         "hybrid linear-attention model is served without")
    if config.enable_lora:
        raise ValueError("enable_lora: LoRA adapters on a hybrid linear-attention model are not supported yet")
    if not pooling and config.enable_prefix_caching:
        # (a warning: --enable-prefix-caching, ferrox's default, does not take effect for these models)
        logger.warning("prefix caching: off for this hybrid model (a cached block restores K/V, not the recurrent "
                       "state after it); enable_prefix_caching has no effect here")


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


def allocate_recurrent_states(model: Any, max_num_seqs: int, conv_dtype: torch.dtype, ssm_dtype: torch.dtype,
                              device: torch.device) -> int:
    """Give every recurrent layer its pools of max_num_seqs + 1 rows (row 0: scratch); returns the bytes.
    Done before the KV cache is sized, so the profiled budget leaves them out."""
    rows = max_num_seqs + 1
    per_row = bytes_per_row(model, conv_dtype, ssm_dtype)
    need = rows * per_row
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need > free:
            raise ValueError(f"max_num_seqs: {max_num_seqs} requests' recurrent states take {need / 2**30:.2f} GiB "
                             f"({per_row / 2**20:.1f} MiB each) and the GPU has {free / 2**30:.2f} GiB free; lower "
                             "--max-num-seqs (or the state dtypes: --mamba-ssm-cache-dtype)")
    for layer in recurrent_layers(model):
        conv, ssm = layer.state_shapes()
        layer.bind_states(torch.zeros((rows, *conv), dtype=conv_dtype, device=device),
                          torch.zeros((rows, *ssm), dtype=ssm_dtype, device=device))
    logger.info("recurrent states: %d rows of %.2f MiB (%s conv, %s delta rule), %.2f GiB", rows, per_row / 2**20,
                str(conv_dtype).removeprefix("torch."), str(ssm_dtype).removeprefix("torch."), need / 2**30)
    return need


class StateRows:
    """Which pool row each running request holds (module docstring). Driven by the step's SchedulerOutput:
    rows of finished and preempted requests go back first, then every scheduled request without one gets one."""

    def __init__(self, max_num_seqs: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.reset()

    def reset(self) -> None:
        """Every row free (after the warm-up, whose throwaway scheduler never reports its requests finished)."""
        self.free = list(range(self.max_num_seqs, 0, -1))  # (popped from the end: row 1 first)
        self.row_of: dict[str, int] = {}

    def for_step(self, so: Any) -> npt.NDArray[np.int32]:
        """[num_reqs] the rows of the step's requests, in batch order."""
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free.append(row)
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
