"""freeze_startup_heap (ferrox/gc_tuning.py), run in a fresh interpreter so pytest's own collector
settings stay as they are: the start-up heap is frozen, the young generation raised, and a cycle made
afterwards is still collected (the collector is tuned, not switched off)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import gc, weakref
from ferrox.gc_tuning import YOUNG_GENERATION_THRESHOLD, freeze_startup_heap
startup = [[] for _ in range(1000)]
freeze_startup_heap()
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
assert gc.get_threshold()[0] == YOUNG_GENERATION_THRESHOLD, gc.get_threshold()
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
alive = weakref.ref(a)
del a, b
gc.collect()
assert alive() is None, "a cycle made after the freeze was not collected"
print("ok")
"""


def test_freeze_startup_heap_keeps_collecting_new_cycles() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
