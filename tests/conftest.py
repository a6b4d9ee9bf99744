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


def _faster_gguf_reference_loads() -> None:
    """transformers, the reference, reads the embedded model's GGUF through the gguf package too:
    give it the plain-array reader ferrox's loader uses (the same bytes of the same memory map,
    without np.memmap's per-slice Python hooks: ~5 -> 1.5 s a parse, twice per model load), and
    build gguf's tensor-name map once per architecture instead of once per module of the model
    (transformers asks for it ~400 times a load, ~7 s). Only the reference's loading gets faster."""
    try:
        import gguf
    except ImportError:
        return
    from functools import cache

    from ferrox.loader.gguf_file import _plain_array_reader

    gguf.GGUFReader = _plain_array_reader()  # transformers imports both from gguf when it loads
    gguf.get_tensor_name_map = cache(gguf.get_tensor_name_map)  # the map is only read


_faster_gguf_reference_loads()

# The files that keep one worker busiest on the 2-core box (1.5-3 minutes each), longest first. xdist's
# file-by-file scheduler hands out files with the most tests first, which put the longest single test
# (a child pytest running the kernel tests under the Triton interpreter) last and left one worker
# running it alone at the end; handed out first, these run beside the rest and the many short files
# fill in around them.
LONGEST_FIRST = [
    "tests/kernels/test_interpreter.py",
    "tests/server/test_chaos.py",
    "tests/engine/test_spec_decode.py",
    "tests/structured/test_llm_structured.py",
    "tests/engine/test_batch_invariance.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_async_scheduling.py",
]
FIRST = LONGEST_FIRST[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """xdist's file-by-file scheduler, handing out the LONGEST_FIRST files before any other."""
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            queue = getattr(self, "workqueue", None)
            if queue is not None:
                for name in reversed(LONGEST_FIRST):
                    if name in queue:
                        queue.move_to_end(name, last=False)
            super()._assign_work_unit(node)

    return LongestFirst(config, log) if config.getoption("dist") == "loadfile" else None
