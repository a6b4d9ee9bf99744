"""The cyclic garbage collector in the processes ferrox owns (API server, engine core, TP workers).

Both long-lived processes allocate a few container objects per request per step (outputs, SSE
chunks, per-step arrays) and almost none of them form cycles, so the collector's work is nearly all
overhead. Measured on the API server streaming 512 requests (tiny Llama on the 2-core box): 3.0 s of
~25 s were collections, with full collections of ~70k start-up objects (modules, the tokenizer,
pydantic schemas) at 120 ms each, each a pause in every stream.

Two changes, made once start-up is done: freeze the start-up heap (those objects are never
traversed again; they are never garbage either), and let the youngest generation grow to 20,000
objects before a collection (each collection costs about the same whether it holds 700 objects or
20,000, so 28x fewer collections). Garbage cycles still get collected, only later.

The offline `LLM` leaves the collector alone: its process is the user's, not ours."""

from __future__ import annotations

import gc

YOUNG_GENERATION_THRESHOLD = 20_000


def freeze_startup_heap() -> None:
    """Call once, after start-up and before serving."""
    gc.collect()
    gc.freeze()
    young, middle, old = gc.get_threshold()
    gc.set_threshold(max(young, YOUNG_GENERATION_THRESHOLD), middle, old)
