"""Runs every CPU-sized kernel test of this directory (and the LoRA model's Triton case) under
TRITON_INTERPRET=1 in a child pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter child itself")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel tests run natively")
def test_kernels_under_triton_interpreter():
    # FERROX_INTERPRETER_CHILD: the child runs only what skipped here (conftest.pytest_collection_modifyitems).
    env = dict(os.environ, TRITON_INTERPRET="1", FERROX_INTERPRETER_CHILD="1")
    # The LoRA model test's Triton-kernel-set case lives with the LoRA tests but needs the interpreter too.
    lora_model = str(HERE.parent / "lora" / "test_lora_model.py") + "::test_triton_kernel_set"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(HERE), lora_model]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540, cwd=HERE.parents[1])
    report = proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, f"interpreted kernel tests failed:\n{report}"
    assert " passed" in proc.stdout and "error" not in proc.stdout.splitlines()[-1], report
    print(report)
