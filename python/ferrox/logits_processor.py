"""Custom logits processors (vLLM's `--logits-processors`, its V1 interface): classes a user writes and
names at start-up, which see every step's logits before the sampler draws.

A processor works on the whole batch: `apply(logits)` gets float32 [batch_size, vocab] logits, one row
per request of the step (rows in the step's order), and returns them changed (in place or a new tensor).
Which request holds which row changes from step to step; `update_state(batch_update)` tells the processor
before each step (None when nothing changed), in vLLM's terms:

    removed: rows whose request left the batch (finished, aborted, or not scheduled this step)
    added:   (row, SamplingParams, prompt token ids (None for prompt embeddings), output token ids)
             -- the output list is the request's own, kept current: the processor can hold on to it
    moved:   (a, b, MoveDirectionality.SWAP): rows a and b exchange their requests;
             (a, b, MoveDirectionality.UNIDIRECTIONAL): a's request goes to row b (b's is dropped)

applied in that order (removed, added, moved). A request opts in through `SamplingParams.extra_args`
(`vllm_xargs` over HTTP); `validate_params` (a classmethod) refuses bad ones before the request is
queued (a 400). `is_argmax_invariant()` says whether the processor can change a greedy request's token.

Porting a vLLM processor: import these names from `ferrox.logits_processor` instead of
`vllm.v1.sample.logits_processor`; the constructor gets ferrox's EngineConfig in place of VllmConfig
(`config.max_num_seqs`, `config.max_model_len`...), the device and whether host memory is pinned.

`AdapterLogitsProcessor` wraps per-request callables (the older `fn(output_ids, logits_row)` or
`fn(prompt_ids, output_ids, logits_row)` style) as a batch processor.

Processors run in the engine core on the driver rank, in steps scheduled one at a time (no async
scheduling) and without speculative decoding, as in vLLM.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:  # (no torch at run time: the API server process loads this module to validate requests)
    import torch

    from ferrox.sampling_params import SamplingParams

__all__ = [
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "RequestLogitsProcessor",
    "load_logits_processors",
]


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # a -> b (b's request is dropped)
    SWAP = enum.auto()  # a <-> b


RemovedRequest = int
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last step; apply removed, then added, then moved."""

    batch_size: int  # rows this step
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @classmethod  # noqa: B027 - an optional hook, not abstract
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ValueError for a request this processor cannot take (its extra_args, usually)."""

    @abstractmethod
    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None: ...

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits [batch_size, vocab] (float32) -> the processed logits."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes which token has the largest logit."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step's apply; None when the batch did not change."""


if TYPE_CHECKING:
    RequestLogitsProcessor = Union[  # noqa: UP007
        Callable[[list[int], "torch.Tensor"], "torch.Tensor"],
        Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"],
    ]
else:
    RequestLogitsProcessor = Callable[..., Any]  # (output_ids, row) or (prompt_ids, output_ids, row) -> row


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch processor made of per-request callables: subclass it, implement `is_argmax_invariant` and
    `new_req_logits_processor(params)` (a callable for that request, or None to leave its row alone).
    The callable gets (output_ids, logits_row) or (prompt_ids, output_ids, logits_row) and returns the row."""

    def __init__(self, config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._by_row: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None: ...

    def _bind(self, params: SamplingParams, prompt_ids: list[int] | None,
              output_ids: list[int]) -> Callable[[torch.Tensor], torch.Tensor] | None:
        fn = self.new_req_logits_processor(params)
        if fn is None:
            return None
        arity = len(inspect.signature(fn).parameters)
        call: Any = fn  # (one of two signatures, told apart by its arity)
        if arity == 3:
            prompt = prompt_ids if prompt_ids is not None else []
            return lambda row: call(prompt, output_ids, row)
        if arity == 2:
            return lambda row: call(output_ids, row)
        raise ValueError(f"{type(self).__name__}.new_req_logits_processor: the callable takes {arity} arguments; "
                         "it must take (output_ids, logits_row) or (prompt_ids, output_ids, logits_row)")

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self._by_row
        for row in batch_update.removed:
            rows.pop(row, None)
        for row, params, prompt_ids, output_ids in batch_update.added:
            bound = self._bind(params, prompt_ids, output_ids)
            if bound is None:
                rows.pop(row, None)
            else:
                rows[row] = bound
        for a, b, direction in batch_update.moved:
            fa, fb = rows.pop(a, None), rows.pop(b, None)
            if fa is not None:
                rows[b] = fa
            if direction is MoveDirectionality.SWAP and fb is not None:
                rows[a] = fb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, fn in self._by_row.items():
            logits[row] = fn(logits[row])
        return logits


# ---- loading --------------------------------------------------------------------------------------------------
def _import_class(spec: str) -> type:
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"logits_processors: {spec!r} is not a class path ('package.module:Class' or "
                         "'package.module.Class')")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"logits_processors: {spec!r}: importing {module_name!r} failed: {type(exc).__name__}: "
                         f"{exc}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"logits_processors: {spec!r}: {module_name!r} has no {attr!r}")
    return obj  # type: ignore[no-any-return]


def load_logits_processors(specs: Sequence[str | type] | None) -> tuple[type[LogitsProcessor], ...]:
    """The classes `specs` name (class paths or the classes themselves), each a subclass of this module's
    LogitsProcessor; anything else is refused naming logits_processors."""
    classes = []
    for spec in specs or ():
        cls = _import_class(spec) if isinstance(spec, str) else spec
        if not (inspect.isclass(cls) and issubclass(cls, LogitsProcessor)):
            raise ValueError(f"logits_processors: {spec!r} is not a subclass of ferrox.logits_processor."
                             "LogitsProcessor (a vLLM processor imports these names from ferrox.logits_processor "
                             "instead of vllm.v1.sample.logits_processor)")
        if inspect.isabstract(cls):
            raise ValueError(f"logits_processors: {cls.__name__} leaves abstract methods unimplemented: "
                             f"{', '.join(sorted(cls.__abstractmethods__))}")
        classes.append(cls)
    return tuple(classes)
