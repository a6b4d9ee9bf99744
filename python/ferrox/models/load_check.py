"""The end of every model's load_weights: each checkpoint tensor used, each parameter set."""

from __future__ import annotations

from collections.abc import Iterable

from ferrox.model_spec import ModelLoadError


def check_all_loaded(architecture: str, unexpected: list[str], expected: Iterable[str], loaded: set[str]) -> None:
    """ModelLoadError naming (up to 8 of) the checkpoint tensors the model has no place for, then the
    pieces it expected and never got (merged-layer shards written `name#shard`)."""
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} tensor(s) this {architecture} does not "
                             f"use: {', '.join(sorted(unexpected)[:8])}")
    missing = set(expected) - loaded
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): "
                             f"{', '.join(sorted(m.replace('#', ' shard ') for m in missing)[:8])}")
