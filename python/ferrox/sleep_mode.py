"""Sleep mode's arguments (vLLM's `sleep` / `wake_up` / `is_sleeping`), checked in one place.

An engine started with enable_sleep_mode can give back the device memory of its weights and
KV cache between bursts of work (an RL trainer sharing the GPU, a second model taking turns) and
take it again without reloading the model. The memory side is worker/sleep_memory.py; this
module holds only the rules, so the offline LLM, the async front-end and the engine core refuse
the same things with the same words (and the front-end without importing torch).

Levels, as vLLM's:
- 0: pause scheduling only; nothing is released.
- 1: the weights go to host memory (copied back on wake-up), the KV cache is discarded.
- 2: the weights are discarded too: after `wake_up(tags=["weights"])` their memory holds garbage
     until `collective_rpc("reload_weights")` reads the checkpoint into it again (vLLM's flow for a
     new model version; then `wake_up(tags=["kv_cache"])`). Sleeping the "weights" tag by name
     discards them the same way. Until the reload nothing is scheduled: requests wait.
Modes (what happens to requests in flight when sleep is called): "abort" them (the default),
"wait" for them to finish (requests arriving meanwhile wait for the wake-up), or "keep" them:
they stop where they are and, since the KV cache is discarded, recompute their tokens after
the wake-up (the scheduler's preemption by recompute).
"""

from __future__ import annotations

from collections.abc import Iterable

from ferrox.errors import InvalidArgumentError

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
TAGS = (WEIGHTS, KV_CACHE)
LEVELS = (0, 1, 2)
MODES = ("abort", "wait", "keep")

# vLLM's collective_rpc methods ferrox has (its workers' other methods do not exist here).
RPC_METHODS = ("reload_weights",)


def _check_enabled(enabled: bool) -> None:
    if not enabled:
        raise InvalidArgumentError("sleep mode is not enabled on this engine: start it with enable_sleep_mode=True "
                                   "(ferrox serve --enable-sleep-mode)", param="enable_sleep_mode")


def _tag_list(tags: Iterable[str] | str | None, what: str) -> tuple[str, ...] | None:
    if tags is None:
        return None
    if isinstance(tags, str):
        tags = [tags]
    out: list[str] = []
    for tag in tags:
        if tag not in TAGS:
            raise InvalidArgumentError(f"{what}: {tag!r} is not a memory tag (one of {', '.join(TAGS)})", param="tags")
        if tag not in out:
            out.append(tag)
    return tuple(out)


def sleep_plan(enabled: bool, level: int = 1, mode: str = "abort",
               tags: Iterable[str] | str | None = None) -> tuple[tuple[str, ...], bool]:
    """(the memory tags a sleep(level, mode, tags) call releases, whether the weights among them keep a
    host copy). Tags, when given, replace the level's preset and discard what they name, as vLLM's.
    Raises InvalidArgumentError naming the argument."""
    _check_enabled(enabled)
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise InvalidArgumentError(f"level: must be 0, 1 or 2, got {level!r}", param="level")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode: {mode!r} is not one of {', '.join(MODES)}", param="mode")
    chosen = _tag_list(tags, "tags")
    if chosen is not None:
        return chosen, False
    return ((), False) if level == 0 else (TAGS, level == 1)


def wake_tags(enabled: bool, tags: Iterable[str] | str | None = None) -> tuple[str, ...] | None:
    """The tags a wake_up(tags) call restores (None: every sleeping one, and scheduling resumes)."""
    _check_enabled(enabled)
    return _tag_list(tags, "tags")


def check_rpc(method: str) -> None:
    """vLLM's collective_rpc, for the methods ferrox has (RPC_METHODS)."""
    if method not in RPC_METHODS:
        raise InvalidArgumentError(f"method: {method!r} is not a worker method ferrox has (it has "
                                   f"{', '.join(RPC_METHODS)})", param="method")
