"""The model runner: one scheduler step in, one sampled token per scheduled request out.

It keeps a persistent batch (`RequestState` per live request, keyed by request id) so that the
per-step work is only: wrap the core's flat numpy arrays as tensors (no copy on CPU), build the
AttentionMetadata, run the model under inference_mode, gather the logits of each request's last
scheduled token, and sample. Requests are added when the engine accepts them and dropped when
the scheduler lists them in `finished_req_ids`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.attention.metadata import AttentionMetadata
from ferrox.engine.protocol import EngineCoreRequest, Logprobs
from ferrox.layers.sampler import Sampler, SamplerOutput, compute_logprobs
from ferrox.worker.request_state import PromptLogprobsAccumulator, RequestState
from ferrox.worker.sampling_batch import SamplingBatchBuilder

logger = logging.getLogger(__name__)

# Structured outputs: the allow-bits, or a function filling them once the forward pass is queued.
GrammarBitmask = torch.Tensor | Callable[[], torch.Tensor | None] | None


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled_token_ids: npt.NDArray[np.int64]  # [num_reqs], batch order
    logprobs: dict[str, Logprobs] = field(default_factory=dict)  # one position, for rows that asked
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)  # complete, emitted once
    errors: dict[str, str] = field(default_factory=dict)  # request id -> why its sampling failed


def _as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    if not array.flags.writeable:
        # torch.from_numpy warns on read-only buffers; a copy of a few KB is cheaper than the warning.
        array = array.copy()
    t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


class _Uploader:
    """Moves the core's per-step numpy arrays to the model's device.

    CPU: wraps them without a copy. GPU: stages them in reusable pinned host buffers so the copies
    are truly asynchronous. There are two sets of buffers, alternating by step (`next_step`): with
    async scheduling step N+1 is staged while step N (whose copies may still be queued) runs, and
    by then step N-1's sampled tokens have been read back, which waited for its copies.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: dict[tuple[str, int], torch.Tensor] = {}
        self._parity = 0

    def next_step(self) -> None:
        self._parity ^= 1

    def __call__(self, name: str, array: np.ndarray) -> torch.Tensor:
        if self.device.type == "cpu":
            return _as_tensor(array, self.device)
        key = (name, self._parity)
        buf = self._pinned.get(key)
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        if buf is None or buf.numel() < array.size or buf.dtype != dtype:
            buf = torch.empty(max(2 * array.size, 1024), dtype=dtype, pin_memory=True)
            self._pinned[key] = buf
        host = buf[: array.size].view(array.shape)
        host.numpy()[...] = array
        return host.to(self.device, non_blocking=True)


