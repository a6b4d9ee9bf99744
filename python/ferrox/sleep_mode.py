"""Sleep mode's arguments (vLLM's `sleep` / `wake_up` / `is_sleeping`), checked in one place.

An engine started with enable_sleep_mode can give back the device memory of its weights and
KV cache between bursts of work (an RL trainer sharing the GPU, a second model taking turns) and
take it again without reloading the model. The memory side is worker/sleep_memory.py; this
module holds only the rules, so the offline LLM, the async front-end and the engine core refuse
the same things with the same words (and the front-end without importing torch).

Levels, as vLLM's:
- 0: pause scheduling only; nothing is released.
- 1: the weights go to host memory (copied back on wake-up), the KV cache is discarded.
- 2: the weights are discarded too, for a reload or an in-place update. ferrox has neither
     (vLLM's collective_rpc("reload_weights") or a weight-transfer API), so after a wake-up
     nothing could put weights back: level 2, and sleeping the "weights" tag by name (which
     discards them the same way), are refused rather than left to produce garbage.
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

_LEVEL_TAGS = {0: (), 1: TAGS}


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


def sleep_tags(enabled: bool, level: int = 1, mode: str = "abort",
               tags: Iterable[str] | str | None = None) -> tuple[str, ...]:
    """The memory tags a sleep(level, mode, tags) call releases (tags, when given, replace the level's
    preset, as vLLM's). Raises InvalidArgumentError naming the argument."""
    _check_enabled(enabled)
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise InvalidArgumentError(f"level: must be 0, 1 or 2, got {level!r}", param="level")
    if mode not in MODES:
        raise InvalidArgumentError(f"mode: {mode!r} is not one of {', '.join(MODES)}", param="mode")
    chosen = _tag_list(tags, "tags")
    if chosen is None:
        if level == 2:
            raise InvalidArgumentError(
                "level: 2 discards the weights for a reload or an update, and ferrox has neither (no "
                "collective_rpc('reload_weights'), no weight transfer); use level 1, which keeps a host copy of "
                "the weights and restores it on wake_up", param="level")
        return _LEVEL_TAGS[level]
    if WEIGHTS in chosen:
        raise InvalidArgumentError(
            "tags: sleeping 'weights' by tag discards them (vLLM's meaning) and ferrox cannot reload them; use "
            "level=1 (weights kept in host memory) or tags=['kv_cache']", param="tags")
    return chosen


def wake_tags(enabled: bool, tags: Iterable[str] | str | None = None) -> tuple[str, ...] | None:
    """The tags a wake_up(tags) call restores (None: every sleeping one, and scheduling resumes)."""
    _check_enabled(enabled)
    return _tag_list(tags, "tags")
