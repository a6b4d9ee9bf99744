"""Sizes for kernel tests under Triton's interpreter (tests/kernels/test_interpreter.py's child on CPU).

The interpreter runs a launch's programs one after another in Python, each tl op costing ~0.1-1 ms: a
test's time is about its programs times their ops. Where a smaller case runs the same kernels and
branches, the interpreted run takes it, and a GPU keeps the full one:

    prompt = interpreted_or(long_prompt, short_prompt)
    @pytest.mark.parametrize("case", [native_only(duplicate_case), other_case])
"""

from __future__ import annotations

import os
from typing import TypeVar

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

T = TypeVar("T")


def interpreted_or(native: T, interpreted: T) -> T:
    """`interpreted` in the interpreter child, else `native`."""
    return interpreted if INTERPRETED else native


def native_only(*values, reason: str = "the interpreted run covers this case's kernels and branches in another"):
    """A parametrize case that runs on a GPU and is skipped in the interpreter child."""
    return pytest.param(*values, marks=pytest.mark.skipif(INTERPRETED, reason=reason))


def prefill_kernel_from(monkeypatch: pytest.MonkeyPatch, tokens: int) -> list[int]:
    """The Triton backend takes its prefill kernel for chunks of `tokens` or more (PREFILL_MIN_QUERY_LEN,
    128 in production) and counts the kernel's launches in the list returned. A model test's prompt then
    reaches that kernel without 128 tokens through every per-token kernel of its layers; the threshold
    itself keeps its own tests (test_kv_fp8.py, test_prefill_attention.py, test_triton_backend.py)."""
    from ferrox.attention import triton_backend

    launches: list[int] = []
    prefill = triton_backend.prefill_attention

    def counted(*args, **kwargs):
        launches.append(1)
        return prefill(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "PREFILL_MIN_QUERY_LEN", tokens)
    monkeypatch.setattr(triton_backend, "prefill_attention", counted)
    return launches


def wide_row_tiles(monkeypatch: pytest.MonkeyPatch, rows: int = 16) -> None:
    """The one-token matrix-vector kernels (kernels/gemv.py, and fused_moe.py's small-batch experts) take
    `rows` output rows a program instead of the H200's few: the same kernels in ~rows/2 times fewer
    programs. The production configs keep their own interpreted tests (test_gemv.py, test_fused_moe.py)."""
    from ferrox.kernels import fused_moe, gemv

    choose, choose_moe = gemv.choose_config, fused_moe.choose_gemv_config

    def wide(kind: str, k: int, weight_bytes: int = 2, w8a8: bool = False) -> gemv.GemvConfig:
        cfg = choose(kind, k, weight_bytes, w8a8)
        return cfg if kind == "rope" else gemv.GemvConfig(rows, cfg.block_k, cfg.num_warps)

    def wide_moe(hidden: int, inter: int, top_k: int, **kw) -> fused_moe.GemvConfig:
        cfg = choose_moe(hidden, inter, top_k, **kw)
        return fused_moe.GemvConfig(rows, cfg.gate_up_block_k, rows, cfg.down_block_k, cfg.num_warps)

    monkeypatch.setattr(gemv, "choose_config", wide)
    monkeypatch.setattr(fused_moe, "choose_gemv_config", wide_moe)
