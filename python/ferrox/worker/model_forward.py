"""One rank's forward pass of a scheduled step: inputs to the device, the model (a CUDA graph or
eager), the logits of the rows that need them.

The same code runs on every tensor-parallel rank, so the ranks issue the same collectives in the
same order: the driver (rank 0) calls it from the model runner with the core's SchedulerOutput;
the other ranks call it with the arrays the driver broadcast (`step_arrays`). Anything a rank
decides here (CUDA graph or eager, which rows get logits) follows from those arrays alone.

Input ids of -1 are placeholders for tokens the previous step is still sampling (async
scheduling). Only the driver has those tokens (it samples): it fills the holes on the device and,
under tensor parallelism, broadcasts the finished input ids to the other ranks (NCCL, no host
round trip).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ferrox.attention.kv_scale_calibration import KvScaleCalibration
from ferrox.attention.metadata import AttentionMetadata
from ferrox.compilation_config import GraphPlan
from ferrox.distributed.parallel_state import TPGroup
from ferrox.worker.multimodal import StepImages
from ferrox.worker.recurrent_states import STATE_COPY_NAMES, copy_state_rows, recurrent_layers
from ferrox.worker.step_inputs import Uploader, step_tensors

logger = logging.getLogger(__name__)

# The SchedulerOutput arrays a forward pass reads (what the driver sends the other ranks).
STEP_ARRAY_NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "num_scheduled_tokens",
                    "block_table", "logits_indices")


class StepArrays:
    """A step as the non-driver ranks receive it: SchedulerOutput's array attributes by name,
    plus `prompt_rows` ([k, 2] start, count: the hidden rows whose logits score prompt tokens) and, for a
    model that takes images, `req_slots` (worker/rank_images.py)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_scheduled_tokens: np.ndarray
    block_table: np.ndarray
    logits_indices: np.ndarray

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        for name in STEP_ARRAY_NAMES:
            setattr(self, name, arrays[name])
        self.prompt_rows = arrays.get("prompt_rows", np.zeros((0, 2), dtype=np.int64))
        # The host tier's copies (worker/host_kv_tier.py), when the step has any.
        none = np.zeros(0, dtype=np.int64)
        self.kv_offload_blocks = arrays.get("kv_offload_blocks", none)
        self.kv_offload_slots = arrays.get("kv_offload_slots", none)
        self.kv_load_slots = arrays.get("kv_load_slots", none)
        self.kv_load_blocks = arrays.get("kv_load_blocks", none)
        self.num_kv_transfers = int(self.kv_offload_blocks.size + self.kv_load_blocks.size)
        self.req_slots = arrays.get("req_slots", np.zeros(0, dtype=np.int32))
        self.state_rows: np.ndarray | None = arrays.get("state_rows")  # (hybrid models: worker/recurrent_states.py)
        self.state_copies = ({name: arrays[name] for name in STATE_COPY_NAMES} if STATE_COPY_NAMES[0] in arrays
                             else None)
        self.draft_state_rows: np.ndarray | None = arrays.get("draft_state_rows")
        self.num_tokens = int(self.input_ids.shape[0])
        self.shifted = bool(arrays.get("shifted", np.zeros(1, dtype=np.bool_))[0])
        self.calibrate_kv_scales = "calibrate_kv_scales" in arrays


def step_arrays(so: Any, prompt_rows: np.ndarray, *, shifted: bool = False,
                calibrate_kv_scales: bool = False) -> dict[str, np.ndarray]:
    """shifted: the driver will broadcast a per-row shift of the positions (ModelForward.run).
    calibrate_kv_scales: the step measures the FP8 KV cache scales (attention/kv_scale_calibration.py)."""
    arrays = {name: np.asarray(getattr(so, name)) for name in STEP_ARRAY_NAMES}
    arrays["prompt_rows"] = prompt_rows
    arrays["shifted"] = np.array([shifted], dtype=np.bool_)
    if calibrate_kv_scales:
        arrays["calibrate_kv_scales"] = np.ones(1, dtype=np.bool_)
    return arrays


