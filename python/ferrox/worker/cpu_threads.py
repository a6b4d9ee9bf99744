"""How many intra-op threads the CPU engine uses, adjusted to what else the machine runs.

Measured on the 2-core box: while other processes were busy, a 2-thread OpenMP region often waited
milliseconds for a descheduled peer and a decode step ran up to 7-10x slower than with 1 thread;
on an idle box 2 threads give ~1.4x the batch throughput of 1. So with `num_threads=None` the engine
takes all cores when the rest of the machine is idle and 1 thread when it is not, re-checked every
few seconds from the load average (minus the engine's own threads). An explicit `num_threads` is
never changed.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ferrox import _core

logger = logging.getLogger(__name__)

# Load from other processes above which the engine drops to 1 thread, and below which it returns to
# all cores; the gap and the minimum time between switches keep it from flapping (the load average
# is a 1-minute mean, so it trails a switch by tens of seconds).
_BUSY_ABOVE = 0.9
_IDLE_BELOW = 0.4
_CHECK_EVERY_S = 2.0
_MIN_SWITCH_INTERVAL_S = 45.0


def available_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # the cores this process may run on, not the host's
    return os.cpu_count() or 1


def other_load(own_threads: int) -> float:
    """Runnable threads of other processes, estimated from the 1-minute load average."""
    return max(0.0, os.getloadavg()[0] - own_threads)


def set_threads(threads: int) -> None:
    """torch's intra-op threads and the Rust CPU kernels' (rust/cpu/pool.rs), kept equal."""
    torch.set_num_threads(threads)
    _core.cpu_set_num_threads(threads)


class CpuThreadGovernor:
    def __init__(self, num_threads: int | None) -> None:
        self.fixed = num_threads is not None
        self.max_threads = num_threads or available_cores()
        self._next_check = 0.0
        self._last_switch = time.monotonic()
        if self.fixed or self.max_threads == 1:
            threads = self.max_threads
        else:
            # At start-up the engine itself is not running yet: the whole load is somebody else's.
            threads = 1 if other_load(0) >= self.max_threads * _BUSY_ABOVE else self.max_threads
        set_threads(threads)
        if threads < self.max_threads:
            logger.info("machine busy (load %.1f): using %d CPU thread(s)", os.getloadavg()[0], threads)

    def maybe_adjust(self) -> None:
        """Called once per engine step; costs a clock read except every few seconds."""
        if self.fixed or self.max_threads == 1:
            return
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + _CHECK_EVERY_S
        if now - self._last_switch < _MIN_SWITCH_INTERVAL_S:
            return
        current = torch.get_num_threads()
        others = other_load(current)
        target = current
        if current > 1 and others >= _BUSY_ABOVE:
            target = 1
        elif current == 1 and others < _IDLE_BELOW:
            target = self.max_threads
        if target != current:
            set_threads(target)
            self._last_switch = now
            logger.info("CPU threads %d -> %d (load from other processes ~%.1f)", current, target, others)
