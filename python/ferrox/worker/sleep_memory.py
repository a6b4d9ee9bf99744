"""The device memory sleep mode gives back and takes again (ferrox/sleep_mode.py has the rules).

On CUDA the KV cache is allocated inside a torch_memory_saver region (the library SGLang uses
for the same purpose) and the loaded weights are moved into another (`adopt`): torch's caching
allocator gets that memory through CUDA's virtual-memory API, so a pause unmaps the physical
pages while the virtual addresses stay reserved, and a resume maps fresh pages at the same
addresses. Every pointer taken before the sleep stays valid after it: the captured CUDA graphs,
the tensors the layers hold, cuDNN plans. Level 1 copies the weights' storages to pinned host
memory before the pause and back after the resume; level 2 does not (the memory comes back as
garbage, for `reload_weights`). The KV cache is zeroed on wake-up (allocate_kv_caches' rule:
padded lanes must not read NaN).

An engine's regions stay with the process after the engine is dropped (the library keeps one memory
pool per tag), so a process that builds engines one after another should not enable sleep mode on
each. What stays on the device while asleep: activations and workspaces allocated after loading, CUDA
graphs' memory pools, LoRA slots, a draft model.

On CPU there is no device memory: at level 1 the weights stay where they are (host memory, which
is what level 1 asks); discarded weights (level 2) and the KV cache are tensors pointed at an empty
storage (the old one freed) until the wake-up gives the cache a new zeroed one and the reload the
weights theirs. vLLM has sleep mode on CUDA only; ferrox's CPU path is what its CI runs the
engine's sleep, wake and reload logic on.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ferrox.sleep_mode import KV_CACHE, TAGS, WEIGHTS
from ferrox.worker.tensor_walk import module_tensors, move_storages

logger = logging.getLogger(__name__)

_instances = itertools.count()


def _memory_saver() -> Any:
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError as exc:
        raise ValueError("enable_sleep_mode: on CUDA it needs the torch-memory-saver package (pip install "
                         "torch-memory-saver), which allocates the memory it releases") from exc
    if torch_memory_saver._impl is None:
        # In-process through torch's pluggable allocator (its other mode needs LD_PRELOAD at start-up).
        torch_memory_saver.hook_mode = "torch"
        atexit.register(_allow_frees_at_exit)
    return torch_memory_saver


def _allow_frees_at_exit() -> None:
    """The library's allocator ends the process (exit code 1) when torch frees its memory outside a
    region, which is what happens when the interpreter tears its pools down: an `LLM(enable_sleep_mode=
    True)` script that succeeded would exit with 1. Past this point every free is allowed."""
    from torch_memory_saver import torch_memory_saver

    impl = torch_memory_saver._impl
    if impl is not None:
        impl._binary_wrapper.cdll.tms_set_interesting_region(True)


class SleepMemory:
    """The regions one engine (one rank) keeps its weights and KV cache in, and their state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._saver = _memory_saver() if self.cuda else None
        # torch_memory_saver's tags are process-wide: two engines in one process get their own.
        n = next(_instances)
        self._tag = {WEIGHTS: f"ferrox{n}-weights", KV_CACHE: f"ferrox{n}-kv"}
        self.kv_caches: list[torch.Tensor] = []
        self._kv_shapes: list[torch.Size] = []  # CPU: the caches' shapes while their storage is dropped
        self.weights: list[torch.Tensor] = []  # every tensor of the model (adopt), in walk order
        self._shapes: list[tuple[torch.dtype, torch.Size]] = []  # theirs, kept while their storage is dropped
        self.reloadable = True  # the weights can be discarded and read again (not a CPU-quantized GGUF)
        self._weight_storages: list[torch.UntypedStorage] = []  # CUDA: the region's storages
        self._host_copies: list[torch.Tensor] = []  # level 1 on CUDA: the weights while asleep
        self.asleep: set[str] = set()
        self.weights_discarded = False  # level 2 (or the weights tag): garbage until reload

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Tensors allocated inside are released by sleep(tag)."""
        assert tag in TAGS
        if self._saver is None:
            yield
            return
        with torch.cuda.device(self.device), self._saver.region(tag=self._tag[tag], enable_cpu_backup=False):
            yield

    def adopt(self, model: torch.nn.Module) -> None:
        """Take the loaded model's tensors (on CUDA, move them into the weights' region; worker/tensor_walk.py
        says why they are not loaded there directly)."""
        self.weights = module_tensors(model, self.device.type)
        self._shapes = [(t.dtype, t.shape) for t in self.weights]
        # A quantized GGUF on CPU keeps its matrices in Rust objects (layers/quant): no tensor to discard or
        # reload them through, so its weights can only be kept (level 1).
        self.reloadable = not any(_rust_matrix(m) for m in model.modules())
        if self._saver is None:
            return  # CPU: the weights stay where they are
        before = torch.cuda.memory_allocated(self.device)
        with self.region(WEIGHTS):
            self._weight_storages = move_storages(self.weights)
        torch.cuda.empty_cache()  # what the load freed on the way goes back to the device
        moved = sum(st.nbytes() for st in self._weight_storages)
        # Storages some unreached holder still uses exist twice now (still valid, not released by a sleep).
        doubled = torch.cuda.memory_allocated(self.device) - before
        logger.info("sleep mode: %.2f GiB of weights in a releasable region", moved / 2**30)
        if doubled > 0.01 * max(moved, 1):
            logger.warning("sleep mode: %.2f GiB of the weights stay outside the releasable region (held by "
                           "tensors the model walk did not reach)", doubled / 2**30)

    def sleep(self, tags: Iterable[str], offload_weights: bool = True) -> int:
        """Release the tags' memory (those not asleep already); the weights keep a host copy when
        offload_weights, else they are discarded. Returns the bytes freed on the device."""
        todo = [t for t in TAGS if t in set(tags) and t not in self.asleep]
        if not todo:
            return 0
        if self._saver is None:
            if KV_CACHE in todo:
                # The same tensor objects (the runner and the layers hold them) on an empty storage.
                self._kv_shapes = [kv.shape for kv in self.kv_caches]
                for kv in self.kv_caches:
                    _drop_storage(kv)
            if WEIGHTS in todo and not offload_weights:
                for t in self.weights:
                    _drop_storage(t)
            self._asleep(todo, offload_weights)
            return 0
        torch.cuda.synchronize(self.device)  # nothing may still read what is unmapped
        free_before = torch.cuda.mem_get_info(self.device)[0]
        if WEIGHTS in todo and offload_weights:
            self._host_copies = [_pinned_copy(st) for st in self._weight_storages]
            torch.cuda.synchronize(self.device)
        for tag in todo:
            self._saver.pause(self._tag[tag])
        self._asleep(todo, offload_weights)
        # Cached activation blocks outside the regions go back too: sleeping is for lending the GPU out.
        torch.cuda.empty_cache()
        freed = torch.cuda.mem_get_info(self.device)[0] - free_before
        logger.info("sleep: %s released, %.2f GiB of device memory freed", "+".join(todo), freed / 2**30)
        return freed

    def _asleep(self, tags: list[str], offload_weights: bool) -> None:
        self.asleep.update(tags)
        if WEIGHTS in tags and not offload_weights:
            self.weights_discarded = True

    def wake(self, tags: Iterable[str] | None = None) -> None:
        """Take the tags' memory again (default: every sleeping tag); offloaded weights come back, discarded
        ones are garbage until `reload`, the KV cache is zeros."""
        wanted = set(TAGS if tags is None else tags)
        todo = [t for t in TAGS if t in wanted and t in self.asleep]
        for tag in todo:
            if self._saver is not None:
                self._saver.resume(self._tag[tag])
            if tag == WEIGHTS and self._host_copies:
                for storage, host in zip(self._weight_storages, self._host_copies, strict=True):
                    _bytes(storage).copy_(host, non_blocking=True)
                torch.cuda.synchronize(self.device)  # (the pinned copies are freed next)
                self._host_copies = []
            if tag == KV_CACHE:
                if self._saver is None:
                    for kv, shape in zip(self.kv_caches, self._kv_shapes, strict=True):
                        fresh = torch.zeros(shape, dtype=kv.dtype)
                        kv.set_(fresh.untyped_storage(), 0, fresh.shape, fresh.stride())
                else:
                    for kv in self.kv_caches:
                        (kv.view(torch.uint8) if kv.element_size() == 1 else kv).zero_()
            self.asleep.discard(tag)
        if todo and self.cuda:
            torch.cuda.synchronize(self.device)

    def reload(self, fresh: torch.nn.Module) -> None:
        """vLLM's reload_weights after a level-2 sleep: the weights of `fresh` (the same model loaded again,
        its tensors in the same walk order) into this model's, in place on CUDA (the addresses the CUDA graphs
        hold), by storage on CPU. Raises ValueError when the two models do not line up."""
        if WEIGHTS in self.asleep:
            raise ValueError("reload_weights: the weights are asleep; wake_up(tags=['weights']) first")
        new = module_tensors(fresh, self.device.type)
        if [(t.dtype, t.shape) for t in new] != self._shapes:
            raise ValueError("reload_weights: the model loaded again does not match the served one tensor for "
                             "tensor (was it changed after loading, e.g. by LoRA?)")
        with torch.no_grad():
            for live, src in zip(self.weights, new, strict=True):
                if self._saver is None and self.weights_discarded:
                    # CPU, storage dropped: take the fresh one (its views and ties come along).
                    live.set_(src.untyped_storage(), src.storage_offset(), src.size(), src.stride())
                else:
                    live.copy_(src)  # in place: the addresses the CUDA graphs and kernels hold
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.weights_discarded = False


def _rust_matrix(module: torch.nn.Module) -> bool:
    from ferrox import _core

    return isinstance(getattr(getattr(module, "quant", None), "matrix", None), _core.CpuQuantMatrix)


def _drop_storage(t: torch.Tensor) -> None:
    t.set_(torch.empty(0, dtype=t.dtype).untyped_storage(), 0, (0,), (1,))


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _pinned_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
    host.copy_(_bytes(storage), non_blocking=True)
    return host
