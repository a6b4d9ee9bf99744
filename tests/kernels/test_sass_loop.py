"""benches/sass_loop.py compiles the one-token kernels for sm_90 on the CPU and finds their K loops:
kept working as the kernels' signatures change."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels, not interpreted ones")
def test_every_case_compiles_and_has_a_k_loop():
    import sass_loop

    loops = {case.name: (case, sass_loop.compile_loop(case)) for case in sass_loop.cases()}
    for name, (case, loop) in loops.items():
        assert sum(loop.opcodes.values()) > 10, name
        assert any(op.startswith("LDG") for op in loop.opcodes), f"{name}: the loop found loads no weights"
        assert loop.registers > 0 and 1 <= loop.resident_programs(case.num_warps) <= sass_loop.SM_PROGRAMS, name
    counts = {name: loop.opcodes for name, (_, loop) in loops.items()}
    # The int4 loop unpacks nibbles (LOP3) and multiplies in fp32; the fp8 one widens through fp16.
    by_kind = {kind: next(ops for name, ops in counts.items() if name.startswith(kind))
               for kind in ("int4 gemv + residual", "fp8 gemv (weight-only) + residual")}
    assert by_kind["int4 gemv + residual"]["LOP3.LUT"] > 0
    assert any(op.startswith("F2FP") for op in by_kind["fp8 gemv (weight-only) + residual"])
