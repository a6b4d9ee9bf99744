"""The model runner: one scheduler step in, the sampled tokens of that step out.

A step runs in four calls, so the engine core can put its host work between them:

    handle = runner.launch(so, prev)                  # inputs, forward, logits (queued on the device)
    runner.prepare_sampling(handle, in_flight)        # the sampler's per-row inputs
    runner.sample(handle, bitmask)                    # grammar mask, sampling, copy of the ids to the host
    out = runner.finish(handle)                       # wait; host-side results (ids, logprobs)

With async scheduling the engine launches step N+1 before finishing step N (`prev`: input ids
-1 in `so` are step N's sampled tokens, taken on the device). When a step has grammar-constrained
rows, it samples after step N is finished, because the mask needs step N's token; the forward
pass overlaps either way. On CUDA that sampling is queued at once behind a gate
(`open_mask_gate`, worker/mask_gate.py): the device, not the host, waits for the mask.

Per-request sampling state lives in the persistent `InputBatch`, one row per core request slot.

Nothing between `launch` and `finish` may block on the device: host->device arrays go through the
pinned `Uploader`, and device->host results (sampled ids, logprobs, prompt logprobs) are copied
into pinned memory when queued and read after `finish` waits for the step's event. A blocking
copy there would wait for the step launched after it and undo the overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.compilation_config import GraphPlan
from ferrox.distributed.parallel_state import TPGroup, get_tp_group
from ferrox.distributed.step_channel import SHUTDOWN, STEP, StepChannel
from ferrox.layers.sampler import LogprobsTensors, Sampler, SamplerOutput, SamplingMetadata, compute_logprobs
from ferrox.lora.rank_plan import plan_arrays
from ferrox.multimodal.inputs import MultiModalItem
from ferrox.sampling_params import SamplingParams
from ferrox.step_types import Logprobs
from ferrox.worker.custom_logits import CustomLogitsProcessors
from ferrox.worker.host_kv_tier import transfer_arrays
from ferrox.worker.input_batch import InFlight, InputBatch
from ferrox.worker.mask_gate import MaskGate, PendingMask
from ferrox.worker.model_forward import ModelForward, step_arrays
from ferrox.worker.multimodal import ImageEmbeddings
from ferrox.worker.rank_images import ImageEventLog, multimodal_rope
from ferrox.worker.recurrent_states import StateRows, keep_accepted
from ferrox.worker.request_state import RequestState
from ferrox.worker.spec_decode import expand_rows, verify
from ferrox.worker.step_inputs import Uploader

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelRunnerOutput:
    # [num_reqs], batch order; with num_sampled_tokens (a step that verified drafts): flat, request after
    # request, num_sampled_tokens[i] tokens each (update_from_output's layout).
    sampled_token_ids: npt.NDArray[np.int64]
    # batch row -> its positions (one, or one per token kept from drafts), rows that asked
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)  # request id -> complete, emitted once
    errors: dict[int, str] = field(default_factory=dict)  # batch row -> why its sampling failed
    num_sampled_tokens: npt.NDArray[np.int32] | None = None
    # A pooling step (worker/pooling_runner.py): request id -> its float32 vector (its token is a placeholder).
    pooled: dict[str, npt.NDArray[np.float32]] = field(default_factory=dict)

    def first_tokens(self) -> npt.NDArray[np.int64]:
        """[num_reqs] each request's first sampled token this step (its only one unless it had drafts:
        requests with a grammar never have drafts, so this is their token)."""
        if self.num_sampled_tokens is None:
            return self.sampled_token_ids
        starts = np.concatenate(([0], np.cumsum(self.num_sampled_tokens)[:-1]))
        return self.sampled_token_ids[starts]


@dataclass(slots=True)
class _PromptLogprobsChunk:
    state: RequestState
    start_pos: int  # logits row j scores prompt token start_pos + 1 + j
    tensors: LogprobsTensors | None  # host copies, complete after finish() waits; None: nothing to score


@dataclass(slots=True)
class StepHandle:
    """A launched step: its device work is queued; `finish` waits for it."""

    so: Any
    slots: npt.NDArray[np.int32]  # the core's request slots, batch order
    slots_dev: torch.Tensor
    generations: npt.NDArray[np.int64]  # InputBatch.generation of each slot at launch
    sample_mask: npt.NDArray[np.bool_]
    logits: torch.Tensor
    prompt_chunks: list[_PromptLogprobsChunk]
    sampled: SamplerOutput | None = None  # set by sample()
    num_logprobs: npt.NDArray[np.int32] | None = None  # per row at sampling time (-1: none)
    host_token_ids: torch.Tensor | None = None  # [num_reqs] int64, filled by a non-blocking copy
    host_logprobs: LogprobsTensors | None = None  # the sampled logprobs, copied like the ids
    done: torch.cuda.Event | None = None  # recorded after that copy (None on CPU)
    errors: dict[int, str] = field(default_factory=dict)
    # Sampling inputs built ahead of sample() (prepare_sampling), with the in-flight step they count.
    md: SamplingMetadata | None = None
    md_in_flight: InFlight | None = None
    # Speculative decoding: drafts per request when this step verifies any (worker/spec_decode.py); then
    # `logits` has 1 + d rows per request.
    num_drafts: npt.NDArray[np.int32] | None = None
    # A verified step (set by sample()): [num_reqs, max_drafts + 1] tokens and [num_reqs] counts on the
    # device, and their pinned host copies.
    verified: torch.Tensor | None = None
    num_sampled_dev: torch.Tensor | None = None
    host_verified: torch.Tensor | None = None
    host_num_sampled: torch.Tensor | None = None
    # Set by sample(): each row's last token on the device (the next step's placeholder for it), and
    # when the step had drafts, how many of them each row rejected ([num_reqs] int64): the core
    # scheduled the next step as if all were accepted, so that step's row is shifted back as much.
    last_tokens: torch.Tensor | None = None
    rejected: torch.Tensor | None = None
    # A hybrid model's verify step: its state rows and draft rows on the device (worker/recurrent_states.py).
    state_rows_dev: torch.Tensor | None = None
    draft_state_rows: torch.Tensor | None = None
    # Sampled behind a mask gate (open_mask_gate): the engine asks it, after finish(), whether the
    # constrained rows really were sampled under their filled mask.
    pending_mask: PendingMask | None = None
    # The forward's last hidden states [>= T, hidden] when the runner keeps them (keep_hidden: MTP drafts read
    # them after the step, worker/mtp_proposer.py); a CUDA graph's output: valid until the next launch.
    hidden: torch.Tensor | None = None

    def in_flight(self) -> InFlight:
        assert self.last_tokens is not None, "sample() not called"
        return InFlight(self.slots, self.generations, self.sample_mask, self.last_tokens)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        kv_caches: list[torch.Tensor],
        *,
        vocab_size: int,
        eos_token_ids: list[int],
        device: torch.device,
        seed: int = 0,
        tp: TPGroup | None = None,
        speculative: bool = False,
        lora: Any = None,
        logprobs_mode: str = "raw_logprobs",
        custom_logits: CustomLogitsProcessors | None = None,
        state_rows: StateRows | None = None,
    ) -> None:
        """speculative: steps may carry drafts to verify (speculative decoding). tp: the tensor-parallel group when the model is sharded; this runner is its driver
        (rank 0) and sends every step to the other ranks (distributed/step_channel.py) before
        running its own shard."""
        self.model = model
        self.kv_caches = kv_caches
        # A hybrid model's recurrent-state rows, handed out per request (worker/recurrent_states.py).
        self.state_rows = state_rows
        self.vocab_size = vocab_size
        self.device = device
        self._upload = Uploader(device)
        self.tp = tp or get_tp_group()
        self.forward = ModelForward(model, kv_caches, device, self.tp, self._upload)
        self.channel = StepChannel(self.tp) if self.tp.size > 1 else None
        self.input_batch = InputBatch(vocab_size, eos_token_ids, device, upload=self._upload)
        default_gen = torch.Generator(device=device)
        default_gen.manual_seed(seed)
        top_k_top_p_kernel = None
        if device.type == "cuda":
            from ferrox.kernels.cuda_sampling import prepare_extension

            top_k_top_p_kernel = prepare_extension()  # the CUDA kernel when a build is on disk
        self.sampler = Sampler(default_gen, top_k_top_p_kernel, logprobs_mode)
        # --logits-processors (worker/custom_logits.py): the user's processors, told each step's rows.
        self.custom_logits = custom_logits
        self.speculative = speculative
        self.keep_hidden = False  # (set by an engine drafting from the hidden states: StepHandle.hidden)
        # Multi-LoRA (engine/lora_state.py EngineLoRAs): each core slot's adapter id (0: none);
        # before every forward it gets each token's id (prepare_step) and sets the slot index.
        self.lora = lora
        self._lora_of_slot = np.zeros(0, dtype=np.int64)
        self._host_tokens: list[torch.Tensor] = []  # two pinned [max batch] buffers (GPU), by step parity
        self._step_parity = 0
        self._mask_gate: MaskGate | None = None  # CUDA: created with the first gated mask
        # A model that takes images (worker/multimodal.py): their embeddings replace the placeholder rows.
        self.images = ImageEmbeddings(model, device) if getattr(model, "takes_images", False) else None
        # Qwen2-VL: the rotary positions of requests with images (worker/mrope.py).
        self.mrope = multimodal_rope(model, device) if self.images is not None else None
        # Under tensor parallelism the other ranks embed the images too: they get the slots' changes with
        # each step (worker/rank_images.py).
        self._image_log = ImageEventLog() if self.images is not None and self.channel is not None else None

    @property
    def graph_runner(self) -> Any:
        return self.forward.graph_runner

    def capture_cuda_graphs(self, *, max_num_seqs: int, max_model_len: int, block_size: int,
                            verify_len: int = 0, max_num_batched_tokens: int = 0,
                            plan: GraphPlan | None = None) -> float | None:
        """Capture decode (and verify) graphs and piecewise graphs for short prefill and mixed steps, as
        the plan says (ModelForward.capture_cuda_graphs)."""
        return self.forward.capture_cuda_graphs(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                                block_size=block_size, verify_len=verify_len,
                                                max_num_batched_tokens=max_num_batched_tokens, plan=plan)

    def decode_graph_sizes(self) -> list[int]:
        return self.forward.decode_graph_sizes()

    def piecewise_graph_sizes(self) -> list[int]:
        return self.forward.piecewise_graph_sizes()

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks from their step loop."""
        if self.channel is not None:
            self.channel.send(SHUTDOWN)
            self.channel = None

    # ---- persistent batch -------------------------------------------------------------------------
    def add_request(self, slot: int, req_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    lora_id: int = 0, images: list[MultiModalItem] | None = None) -> None:
        self.input_batch.add(slot, req_id, prompt_token_ids, params)
        if self.custom_logits is not None:  # (prompt embeddings come with no ids: None, as vLLM's)
            self.custom_logits.add(slot, params, list(prompt_token_ids) if prompt_token_ids else None)
        if self.images is not None:
            self.images.add(slot, images)
            if self.mrope is not None:
                self.mrope.add(slot, len(prompt_token_ids), images)
            if self._image_log is not None:
                self._image_log.add(slot, len(prompt_token_ids), images)
        elif images:
            raise ValueError("images given to a runner whose model takes none")
        if self.lora is not None:
            if slot >= self._lora_of_slot.size:
                grown = np.zeros(max(2 * self._lora_of_slot.size, slot + 1, 64), dtype=np.int64)
                grown[:self._lora_of_slot.size] = self._lora_of_slot
                self._lora_of_slot = grown
            self._lora_of_slot[slot] = lora_id
        elif lora_id:
            raise ValueError("lora_id given to a runner built without LoRA")

    def remove_requests(self, slots: list[int] | npt.NDArray[np.int32]) -> None:
        self.input_batch.remove(slots)
        if self.custom_logits is not None:
            self.custom_logits.remove(slots)
        if self.images is not None:
            self.images.remove(slots)
        if self.mrope is not None:
            self.mrope.remove(slots)
        if self._image_log is not None:
            self._image_log.remove(slots)

    def append_accepted(self, slots: npt.NDArray[np.int32], token_ids: npt.NDArray[np.int32],
                        token_offsets: npt.NDArray[np.int32]) -> None:
        self.input_batch.append_accepted(slots, token_ids, token_offsets)

    # ---- one step -----------------------------------------------------------------------------------
    def execute(self, so: Any, grammar_bitmask: torch.Tensor | PendingMask | None = None) -> ModelRunnerOutput:
        """A whole synchronous step (launch, sample, finish)."""
        handle = self.launch(so)
        self.sample(handle, grammar_bitmask)
        return self.finish(handle)

    def release_unlaunched(self, so: Any) -> None:
        """A schedule with no request to run still reports requests finished or preempted: their recurrent-state
        rows go back now (launch does it for the others)."""
        if self.state_rows is not None:
            self.state_rows.release(so)

    @torch.inference_mode()
    def launch(self, so: Any, prev: StepHandle | None = None) -> StepHandle:
        """Queue one step's inputs, forward pass and logits without waiting. prev: the step still
        in flight when `so` was scheduled with keep_in_flight (its sampled ids feed the -1 holes)."""
        self._upload.next_step()
        slots = np.asarray(so.req_slots, dtype=np.int32)
        prompt_jobs = self._prompt_logprobs_jobs(slots, so) if self.input_batch.wants_prompt_logprobs[slots].any() \
            else []
        prompt_rows = np.array([(job[2], job[3]) for job in prompt_jobs], dtype=np.int64).reshape(-1, 2)
        shifted = prev is not None and prev.rejected is not None
        # LoRA first: under tensor parallelism its slot plan travels with the step (lora/rank_plan.py).
        rows = self.state_rows.for_step(so) if self.state_rows is not None else None
        state_copies = self.state_rows.copies(so, rows) if self.state_rows is not None and rows is not None else None
        draft_rows = None
        if rows is not None and self.speculative and self.state_rows is not None:
            num_drafts = np.asarray(so.num_draft_tokens, dtype=np.int32)
            if num_drafts.any():
                draft_rows = self.state_rows.draft_rows(rows, num_drafts)
        lora_plan = (self.lora.prepare_step(np.repeat(self._lora_of_slot[slots], np.asarray(so.num_scheduled_tokens)))
                     if self.lora is not None else None)
        if self.channel is not None:
            arrays = step_arrays(so, prompt_rows, shifted=shifted,
                                 calibrate_kv_scales=self.forward.kv_scale_calibration_armed)
            if self._image_log is not None:
                self._image_log.drain_into(arrays, so)
            if lora_plan is not None:
                arrays.update(plan_arrays(lora_plan))
            arrays.update(transfer_arrays(so))
            if rows is not None:
                arrays["state_rows"] = rows
            if state_copies is not None:
                arrays.update(state_copies)
            if draft_rows is not None:
                arrays["draft_state_rows"] = draft_rows
            self.channel.send(STEP, arrays)

        def fill_holes(input_ids: torch.Tensor, holes: np.ndarray) -> torch.Tensor | None:
            """Each placeholder gets its request's last token of `prev`. When `prev` verified drafts,
            returns how far back each row of the step moves ([num_reqs] int64 on the device): a row
            with a placeholder by the drafts its request rejected in `prev`."""
            if prev is None or prev.last_tokens is None:
                raise RuntimeError("input id -1 (a placeholder) in a step scheduled without one in flight")
            rows = np.searchsorted(so.query_start_loc, holes, side="right") - 1
            row_of_slot = np.full(int(max(slots.max(), prev.slots.max())) + 1, -1, dtype=np.int64)
            row_of_slot[prev.slots] = np.arange(prev.slots.size)
            src = row_of_slot[slots[rows]]
            if (src < 0).any():
                raise RuntimeError("a placeholder's request was not in the step in flight")
            src_dev = self._upload("placeholder_src", src)
            input_ids.index_copy_(0, self._upload("placeholder_pos", holes), prev.last_tokens.index_select(0, src_dev))
            if prev.rejected is None:
                return None
            # A placeholder is its row's first token: the whole row moves by its request's rejected drafts.
            row_shift = torch.zeros(len(slots), dtype=torch.int64, device=self.device)
            row_shift.index_copy_(0, self._upload("placeholder_rows", rows.astype(np.int64)),
                                  prev.rejected.index_select(0, src_dev))
            return row_shift

        image_rows = self.images.step_rows(so) if self.images else None
        mrope = self.mrope
        result = self.forward.run(so, prompt_rows, fill_holes, shifted=shifted, image_rows=image_rows,
                                  rope_positions=(lambda p: mrope.adjust(so, p)) if mrope is not None else None,
                                  state_rows=rows, state_copies=state_copies, draft_state_rows=draft_rows)
        chunks = self._prompt_logprobs(prompt_jobs, result.prompt_logits)
        sample_mask = np.asarray(so.sample_mask, dtype=np.bool_)
        handle = StepHandle(so, slots, self._upload("slots", slots), self.input_batch.generation[slots],
                            sample_mask, result.logits, chunks)
        if self.keep_hidden:
            handle.hidden = result.hidden
        if self.speculative:
            num_drafts = np.asarray(so.num_draft_tokens, dtype=np.int32)
            if num_drafts.any():
                handle.num_drafts = num_drafts
            if draft_rows is not None:
                handle.draft_state_rows = result.meta.draft_state_rows
                handle.state_rows_dev = result.meta.state_rows
        return handle

    @torch.inference_mode()
    def prepare_sampling(self, handle: StepHandle, in_flight: InFlight | None = None) -> None:
        """Build the step's sampling inputs now (per-row work, uploads), so that a step whose
        sample waits for a grammar mask has only the mask and the draw left to do then.
        in_flight: the previous step if its tokens have not been handed to the core yet."""
        if handle.num_drafts is not None:
            # One metadata row per logits row: each request's row repeated over its 1 + d positions.
            # (Rows whose settings count the in-flight token, penalties and min_tokens, have no drafts.)
            rows = expand_rows(handle.num_drafts)
            handle.md = self.input_batch.sampling_metadata(
                handle.slots[rows], handle.slots_dev.index_select(0, self._upload("spec_rows", rows)),
                handle.sample_mask[rows], in_flight)
            handle.md_in_flight = in_flight
            return
        handle.md = self.input_batch.sampling_metadata(handle.slots, handle.slots_dev, handle.sample_mask, in_flight)
        handle.md_in_flight = in_flight

    @property
    def can_gate_masks(self) -> bool:
        """Whether open_mask_gate works here (CUDA: the device can wait for the host)."""
        return self.device.type == "cuda"

    def open_mask_gate(self, rows: npt.NDArray[np.int64], words: int) -> PendingMask:
        """Queue a wait for a grammar mask of `rows` (batch rows, ascending; `words` int32 words each)
        that a host thread fills into the returned PendingMask's pinned `host` and then releases.
        Pass it to sample(), which can then be queued at once: the device waits, not the host."""
        if not self.can_gate_masks:
            raise RuntimeError(f"mask gates need a CUDA device, this runner is on {self.device}")
        if self._mask_gate is None or self._mask_gate.words != words:
            self._mask_gate = MaskGate(self.device, words)
        return self._mask_gate.open(np.asarray(rows, dtype=np.int64))

    def release_mask_gates(self) -> None:
        """Let the device past every gate opened so far (shutdown: no fill will come)."""
        if self._mask_gate is not None:
            self._mask_gate.release_all()

    @torch.inference_mode()
    def sample(self, handle: StepHandle, grammar_bitmask: torch.Tensor | PendingMask | None = None) -> None:
        """Queue the step's sampling and the copy of its ids to the host. grammar_bitmask: int32
        [num_reqs, words] allow-bits in batch order, a gated mask of the constrained rows
        (open_mask_gate), or None. Without prepare_sampling first, the sampling inputs are built here
        with no step in flight."""
        if handle.md is None:
            self.prepare_sampling(handle)
        if isinstance(grammar_bitmask, PendingMask):
            handle.pending_mask = grammar_bitmask
        logits = handle.logits
        handle.num_logprobs = self.input_batch.num_logprobs[handle.slots].copy()
        if handle.num_drafts is not None:
            if isinstance(grammar_bitmask, PendingMask):
                raise ValueError("a gated grammar mask has one row per request: not for a step with drafts")
            if grammar_bitmask is not None:  # a row per verified position (fill_bitmask_with_drafts)
                self._apply_grammar_bitmask(logits, grammar_bitmask)
            handle.sampled = self._verify(handle, grammar_bitmask)
        else:
            if grammar_bitmask is not None:
                self._apply_grammar_bitmask(logits, grammar_bitmask)
            handle.sampled = self._sample(logits, handle)
        if handle.sampled.logprobs is not None:
            handle.host_logprobs = _logprobs_to_host(handle.sampled.logprobs)
        handle.last_tokens = handle.sampled.token_ids
        drafted = np.asarray(handle.so.num_draft_tokens, dtype=np.int64) if self.speculative else None
        if drafted is not None and drafted.any():
            # The core counted every draft as accepted (worker docstring of `rejected`).
            expected = self._upload("drafted", drafted)
            if handle.verified is not None:
                assert handle.num_sampled_dev is not None
                handle.rejected = expected + 1 - handle.num_sampled_dev.to(torch.int64)
            else:  # verification failed and fell back to one plain token per row
                handle.rejected = expected
            if handle.draft_state_rows is not None and handle.state_rows_dev is not None:
                # A hybrid model goes on from the state after the accepted drafts (worker/recurrent_states.py);
                # the other ranks wait for the counts right after this step's forward (executor/worker_main.py).
                accepted = expected - handle.rejected
                self.forward.tp.broadcast(accepted)
                keep_accepted(self.forward.recurrent_layers, handle.state_rows_dev.long(), handle.draft_state_rows,
                              accepted)
        if self.device.type == "cpu":
            handle.host_token_ids = handle.sampled.token_ids
            handle.host_verified, handle.host_num_sampled = handle.verified, handle.num_sampled_dev
            return
        if handle.verified is not None and handle.num_sampled_dev is not None:
            # finish() reads these; the last tokens stay on the device for the next step's placeholders.
            handle.host_verified = _to_pinned(handle.verified)
            handle.host_num_sampled = _to_pinned(handle.num_sampled_dev)
        else:
            host = self._host_buffer(int(handle.sampled.token_ids.numel()))
            host.copy_(handle.sampled.token_ids, non_blocking=True)
            handle.host_token_ids = host
        handle.done = torch.cuda.Event()
        handle.done.record()  # after every copy to the host above and in launch()

    def _host_buffer(self, n: int) -> torch.Tensor:
        """Pinned landing place for a step's sampled ids; two alternate, as with the uploads."""
        self._step_parity ^= 1
        while len(self._host_tokens) < 2:
            self._host_tokens.append(torch.empty(0, dtype=torch.int64))
        buf = self._host_tokens[self._step_parity]
        if buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            self._host_tokens[self._step_parity] = buf
        return buf[:n]

    @torch.inference_mode()
    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a sampled step and do its host-side part (ids, logprobs)."""
        assert handle.sampled is not None and (handle.host_token_ids is not None or handle.host_verified is not None), \
            "sample() not called"
        if handle.done is not None:
            handle.done.synchronize()
        if handle.host_verified is not None and handle.host_num_sampled is not None:
            padded = handle.host_verified.numpy()
            counts = handle.host_num_sampled.numpy().astype(np.int32)
            out = ModelRunnerOutput(padded[np.arange(padded.shape[1])[None, :] < counts[:, None]],
                                    errors=handle.errors, num_sampled_tokens=counts)
        else:
            assert handle.host_token_ids is not None
            out = ModelRunnerOutput(handle.host_token_ids.numpy().copy(), errors=handle.errors)
            if self.custom_logits is not None:
                self.custom_logits.record(handle.slots, handle.sample_mask, out.sampled_token_ids)
        if handle.host_logprobs is not None:
            self._collect_logprobs(handle, out)
        if handle.prompt_chunks:
            self._finish_prompt_logprobs(handle.prompt_chunks, out)
        return out

    def _apply_grammar_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor | PendingMask) -> None:
        """Only rows with some bit cleared are applied: unconstrained rows (all ones) cost nothing.
        On a GPU only those rows' words are uploaded (through the Uploader) and one kernel sets
        their disallowed logits to -inf (kernels/token_bitmask.py). A gated mask is already on its way
        to the device, behind its gate, for just its rows."""
        if isinstance(bitmask, PendingMask):
            if bitmask.rows.size:
                # (imports triton: GPU path only)
                from ferrox.kernels.token_bitmask import apply_token_bitmask

                apply_token_bitmask(logits, bitmask.device, self._upload("grammar_rows", bitmask.rows))
            return
        words = bitmask.numpy()
        rows = np.flatnonzero((words != -1).any(axis=1))
        if not rows.size:
            return
        if logits.device.type == "cpu":
            from ferrox.structured.bitmask import apply_bitmask_rows

            apply_bitmask_rows(logits, bitmask, None if rows.size == len(words) else torch.from_numpy(rows))
            return
        from ferrox.kernels.token_bitmask import apply_token_bitmask

        apply_token_bitmask(logits, self._upload("grammar_bitmask", words if rows.size == len(words) else words[rows]),
                            self._upload("grammar_rows", rows.astype(np.int64)))

    # ---- sampling -------------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, handle: StepHandle) -> SamplerOutput:
        batch = self.input_batch
        md, in_flight = handle.md, handle.md_in_flight
        assert md is not None
        custom = self.custom_logits
        if custom is not None:
            try:
                custom.begin_step(handle.slots)
            except Exception as e:  # noqa: BLE001 - a processor sees the whole batch: every row fails
                return self._fail_rows(handle, logits, f"logits processor update_state failed: {type(e).__name__}: {e}")
            md.custom = custom.apply
        try:
            # The sampler edits logits in place; if it fails half-way the per-row retry below sees
            # partly processed rows, an accepted cost on an error path that never runs normally.
            return self.sampler(logits, md)
        except Exception as e:
            if custom is not None:
                # The user's processors work on the whole batch, so no row can be retried without them.
                logger.exception("sampling with custom logits processors (%s) failed", ", ".join(custom.names))
                return self._fail_rows(handle, logits, f"sampling with logits processors failed: {type(e).__name__}: {e}")
            logger.exception("batched sampling failed; retrying row by row to isolate the failing request")
        # One bad request (e.g. a NaN row, a broken logits processor) must not fail the others.
        token_ids = torch.zeros(len(handle.slots), dtype=torch.int64, device=logits.device)
        for i in range(len(handle.slots)):
            try:
                row_slots = handle.slots[i : i + 1]
                # Plain copies here: the Uploader's buffers hold one array per name per step.
                row_md = batch.sampling_metadata(row_slots, handle.slots_dev[i : i + 1], handle.sample_mask[i : i + 1],
                                                 self._row_in_flight(in_flight, int(row_slots[0])),
                                                 upload=batch.plain_upload)
                token_ids[i] = self.sampler(logits[i : i + 1].clone(), row_md).token_ids[0]
            except Exception as e:  # noqa: BLE001 - reported per request
                handle.errors[i] = f"sampling failed: {type(e).__name__}: {e}"
        result = SamplerOutput(token_ids, None)
        if md.max_num_logprobs is not None:
            result.logprobs = self.sampler.logprobs(logits, token_ids, md)
        return result

    @staticmethod
    def _fail_rows(handle: StepHandle, logits: torch.Tensor, message: str) -> SamplerOutput:
        for i in range(len(handle.slots)):
            handle.errors[i] = message
        return SamplerOutput(torch.zeros(len(handle.slots), dtype=torch.int64, device=logits.device), None)

    def _verify(self, handle: StepHandle, grammar_bitmask: torch.Tensor | None) -> SamplerOutput:
        """A step with drafts: the rejection sampler keeps each request's accepted drafts and adds one
        token (worker/spec_decode.py). If it fails, every request falls back to its first row sampled
        the plain way (no draft accepted: still exact), so one bad request cannot fail the others."""
        so, num_drafts = handle.so, handle.num_drafts
        assert num_drafts is not None and handle.md is not None
        states = self.input_batch.states
        generators = {}
        for i in np.flatnonzero(handle.sample_mask).tolist():
            state = states[int(handle.slots[i])]
            if state is not None and state.generator is not None:
                generators[i] = state.generator
        try:
            res = verify(self.sampler, handle.logits, handle.md, num_drafts=num_drafts,
                         draft_token_ids=np.asarray(so.draft_token_ids, dtype=np.int64),
                         greedy=self.input_batch.greedy[handle.slots], generators=generators)
        except Exception:
            logger.exception("verifying speculative drafts failed; sampling this step without them")
            first_rows = np.asarray(so.logits_start_loc[:-1], dtype=np.int64)
            handle.logits = handle.logits.index_select(0, self._upload("spec_first_rows", first_rows))
            handle.num_drafts = handle.md = None
            self.prepare_sampling(handle)
            if grammar_bitmask is not None:  # each request's first position: its mask before any draft
                self._apply_grammar_bitmask(handle.logits, grammar_bitmask[torch.from_numpy(first_rows)])
            return self._sample(handle.logits, handle)
        handle.verified, handle.num_sampled_dev = res.token_ids, res.num_sampled
        return SamplerOutput(res.last_tokens(), res.logprobs)

    @staticmethod
    def _row_in_flight(in_flight: InFlight | None, slot: int) -> InFlight | None:
        if in_flight is None:
            return None
        rows = np.flatnonzero((in_flight.slots == slot) & in_flight.sample_mask)
        if not rows.size:
            return None
        r = int(rows[0])
        return InFlight(in_flight.slots[r : r + 1], in_flight.generations[r : r + 1],
                        in_flight.sample_mask[r : r + 1], in_flight.token_ids[r : r + 1])

    def _collect_logprobs(self, handle: StepHandle, out: ModelRunnerOutput) -> None:
        """Each asking row's Logprobs: one position, or (a step that verified drafts) one per token it
        kept, since the host logprobs then have a row per sampled token (spec_decode.verify)."""
        lp = handle.host_logprobs  # on the host: finish() waited for its copy
        assert lp is not None and handle.num_logprobs is not None
        asking = np.flatnonzero((handle.num_logprobs >= 0) & handle.sample_mask)
        if not asking.size:
            return
        counts = out.num_sampled_tokens if out.num_sampled_tokens is not None else np.ones(len(handle.slots), np.int32)
        starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        flat = np.concatenate([np.arange(starts[i], starts[i] + counts[i]) for i in asking.tolist()])
        # A verified step's logprobs have one row per logits row (spec_decode.verify), its tokens not.
        lp_starts = np.asarray(handle.so.logits_start_loc[:-1], dtype=np.int64) if handle.host_verified is not None \
            else starts
        idx = torch.from_numpy(np.concatenate([np.arange(lp_starts[i], lp_starts[i] + counts[i])
                                               for i in asking.tolist()]))
        token_lp = lp.token_logprobs.index_select(0, idx).tolist()
        ranks = lp.token_ranks.index_select(0, idx).tolist()
        top_ids = lp.top_token_ids.index_select(0, idx).tolist()
        top_lp = lp.top_logprobs.index_select(0, idx).tolist()
        token_ids = out.sampled_token_ids[flat].tolist()
        k = 0
        for i in asking.tolist():
            m, n = int(counts[i]), int(handle.num_logprobs[i])
            if i not in out.errors:
                out.logprobs[i] = Logprobs(
                    token_ids=token_ids[k:k + m],
                    logprobs=token_lp[k:k + m],
                    ranks=ranks[k:k + m],
                    top_token_ids=[t[:n] for t in top_ids[k:k + m]],
                    top_logprobs=[t[:n] for t in top_lp[k:k + m]],
                )
            k += m

    # ---- prompt logprobs --------------------------------------------------------------------------------
    def _prompt_logprobs_jobs(self, slots: npt.NDArray[np.int32], so: Any) -> list[tuple[RequestState, int, int, int]]:
        """(state, start_pos, first hidden row, rows) per request that asked for prompt logprobs
        and has prompt positions in this step: logits of prompt position p score token p + 1."""
        qsl = so.query_start_loc.tolist()
        computed = so.num_computed_tokens.tolist()
        jobs: list[tuple[RequestState, int, int, int]] = []
        for i in np.flatnonzero(self.input_batch.wants_prompt_logprobs[slots]).tolist():
            state = self.input_batch.states[int(slots[i])]
            acc = state.prompt_logprobs if state is not None else None
            if state is None or acc is None or acc.emitted:
                continue
            start_pos = computed[i]
            end_pos = min(start_pos + qsl[i + 1] - qsl[i], len(state.prompt_token_ids) - 1)
            # (0 rows: nothing left to score, a 1-token prompt or the last chunk's last token only)
            jobs.append((state, start_pos, qsl[i], max(0, end_pos - start_pos)))
        return jobs

    def _prompt_logprobs(self, jobs: list[tuple[RequestState, int, int, int]],
                         logits: list[torch.Tensor]) -> list[_PromptLogprobsChunk]:
        chunks: list[_PromptLogprobsChunk] = []
        for k, ((state, start_pos, _, count), job_logits) in enumerate(zip(jobs, logits, strict=True)):
            acc = state.prompt_logprobs
            assert acc is not None
            if count:
                prompt = state.prompt_token_ids
                targets = self._upload(f"prompt_targets_{k}",
                                       np.array(prompt[start_pos + 1 : start_pos + 1 + count], dtype=np.int64))
                # Prompt positions take no sampling settings: raw and processed modes agree (vLLM's).
                lp = _logprobs_to_host(compute_logprobs(job_logits, targets, acc.num_top,
                                                        normalize=self.sampler.normalized))
                chunks.append(_PromptLogprobsChunk(state, start_pos, lp))
            else:
                chunks.append(_PromptLogprobsChunk(state, start_pos, None))
        return chunks

    @staticmethod
    def _finish_prompt_logprobs(chunks: list[_PromptLogprobsChunk], out: ModelRunnerOutput) -> None:
        for chunk in chunks:
            acc, prompt = chunk.state.prompt_logprobs, chunk.state.prompt_token_ids
            assert acc is not None
            lp = chunk.tensors
            if lp is not None:
                chosen, ranks = lp.token_logprobs.tolist(), lp.token_ranks.tolist()
                top_ids, top_lp = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
                for j in range(len(chosen)):
                    acc.token_logprobs[chunk.start_pos + 1 + j] = (chosen[j], ranks[j], top_ids[j], top_lp[j])
            if not acc.emitted and len(acc.token_logprobs) >= len(prompt) - 1:
                positions = range(1, len(prompt))
                entries = [acc.token_logprobs[p] for p in positions]
                out.prompt_logprobs[chunk.state.req_id] = Logprobs(
                    token_ids=[prompt[p] for p in positions],
                    logprobs=[e[0] for e in entries],
                    ranks=[e[1] for e in entries],
                    top_token_ids=[e[2] for e in entries],
                    top_logprobs=[e[3] for e in entries],
                )
                acc.emitted = True
                acc.token_logprobs.clear()


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """Queue a copy into pinned host memory (no wait; the step's event covers it)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    """Queue copies of logprob tensors into pinned host memory (no wait; the step's event covers
    them). On CPU they are already there."""
    if lp.token_logprobs.device.type == "cpu":
        return lp

    return LogprobsTensors(_to_pinned(lp.token_logprobs), _to_pinned(lp.token_ranks), _to_pinned(lp.top_token_ids),
                           _to_pinned(lp.top_logprobs))