@dataclass(slots=True)
class StepHandle:
    """A launched step: its device work is queued; `ModelRunner.finish` waits for it and returns
    the host-side results. With async scheduling the next step is launched before that."""

    req_ids: list[str]
    states: list[RequestState]
    sample_mask: list[bool]
    sampled: SamplerOutput  # on the device
    host_token_ids: torch.Tensor  # [num_reqs] int64, filled by a non-blocking copy (pinned on GPU)
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU)
    out: ModelRunnerOutput
    hidden: torch.Tensor
    so: Any
    _row_of: dict[str, int] | None = None

    def row_of(self, req_id: str) -> int:
        if self._row_of is None:
            self._row_of = {r: i for i, r in enumerate(self.req_ids)}
        return self._row_of[req_id]


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
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.requests: dict[str, RequestState] = {}
        self.sampling_batch = SamplingBatchBuilder(vocab_size, device)
        default_gen = torch.Generator(device=device)
        default_gen.manual_seed(seed)
        top_k_top_p_kernel = None
        if device.type == "cuda":
            from ferrox.kernels.cuda_sampling import prepare_extension

            top_k_top_p_kernel = prepare_extension()  # the CUDA kernel when a build is on disk
        self.sampler = Sampler(default_gen, top_k_top_p_kernel)
        self._upload = _Uploader(device)
        self._host_tokens: list[torch.Tensor] = []  # two pinned [max batch] buffers (GPU), by step parity
        self._step_parity = 0
        # Requests whose sampling reads the previous step's tokens on the host (penalties,
        # min_tokens) or whose results need host work in the step (logprobs): while any is live
        # the engine steps synchronously (see needs_sync_steps).
        self._sync_only: set[str] = set()
        # Decode-only steps replay captured CUDA graphs when set (worker/cuda_graphs.py; see
        # capture_cuda_graphs). None: always eager (CPU, --enforce-eager).
        self.graph_runner: Any = None

    def capture_cuda_graphs(self, *, max_num_seqs: int, max_model_len: int, block_size: int) -> float | None:
        """Capture decode graphs for the batch-size ladder; returns seconds, or None if it failed
        (logged; the engine then runs eagerly)."""
        from ferrox.worker.cuda_graphs import CudaGraphRunner

        try:
            runner = CudaGraphRunner(self.model, self.kv_caches, max_num_seqs=max_num_seqs,
                                     max_model_len=max_model_len, block_size=block_size, device=self.device)
            seconds = runner.capture()
        except Exception:
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            return None
        self.graph_runner = runner
        return seconds

    # ---- persistent batch -------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        params = request.sampling_params
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids = self.eos_token_ids + [t for t in stop_ids if t not in self.eos_token_ids]
        state = RequestState(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            params=params,
            stop_ids_for_min_tokens=stop_ids,
        )
        if params.seed is not None and not params.is_greedy:
            state.generator = torch.Generator(device=self.device)
            state.generator.manual_seed(params.seed)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = PromptLogprobsAccumulator(num_top=params.prompt_logprobs)
        self.requests[request.request_id] = state
        if (state.has_penalties or params.min_tokens > 0 or params.logprobs is not None
                or params.prompt_logprobs is not None):
            self._sync_only.add(request.request_id)
        # A finished request's id may come back with other parameters: never reuse cached rows for it.
        self.sampling_batch.invalidate()

    def remove_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            self.requests.pop(req_id, None)
            self._sync_only.discard(req_id)

    @property
    def needs_sync_steps(self) -> bool:
        """True while a live request cannot run with async scheduling."""
        return bool(self._sync_only)

    # ---- one step -----------------------------------------------------------------------------------
    def execute(self, so: Any, grammar_bitmask: GrammarBitmask = None) -> ModelRunnerOutput:
        """so: ferrox._core.SchedulerOutput with num_reqs > 0. grammar_bitmask: int32
        [num_reqs, words] allow-bits in batch order (structured outputs), a function returning it
        (called after the forward pass is queued), or None."""
        return self.finish(self.launch(so, grammar_bitmask))

    @torch.inference_mode()
    def launch(
        self, so: Any, grammar_bitmask: GrammarBitmask = None, prev: StepHandle | None = None
    ) -> StepHandle:
        """Queue one step's device work (inputs, forward, logits, sampling, copy of the sampled ids
        to the host) without waiting for it. prev: the step still in flight when `so` was scheduled
        with keep_in_flight; input ids -1 in `so` are its sampled tokens, taken on the device."""
        self.remove_requests(so.finished_req_ids)
        self._upload.next_step()
        dev = self.device
        req_ids: list[str] = so.req_ids
        states = [self.requests[r] for r in req_ids]
        qsl_np = so.query_start_loc
        seq_lens_np = so.seq_lens
        num_sched_np = so.num_scheduled_tokens
        max_query_len = int(num_sched_np.max())
        upload = self._upload
        qsl_cpu = _as_tensor(qsl_np, torch.device("cpu"))
        seq_lens_cpu = _as_tensor(seq_lens_np, torch.device("cpu"))
        attn = AttentionMetadata(
            num_actual_tokens=int(so.num_tokens),
            max_query_len=max_query_len,
            max_seq_len=int(seq_lens_np.max()),
            slot_mapping=upload("slot_mapping", so.slot_mapping),
            query_start_loc=qsl_cpu if dev.type == "cpu" else upload("query_start_loc", qsl_np),
            seq_lens=seq_lens_cpu if dev.type == "cpu" else upload("seq_lens", seq_lens_np),
            block_table=upload("block_table", so.block_table),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
            decode_only=max_query_len == 1,
        )
        input_ids_np = so.input_ids
        input_ids, positions = upload("input_ids", input_ids_np), upload("positions", so.positions)
        holes = np.flatnonzero(input_ids_np < 0)
        if holes.size:
            if prev is None:
                raise RuntimeError("input id -1 (a placeholder) in a step scheduled without one in flight")
            rows = np.searchsorted(qsl_np, holes, side="right") - 1
            src = np.fromiter((prev.row_of(req_ids[r]) for r in rows), dtype=np.int64, count=rows.size)
            input_ids.index_copy_(0, upload("placeholder_pos", holes),
                                  prev.sampled.token_ids.index_select(0, upload("placeholder_src", src)))
        if self.graph_runner is not None and self.graph_runner.can_run(attn):
            hidden = self.graph_runner.run(input_ids, positions, attn)  # valid until the next run
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, attn)
        logits_indices = upload("logits_indices", so.logits_indices)
        logits = self.model.compute_logits(hidden.index_select(0, logits_indices))
        if callable(grammar_bitmask):  # filled now, while the device runs the queued forward pass
            grammar_bitmask = grammar_bitmask()
        if grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, grammar_bitmask)

        sample_mask: list[bool] = so.sample_mask.tolist()
        out = ModelRunnerOutput(sampled_token_ids=np.zeros(len(req_ids), dtype=np.int64))
        sampled = self._sample(logits, states, sample_mask, out)
        if dev.type == "cpu":
            return StepHandle(req_ids, states, sample_mask, sampled, sampled.token_ids, None, out, hidden, so)
        host = self._host_buffer(len(req_ids))
        host.copy_(sampled.token_ids, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return StepHandle(req_ids, states, sample_mask, sampled, host, done, out, hidden, so)

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
        """Wait for a launched step and do its host-side part (token bookkeeping, logprobs)."""
        if handle.done is not None:
            handle.done.synchronize()
        out, states, sample_mask, sampled, so = handle.out, handle.states, handle.sample_mask, handle.sampled, handle.so
        token_ids = handle.host_token_ids.numpy().copy()
        out.sampled_token_ids = token_ids
        for i, state in enumerate(states):
            if sample_mask[i] and state.req_id not in out.errors:
                state.append_output(int(token_ids[i]))
        if sampled.logprobs is not None:
            self._collect_logprobs(sampled, states, sample_mask, out)
        if any(s.prompt_logprobs is not None and not s.prompt_logprobs.emitted for s in states):
            self._prompt_logprobs(handle.hidden, states, so, out)
        return out

    @staticmethod
    def _apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Only rows with some bit cleared are unpacked: unconstrained rows (all ones) cost nothing."""
        from ferrox.structured.bitmask import apply_bitmask_rows

        rows = torch.nonzero((bitmask != -1).any(dim=1)).flatten()
        if rows.numel():
            apply_bitmask_rows(logits, bitmask, None if rows.numel() == bitmask.shape[0] else rows)

    # ---- sampling -------------------------------------------------------------------------------------
    def _sample(
        self, logits: torch.Tensor, states: list[RequestState], sample_mask: list[bool], out: ModelRunnerOutput
    ) -> SamplerOutput:
        md = self.sampling_batch.build(states, sample_mask)
        try:
            # The sampler edits logits in place; if it fails half-way the per-row retry below sees
            # partly processed rows, an accepted cost on an error path that never runs normally.
            return self.sampler(logits, md)
        except Exception:
            logger.exception("batched sampling failed; retrying row by row to isolate the failing request")
        # One bad request (e.g. a NaN row, a broken logits processor) must not fail the others.
        self.sampling_batch.invalidate()
        token_ids = torch.zeros(len(states), dtype=torch.int64, device=logits.device)
        lp_parts: list[SamplerOutput | None] = []
        for i, state in enumerate(states):
            try:
                row_md = SamplingBatchBuilder(self.vocab_size, self.device).build([state], [sample_mask[i]])
                row = self.sampler(logits[i : i + 1].clone(), row_md)
                token_ids[i] = row.token_ids[0]
                lp_parts.append(row)
            except Exception as e:  # noqa: BLE001 - reported per request
                out.errors[state.req_id] = f"sampling failed: {type(e).__name__}: {e}"
                lp_parts.append(None)
        result = SamplerOutput(token_ids, None)
        if any(p is not None and p.logprobs is not None for p in lp_parts):
            result.logprobs = compute_logprobs(
                logits, token_ids, max(s.params.logprobs or 0 for s in states)
            )
        return result

    def _collect_logprobs(
        self, sampled: SamplerOutput, states: list[RequestState], sample_mask: list[bool], out: ModelRunnerOutput
    ) -> None:
        lp = sampled.logprobs
        assert lp is not None
        token_lp = lp.token_logprobs.tolist()
        ranks = lp.token_ranks.tolist()
        top_ids = lp.top_token_ids.tolist()
        top_lp = lp.top_logprobs.tolist()
        token_ids = sampled.token_ids.tolist()
        for i, state in enumerate(states):
            n = state.params.logprobs
            if n is None or not sample_mask[i] or state.req_id in out.errors:
                continue
            out.logprobs[state.req_id] = Logprobs(
                token_ids=[token_ids[i]],
                logprobs=[token_lp[i]],
                ranks=[ranks[i]],
                top_token_ids=[top_ids[i][:n]],
                top_logprobs=[top_lp[i][:n]],
            )

    # ---- prompt logprobs --------------------------------------------------------------------------------
    def _prompt_logprobs(
        self, hidden: torch.Tensor, states: list[RequestState], so: Any, out: ModelRunnerOutput
    ) -> None:
        """Logits of prompt position p score prompt token p + 1; only requests that asked pay."""
        qsl = so.query_start_loc.tolist()
        computed = so.num_computed_tokens.tolist()
        for i, state in enumerate(states):
            acc = state.prompt_logprobs
            if acc is None or acc.emitted:
                continue
            prompt = state.prompt_token_ids
            start_pos = computed[i]
            end_pos = min(start_pos + qsl[i + 1] - qsl[i], len(prompt) - 1)
            if end_pos > start_pos:
                rows = torch.arange(qsl[i], qsl[i] + end_pos - start_pos, device=hidden.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
                targets = torch.tensor(prompt[start_pos + 1 : end_pos + 1], dtype=torch.int64, device=hidden.device)
                lp = compute_logprobs(logits, targets, acc.num_top)
                chosen, ranks = lp.token_logprobs.tolist(), lp.token_ranks.tolist()
                top_ids, top_lp = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
                for j in range(end_pos - start_pos):
                    acc.token_logprobs[start_pos + 1 + j] = (chosen[j], ranks[j], top_ids[j], top_lp[j])
            if len(acc.token_logprobs) >= len(prompt) - 1:
                positions = range(1, len(prompt))
                entries = [acc.token_logprobs[p] for p in positions]
                out.prompt_logprobs[state.req_id] = Logprobs(
                    token_ids=[prompt[p] for p in positions],
                    logprobs=[e[0] for e in entries],
                    ranks=[e[1] for e in entries],
                    top_token_ids=[e[2] for e in entries],
                    top_logprobs=[e[3] for e in entries],
                )
                acc.emitted = True
                acc.token_logprobs.clear()
