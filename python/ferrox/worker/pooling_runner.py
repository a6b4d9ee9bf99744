"""The model runner of a pooling model: a step of whole prompts in, one vector per request out.

It has the step methods the engine core calls on ModelRunner (launch / prepare_sampling / sample /
finish, execute, add_request / remove_requests / append_accepted, capture_cuda_graphs, shutdown), so a
pooling request goes through the same loop and the same Rust scheduler as a generation request:

    launch    the forward pass over the step's prompts, then pooling (mean / CLS / last) on the device;
              a sequence classifier's head instead (its logits: model.classify)
    sample    queue the vectors' copy to the host (there is nothing to sample)
    finish    wait; each request's vector as it asked (Matryoshka truncation, normalisation; a classifier's
              logits through its activation: pooling/classify.py), and the
              placeholder token 0 for every request, which ends it in the scheduler ("length": a
              pooling request is added with max_tokens=1, never detokenized)

Every prompt is whole in its step: the scheduler runs with chunked prefill off and no prefix caching
(pooling needs every token's hidden state, and an encoder attends both ways, so a prompt split across
steps could not be finished from the first part's cache). So no KV cache exists: the scheduler counts
virtual blocks (`virtual_num_blocks`), and a decoder used as an embedder gets empty per-layer caches
(its attention backend then attends within each request's own rows). Steps run synchronously (the
engine core turns async scheduling off): a pooling step has no sampled token for a next step to read,
so overlapping steps would save nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ferrox.errors import InvalidArgumentError
from ferrox.pooling.classify import apply_activation
from ferrox.pooling.params import PoolerConfig, PoolingParams
from ferrox.pooling.pooler import finish_vector, pool
from ferrox.sampling_params import SamplingParams
from ferrox.worker.model_runner import ModelRunnerOutput, StepHandle
from ferrox.worker.step_inputs import Uploader, attention_metadata


def virtual_num_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks the scheduler may hand out without any cache behind them: enough for max_num_seqs requests
    of max_model_len prompt tokens plus the placeholder token each ends with, so a pooling step is never
    short of blocks (no preemption); + the null block."""
    return max_num_seqs * -(-(max_model_len + 1) // block_size) + 1


def empty_kv_caches(num_layers: int, dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """One empty tensor per layer: "no KV cache" to the attention backends (attention/backend.py)."""
    return [torch.empty(0, dtype=dtype, device=device) for _ in range(num_layers)]


@dataclass(slots=True)
class _PoolingRequest:
    req_id: str
    dimensions: int | None
    normalize: bool
    activation: str | None = None  # a classifier's (its logits -> scores); None: an embedding
    second_text_start: int | None = None  # a cross-encoder pair's: token type 1 from here on


@dataclass(slots=True)
class PoolingStep(StepHandle):
    """A launched pooling step: its vectors are being computed (or copied) on the device."""

    req_ids: list[str] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # float32 [num_reqs, hidden_size] on the device
    host_pooled: torch.Tensor | None = None  # its host copy, complete once `done` (GPU) has passed


class PoolingRunner:
    def __init__(self, model: Any, kv_caches: list[torch.Tensor], *, pooler_config: PoolerConfig,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.pooler_config = pooler_config
        self.device = device
        self._upload = Uploader(device)
        self._requests: dict[int, _PoolingRequest] = {}  # core request slot -> what it asked for
        self.graph_runner: Any = None  # no CUDA graphs: steps are whole prompts of any shape
        # A model that folded a constant into its final norm (Granite's logits_scaling) returns hidden
        # states that much smaller than the checkpoint's: pooled vectors are scaled back.
        self._hidden_scale = float(getattr(model, "hidden_states_scale", 1.0))
        self._classifier = pooler_config.task == "classify"
        # BERT's pair prompts need their token types; RoBERTa's one-row table makes them all alike.
        self._token_types = bool(getattr(model, "uses_token_types", False))

    def capture_cuda_graphs(self, *, max_num_seqs: int, max_model_len: int, block_size: int,
                            verify_len: int = 0, max_num_batched_tokens: int = 0, plan: Any = None) -> float | None:
        return None

    def decode_graph_sizes(self) -> list[int]:
        return []

    def piecewise_graph_sizes(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        """Nothing to release: a pooling model runs on one rank."""

    @torch.inference_mode()
    def warm_up(self, *, num_blocks: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                vocab_size: int) -> float:
        """Two prompts of different lengths through one whole step before the server says ready, so the
        first request pays neither the device's lazy start (libraries, kernel modules: 364 ms for a tiny
        BERT's first request on an H200) nor a Triton compile of a decoder embedder's attention. The
        step comes from a scheduler of its own (the engine's sees nothing) and its requests leave this
        runner after it; a pooling step keeps no state on the device. Returns the seconds it took."""
        from ferrox import _core

        start = time.perf_counter()
        longest = max(1, min(max_model_len, max_num_batched_tokens // 2))
        lengths = sorted({min(3, longest), min(17, longest)})
        sched = _core.Scheduler(num_blocks=num_blocks, max_model_len=max_model_len + 1, block_size=block_size,
                                max_num_seqs=len(lengths), max_num_batched_tokens=max_num_batched_tokens,
                                enable_prefix_caching=False, enable_chunked_prefill=False)
        slots = []
        for i, n in enumerate(lengths):
            prompt = np.arange(1, n + 1, dtype=np.int64) % vocab_size
            slot = sched.add_request(f"warm-up-{i}", prompt, max_tokens=1, ignore_eos=True, detokenize=False)
            self.add_request(slot, f"warm-up-{i}", prompt.tolist(), SamplingParams(max_tokens=1),
                             pooling_params=PoolingParams())
            slots.append(slot)
        try:
            self.execute(sched.schedule())
        finally:
            self.remove_requests(slots)
        return time.perf_counter() - start

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, slot: int, req_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    pooling_params: PoolingParams | None = None, lora_id: int = 0) -> None:
        if pooling_params is None:
            raise InvalidArgumentError(f"request {req_id!r}: this model runs with runner 'pooling' (it embeds); a "
                                       "generation request cannot run on it", param="runner")
        self._requests[slot] = _PoolingRequest(req_id, pooling_params.dimensions,
                                               self.pooler_config.resolve_normalize(pooling_params),
                                               self.pooler_config.activation_of(pooling_params),
                                               pooling_params.second_text_start)

    def remove_requests(self, slots: list[int] | npt.NDArray[np.int32]) -> None:
        for slot in np.asarray(slots).tolist():
            self._requests.pop(int(slot), None)

    def append_accepted(self, slots: Any, token_ids: Any, token_offsets: Any) -> None:
        """The placeholder tokens the core appended: nothing reads them."""

    # ---- one step ------------------------------------------------------------------------------------
    def execute(self, so: Any, grammar_bitmask: torch.Tensor | None = None) -> ModelRunnerOutput:
        handle = self.launch(so)
        self.sample(handle)
        return self.finish(handle)

    @torch.inference_mode()
    def launch(self, so: Any, prev: StepHandle | None = None) -> PoolingStep:
        if prev is not None:
            raise RuntimeError("a pooling step was scheduled with a step in flight (pooling runs synchronous steps)")
        computed = np.asarray(so.num_computed_tokens)
        sample_mask = np.asarray(so.sample_mask, dtype=np.bool_)
        if computed.any() or not sample_mask.all():
            raise RuntimeError("a pooling step holds part of a prompt: pooling needs every prompt whole in its step "
                               "(the scheduler must run with chunked prefill and prefix caching off)")
        self._upload.next_step()
        meta = attention_metadata(so, self._upload)
        input_ids = self._upload("input_ids", so.input_ids)
        positions = self._upload("positions", so.positions)
        slots = np.asarray(so.req_slots, dtype=np.int32)
        types = self._step_token_types(slots, meta, len(so.input_ids))
        if types is not None:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta,
                                        token_type_ids=self._upload("token_type_ids", types))
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_caches, meta)
        if self._classifier:
            pooled = self.model.classify(hidden[: meta.num_actual_tokens], meta.query_start_loc)
        else:
            pooled = pool(hidden[: meta.num_actual_tokens], meta.query_start_loc, self.pooler_config.pooling_type)
        if self._hidden_scale != 1.0:
            pooled = pooled * self._hidden_scale
        return PoolingStep(so, slots, torch.from_numpy(slots), np.zeros(slots.size, dtype=np.int64), sample_mask,
                           torch.empty(0), [], req_ids=list(so.req_ids), pooled=pooled)

    def _step_token_types(self, slots: npt.NDArray[np.int32], meta: Any,
                          num_tokens: int) -> npt.NDArray[np.int64] | None:
        """The step's token_type_ids (0 up to each pair's second text, 1 from it on), or None when the model
        takes none or no request of the step is a pair. A request carries one index (its PoolingParams'
        second_text_start) rather than an array: the tokenizer's pair types are a run of 0s then a run of 1s
        (loader/tokenizer.py), so the Rust scheduler and the step arrays stay as they are for every model.
        The index comes from the tokenizer, not from the first [SEP] in the ids: a first text may itself
        hold the [SEP] token, which transformers still types 0."""
        if not self._token_types:
            return None
        starts = meta.query_start_loc_cpu.tolist()
        types: npt.NDArray[np.int64] | None = None
        for row, slot in enumerate(slots.tolist()):
            start = self._requests[slot].second_text_start
            if start is not None:
                if types is None:
                    types = np.zeros(num_tokens, dtype=np.int64)
                types[starts[row] + start: starts[row + 1]] = 1
        return types

    def prepare_sampling(self, handle: StepHandle, in_flight: Any = None) -> None:
        """Nothing to prepare: a pooling step samples nothing."""

    def sample(self, handle: StepHandle, grammar_bitmask: torch.Tensor | None = None) -> None:
        """Queue the vectors' copy to the host; on the GPU it lands in pinned memory without a wait."""
        assert isinstance(handle, PoolingStep) and handle.pooled is not None
        if handle.pooled.device.type == "cpu":
            handle.host_pooled = handle.pooled
            return
        host = torch.empty(handle.pooled.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(handle.pooled, non_blocking=True)
        handle.host_pooled = host
        handle.done = torch.cuda.Event()
        handle.done.record()

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for the copy; each request's vector, and the placeholder token that ends it."""
        assert isinstance(handle, PoolingStep) and handle.host_pooled is not None, "sample() not called"
        if handle.done is not None:
            handle.done.synchronize()
        vectors = handle.host_pooled.numpy()
        pooled: dict[str, npt.NDArray[np.float32]] = {}
        for row, slot in enumerate(handle.slots.tolist()):
            request = self._requests[slot]
            if request.activation is not None:
                pooled[request.req_id] = apply_activation(vectors[row], request.activation)
            else:
                pooled[request.req_id] = finish_vector(vectors[row], dimensions=request.dimensions,
                                                       normalize=request.normalize)
        return ModelRunnerOutput(np.zeros(handle.slots.size, dtype=np.int64), pooled=pooled)
