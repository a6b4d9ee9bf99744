"""Suite-wide settings.

`make test` runs the suite on two pytest-xdist workers (the 2-core CI box idles one core through
most engine and server tests: the embedded model's steps are Python-bound, servers start and wait).
Each worker's own torch ops (references, tensor checks) then take one thread: two 2-thread OpenMP
regions on two cores wait on descheduled peers, which worker/cpu_threads.py measured at 7-10x slower
steps. Engines pick their threads from the machine's load themselves (the same module).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# The longest single test (a child pytest running the kernel tests under the Triton interpreter,
# ~3.5 minutes): first, so that it runs beside the rest on one worker instead of after them.
FIRST = "tests/kernels/test_interpreter.py"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's file-by-file scheduler hands out files with the most tests first, which put FIRST's
    one test last: this one takes FIRST's file before any other, then defers to it."""
    from xdist.scheduler import LoadFileScheduling

    class FirstFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            queue = getattr(self, "workqueue", None)
            if queue is not None and FIRST in queue:
                queue.move_to_end(FIRST, last=False)
            super()._assign_work_unit(node)

    return FirstFileFirst(config, log) if config.getoption("dist") == "loadfile" else None
