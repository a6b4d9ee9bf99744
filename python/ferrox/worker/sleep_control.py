"""Sleep mode across the tensor-parallel ranks: the driver's memory (worker/sleep_memory.py) and the
other ranks' (through the step channel: executor/worker_main.py runs the same calls), the
weights' reload, and whether the engine may schedule.

The engine core decides what happens to requests (engine/engine_core.py `sleep`); this holds
what is released, and answers two questions: `is_sleeping` (vLLM's: a sleep not yet fully woken
from) and `paused` (no step may run: asleep, or weights discarded and not yet reloaded).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ferrox.sleep_mode import TAGS, WEIGHTS
from ferrox.worker.sleep_memory import SleepMemory

logger = logging.getLogger(__name__)


def tag_array(tags: list[str], offload_weights: bool = True) -> dict[str, np.ndarray]:
    """A SLEEP / WAKE message's arrays (distributed/step_channel.py)."""
    return {"tags": np.array([TAGS.index(t) for t in tags], dtype=np.int64),
            "offload": np.array([int(offload_weights)], dtype=np.int64)}


def tags_of(arrays: dict[str, np.ndarray]) -> tuple[list[str], bool]:
    offload = arrays.get("offload")
    return [TAGS[i] for i in arrays["tags"].tolist()], bool(offload[0]) if offload is not None else True


class SleepControl:
    def __init__(self, memory: SleepMemory, reload_model: Callable[[], Any], channel: Any = None,
                 tp: Any = None) -> None:
        self.memory = memory
        self.reload_model = reload_model  # the same model loaded again (model_setup.load_everything)
        self.channel = channel  # the step channel to the other ranks (None: one rank)
        self.tp = tp
        self.sleeping = False

    @property
    def paused(self) -> bool:
        return self.sleeping or self.memory.weights_discarded

    def sleep(self, tags: list[str], offload_weights: bool) -> None:
        self.sleeping = True
        todo = [t for t in tags if t not in self.memory.asleep]
        if not todo:
            return
        if self.channel is not None:
            import torch.distributed as dist

            from ferrox.distributed.step_channel import SLEEP

            self.channel.send(SLEEP, tag_array(todo, offload_weights))
            dist.barrier(group=self.tp.cpu_group)  # every rank has freed its memory when this returns
        self.memory.sleep(todo, offload_weights)

    def wake(self, tags: tuple[str, ...] | None) -> list[str]:
        """Wakes the tags that sleep (all by default); returns them."""
        todo = [t for t in (TAGS if tags is None else tags) if t in self.memory.asleep]
        if todo:
            if self.channel is not None:
                from ferrox.distributed.step_channel import WAKE

                self.channel.send(WAKE, tag_array(todo))
            self.memory.wake(todo)
        self.sleeping = bool(self.memory.asleep)
        return todo

    def reload_weights(self) -> None:
        """vLLM's collective_rpc("reload_weights"): the checkpoint read again into the served weights on
        every rank (in place on CUDA), after a sleep discarded them or to pick up new files."""
        if WEIGHTS in self.memory.asleep:
            raise ValueError("reload_weights: the weights are asleep; wake_up(tags=['weights']) first")
        if self.channel is not None:
            import torch.distributed as dist

            from ferrox.distributed.step_channel import RELOAD

            self.channel.send(RELOAD)
            dist.barrier(group=self.tp.cpu_group)  # the other ranks have theirs when this returns
        reload_into(self.memory, self.reload_model)
        logger.info("reload_weights: the weights are read again from the checkpoint")


def reload_into(memory: SleepMemory, reload_model: Callable[[], Any]) -> None:
    """Load the model again beside the served one (outside the regions), copy it in, drop it."""
    fresh = reload_model()
    memory.reload(fresh)
    del fresh
    if memory.cuda:
        import torch

        torch.cuda.empty_cache()
