"""The device memory sleep mode gives back and takes again (ferrox/sleep_mode.py has the rules).

On CUDA the KV cache is allocated inside a torch_memory_saver region (the library SGLang uses
for the same purpose), and the loaded weights are moved into one (`adopt`): torch's caching allocator gets that memory through
CUDA's virtual-memory API, so a pause unmaps the physical pages while the virtual addresses stay
reserved, and a resume maps fresh pages at the same addresses. Every pointer taken before the
sleep stays valid after it: the captured CUDA graphs, the tensors the layers hold, cuDNN plans.
The weights' region keeps a pinned host copy on pause (restored on resume); the KV cache's does
not, and is zeroed on wake-up (allocate_kv_caches' rule: padded lanes must not read NaN).

An engine's regions stay with the process after the engine is dropped (the library keeps one memory
pool per tag), so a process that builds engines one after another should not enable sleep mode on
each. What stays on the device while asleep: activations and workspaces allocated after loading, CUDA
graphs' memory pools, LoRA slots, a draft model.

On CPU there is no device memory: the weights already are in host memory (what level 1 asks),
and the KV cache tensors are pointed at an empty storage on sleep (the old one freed) and at a
new zeroed one on wake-up. vLLM has sleep
mode on CUDA only; ferrox's CPU path is what its CI runs the engine's sleep/wake logic on.
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
    """The regions one engine (one rank) allocates its weights and KV cache in, and their state."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._saver = _memory_saver() if self.cuda else None
        # torch_memory_saver's tags are process-wide: two engines in one process get their own.
        n = next(_instances)
        self._tag = {WEIGHTS: f"ferrox{n}-weights", KV_CACHE: f"ferrox{n}-kv"}
        self.kv_caches: list[torch.Tensor] = []
        self._kv_shapes: list[torch.Size] = []  # CPU: the caches' shapes while their storage is dropped
        self.asleep: set[str] = set()

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        """Tensors allocated inside are released by sleep(tag)."""
        assert tag in TAGS
        if self._saver is None:
            yield
            return
        with torch.cuda.device(self.device), self._saver.region(tag=self._tag[tag], enable_cpu_backup=tag == WEIGHTS):
            yield

    def adopt(self, model: torch.nn.Module) -> None:
        """Move the loaded model's tensors into the weights' region (worker/tensor_walk.py says why they are
        not loaded there directly)."""
        if self._saver is None:
            return  # CPU: the weights stay where they are (level 1 keeps them in host memory anyway)
        tensors = module_tensors(model, "cuda")
        before = torch.cuda.memory_allocated(self.device)
        with self.region(WEIGHTS):
            moved = move_storages(tensors)
        torch.cuda.empty_cache()  # what the load freed on the way goes back to the device
        # Storages some unreached holder still uses exist twice now (still valid, not released by a sleep).
        doubled = torch.cuda.memory_allocated(self.device) - before
        logger.info("sleep mode: %.2f GiB of weights in a releasable region", moved / 2**30)
        if doubled > 0.01 * max(moved, 1):
            logger.warning("sleep mode: %.2f GiB of the weights stay outside the releasable region (held by "
                           "tensors the model walk did not reach)", doubled / 2**30)

    def sleep(self, tags: Iterable[str]) -> int:
        """Release the tags' memory (those not asleep already); returns the bytes freed on the device."""
        todo = [t for t in TAGS if t in set(tags) and t not in self.asleep]
        if not todo:
            return 0
        if self._saver is None:
            if KV_CACHE in todo:
                # The same tensor objects (the runner and the layers hold them) on an empty storage.
                self._kv_shapes = [kv.shape for kv in self.kv_caches]
                for kv in self.kv_caches:
                    kv.set_(torch.empty(0, dtype=kv.dtype).untyped_storage(), 0, (0,), (1,))
            self.asleep.update(todo)
            return 0
        torch.cuda.synchronize(self.device)  # nothing may still read what is unmapped
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for tag in todo:
            self._saver.pause(self._tag[tag])
        self.asleep.update(todo)
        # Cached activation blocks outside the regions go back too: sleeping is for lending the GPU out.
        torch.cuda.empty_cache()
        freed = torch.cuda.mem_get_info(self.device)[0] - free_before
        logger.info("sleep: %s released, %.2f GiB of device memory freed", "+".join(todo), freed / 2**30)
        return freed

    def wake(self, tags: Iterable[str] | None = None) -> None:
        """Take the tags' memory again (default: every sleeping tag); the weights' content comes back,
        the KV cache's is zeros."""
        wanted = set(TAGS if tags is None else tags)
        todo = [t for t in TAGS if t in wanted and t in self.asleep]
        for tag in todo:
            if self._saver is not None:
                self._saver.resume(self._tag[tag])
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