@dataclass(slots=True)
class ForwardResult:
    hidden: torch.Tensor  # [T, hidden]; a CUDA graph's static output: valid until the next run
    logits: torch.Tensor  # float32 [len(logits_indices), vocab]
    prompt_logits: list[torch.Tensor]  # one [count, vocab] per prompt_rows entry
    meta: AttentionMetadata


class ModelForward:
    def __init__(self, model: Any, kv_caches: list[torch.Tensor], device: torch.device, tp: TPGroup,
                 upload: Uploader) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.tp = tp
        self.upload = upload
        # Decode-only and speculative verify steps replay captured CUDA graphs when set
        # (worker/cuda_graphs.py). None: eager.
        self.graph_runner: Any = None
        # Other steps of up to 512 tokens (2,048 on MoE models) replay piecewise graphs around eager
        # attention when set (worker/piecewise_graphs.py). None: eager.
        self.piece_runner: Any = None
        # --kv-offloading-size: the prefix cache's host tier (worker/host_kv_tier.py), whose copies each step
        # runs before its forward. None: no tier.
        self.host_tier: Any = None
        # calculate_kv_scales: armed on the driver after the warm-up, so the first step that serves
        # requests measures the FP8 KV cache scales (eagerly); the other ranks are told by that step.
        self._kv_scale_calibration: KvScaleCalibration | None = None
        # A hybrid model's layers with recurrent states, whose prefix-cache snapshots a step may copy.
        self.recurrent_layers = recurrent_layers(model)

    def arm_kv_scale_calibration(self) -> None:
        """The next step measures the FP8 KV cache scales (attention/kv_scale_calibration.py)."""
        self._kv_scale_calibration = KvScaleCalibration(self.model)

    @property
    def kv_scale_calibration_armed(self) -> bool:
        return self._kv_scale_calibration is not None

    def capture_cuda_graphs(self, *, max_num_seqs: int, max_model_len: int, block_size: int,
                            verify_len: int = 0, max_num_batched_tokens: int = 0,
                            plan: GraphPlan | None = None) -> float | None:
        """Capture what the plan asks for (ferrox/compilation_config.py; None: both kinds at ferrox's sizes):
        decode graphs for the batch-size ladder (and, with verify_len = k + 1 for k speculative tokens,
        graphs of verify steps), then piecewise graphs for other steps of up to min(512 or the model's
        piecewise_graph_tokens, max_num_batched_tokens) tokens -- or the plan's sizes. Returns seconds, or
        None if the decode graphs failed (logged; the engine then runs eagerly; the piecewise graphs
        failing alone leaves the decode graphs on). Under tensor parallelism every rank captures the same
        graphs, all-reduces included."""
        from ferrox.worker.cuda_graphs import CudaGraphRunner, decode_capture_sizes
        from ferrox.worker.piecewise_graphs import (
            PiecewiseGraphRunner,
            piecewise_capture_sizes,
            piecewise_graphs_enabled,
        )

        plan = plan or GraphPlan()
        if not getattr(self.model, "supports_cuda_graphs", True):
            # (an attention backend that plans steps on the host: DeepSeek's MLA on the torch backend)
            logger.info("%s runs every step eagerly (no CUDA graphs)", type(self.model).__name__)
            return None
        seconds = 0.0
        decode_sizes = decode_capture_sizes(plan, max_num_seqs)
        if plan.decode and decode_sizes != []:
            try:
                runner = CudaGraphRunner(self.model, self.kv_caches, max_num_seqs=max_num_seqs,
                                         max_model_len=max_model_len, block_size=block_size, device=self.device,
                                         verify_len=verify_len, batch_sizes=decode_sizes)
                seconds = runner.capture()
            except Exception:
                if self.tp.size > 1:
                    raise  # the other ranks would wait in a collective this rank never joins
                logger.exception("CUDA graph capture failed; decode steps run eagerly")
                return None
            self.graph_runner = runner
        if not plan.piecewise or not piecewise_graphs_enabled() or max_num_batched_tokens < 1:
            return seconds
        if recurrent_layers(self.model):
            # (a hybrid model: its linear-attention layers read per-request states, eagerly between pieces)
            logger.info("piecewise CUDA graphs: off (a hybrid model's recurrent layers); prefill steps run eagerly")
            return seconds
        if not getattr(getattr(self.model, "backend", None), "uniform_heads", True):
            # (Gemma 4: the layers' heads differ, and one capture holds one attention shape: eager prefill)
            logger.info("piecewise CUDA graphs: off (the layers' attention shapes differ); prefill steps run eagerly")
            return seconds
        piece_sizes = piecewise_capture_sizes(plan, max_num_batched_tokens)
        if piece_sizes == []:
            return seconds
        try:
            pieces = PiecewiseGraphRunner(self.model, self.kv_caches, max_num_batched_tokens=max_num_batched_tokens,
                                          block_size=block_size, device=self.device, sizes=piece_sizes)
            if pieces.sizes:
                seconds += pieces.capture()
                self.piece_runner = pieces
        except Exception:
            if self.tp.size > 1:
                raise
            logger.exception("piecewise CUDA graph capture failed; prefill and mixed steps run eagerly")
            torch.cuda.synchronize(self.device)
        return seconds

    def decode_graph_sizes(self) -> list[int]:
        """The decode batch sizes captured (empty: none)."""
        return list(self.graph_runner.batch_sizes) if self.graph_runner is not None else []

    def piecewise_graph_sizes(self) -> list[int]:
        """The token counts of the piecewise graphs captured (empty: none)."""
        return list(self.piece_runner.sizes) if self.piece_runner is not None else []

    @torch.inference_mode()
    def run(self, step: Any, prompt_rows: np.ndarray,
            fill_holes: Callable[[torch.Tensor, np.ndarray], torch.Tensor | None] | None = None, *,
            shifted: bool = False, image_rows: StepImages | None = None,
            rope_positions: Callable[[torch.Tensor], torch.Tensor] | None = None,
            state_rows: np.ndarray | None = None,
            state_copies: dict[str, np.ndarray] | None = None,
            draft_state_rows: np.ndarray | None = None) -> ForwardResult:
        """step: a SchedulerOutput or StepArrays. fill_holes(input_ids, hole_positions): the
        driver's filler of placeholder ids (None on the other ranks); it returns each row's shift
        when the step in flight verified drafts (`shifted`; the other ranks read it from `step`).
        image_rows: the images' rows in this step (worker/multimodal.py); such a step runs eagerly from
        its input embeddings. rope_positions: the rotary's positions from the step's (Qwen2-VL's
        multimodal RoPE: worker/mrope.py); [3, T] ones run eagerly too. state_rows: a hybrid model's
        recurrent-state rows of the step's requests (worker/recurrent_states.py; the other ranks read them
        from `step`), and state_copies its prefix-cache snapshots to restore before the layers and save after
        (StateRows.copies; from `step` likewise); draft_state_rows: with speculative drafts, where the layers
        keep each draft's state (StateRows.draft_rows; from `step` likewise)."""
        if self.host_tier is not None:
            self.host_tier.apply(step)  # the core's offloads, then loads (before any layer reads the cache)
        upload = self.upload
        input_ids_np = step.input_ids
        meta, (input_ids, positions, logits_indices) = step_tensors(step, upload, input_ids_np, step.positions,
                                                                     step.logits_indices)
        if state_rows is None:
            state_rows = getattr(step, "state_rows", None)
        if state_rows is not None:
            meta.state_rows = upload("state_rows", state_rows)
        if draft_state_rows is None:
            draft_state_rows = getattr(step, "draft_state_rows", None)
        if draft_state_rows is not None:
            meta.draft_state_rows = upload("draft_state_rows", draft_state_rows)
        if state_copies is None:
            state_copies = getattr(step, "state_copies", None)
        if state_copies is not None and state_copies["state_restore_src"].size:
            copy_state_rows(self.recurrent_layers, upload("state_restore_src", state_copies["state_restore_src"]),
                            upload("state_restore_dst", state_copies["state_restore_dst"]))
        holes = np.flatnonzero(input_ids_np < 0)
        row_shift = None
        if holes.size:
            if fill_holes is not None:
                row_shift = fill_holes(input_ids, holes)
            self.tp.broadcast(input_ids)
        if shifted or getattr(step, "shifted", False):
            if row_shift is None:
                row_shift = torch.zeros(meta.num_reqs, dtype=torch.int64, device=self.device)
            self.tp.broadcast(row_shift)
            positions = self._shift_back(row_shift, positions, meta, step)
        if rope_positions is not None:
            positions = rope_positions(positions)
        calibration = self._kv_scale_calibration
        if calibration is None and getattr(step, "calibrate_kv_scales", False):  # a rank the driver told
            calibration = KvScaleCalibration(self.model)
        self._kv_scale_calibration = None
        # A measuring step runs eagerly, so every layer sees its K/V before writing them (graphs run no Python).
        graphs = calibration is None
        with calibration if calibration is not None else contextlib.nullcontext():
            if image_rows is not None:
                embeds = self.model.embed_input_ids(input_ids)
                embeds.index_copy_(0, image_rows.rows, image_rows.embeds.to(embeds.dtype))
                meta.bidirectional = image_rows.bidirectional
                extra = {} if image_rows.deepstack is None else {"deepstack": (image_rows.rows, image_rows.deepstack)}
                hidden = self.model.forward(input_ids, positions, self.kv_caches, meta, inputs_embeds=embeds,
                                            **extra)
            elif positions.dim() > 1:  # multimodal rotary positions: the graphs take [T] positions
                hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
            elif graphs and self.graph_runner is not None and self.graph_runner.can_run(meta):
                hidden = self.graph_runner.run(input_ids, positions, meta)
            elif graphs and self.piece_runner is not None and self.piece_runner.can_run(meta):
                hidden = self.piece_runner.run(input_ids, positions, meta)
            else:
                hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        if state_copies is not None and state_copies["state_save_src"].size:
            # (in stream order after the layers, and before the next step's restores)
            copy_state_rows(self.recurrent_layers, upload("state_save_src", state_copies["state_save_src"]),
                            upload("state_save_dst", state_copies["state_save_dst"]))
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        # Now, not later: a CUDA-graph replay of the next step overwrites `hidden`.
        prompt_logits = [self.model.compute_logits(hidden[int(start):int(start) + int(count)])
                         for start, count in prompt_rows.tolist()]
        return ForwardResult(hidden, logits, prompt_logits, meta)

    def _shift_back(self, row_shift: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    step: Any) -> torch.Tensor:
        """Speculation under async scheduling: the core placed each row as if the step in flight
        accepted all its drafts; move the row's tokens back by the drafts it rejected (known only on
        the device): positions, the slots their K/V goes to, and the row's sequence length. The
        host-side max_seq_len stays an upper bound, which is all the kernels use it for."""
        block_size = int(self.kv_caches[0].shape[2])
        token_rows = torch.repeat_interleave(
            self.upload("shift_rows_tokens", np.asarray(step.num_scheduled_tokens, dtype=np.int64)),
            output_size=int(positions.shape[0]))
        positions = positions - row_shift.index_select(0, token_rows)
        blocks = meta.block_table[token_rows, positions // block_size].to(torch.int64)
        meta.slot_mapping = blocks * block_size + positions % block_size
        meta.seq_lens = meta.seq_lens - row_shift.to(meta.seq_lens.dtype)
        if meta.seq_lens.device.type == "cpu":
            meta.seq_lens_cpu = meta.seq_lens
        return positions
