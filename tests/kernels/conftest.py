"""Kernel tests run on CUDA directly, and on CPU only under the Triton interpreter.

TRITON_INTERPRET=1 is read when a kernel is decorated (at import), so it cannot be switched on
inside this process without leaking into every other test directory. On CPU,
test_interpreter.py starts one child pytest over this directory with the variable set; in the
parent the same tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture
def kernel_device() -> torch.device:
    if torch.cuda.is_available() and not INTERPRETED:
        return torch.device("cuda")
    if INTERPRETED:
        return torch.device("cpu")
    pytest.skip("Triton kernels on CPU run in the interpreter child started by test_interpreter.py")


@pytest.fixture
def seed() -> int:
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    value = int(os.environ.get("FERROX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    print(f"seed={value} (replay with FERROX_TEST_SEED={value})")
    return value


@pytest.fixture
def cuda_device() -> torch.device:
    """For @pytest.mark.gpu tests at real shapes."""
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
