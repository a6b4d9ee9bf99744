"""vLLM's cpu_offload_gb, on the CPU: its refusals by name (the offload itself needs a GPU:
tests/engine/test_gpu_engine.py)."""

from __future__ import annotations

import pytest
from ferrox.config import EngineConfig

from tests.test_compilation_config import _parse


def test_cpu_offload_gb_refusals(tmp_path):
    for kwargs, match in ((dict(cpu_offload_gb=-1), "cpu_offload_gb"), (dict(cpu_offload_gb="4"), "cpu_offload_gb"),
                          (dict(cpu_offload_gb=2, enable_sleep_mode=True), "cpu_offload_gb"),
                          (dict(cpu_offload_gb=2, quantization="fp8"), "cpu_offload_gb")):
        with pytest.raises(ValueError, match=match):
            EngineConfig(**kwargs)
    assert _parse(["model", "--cpu-offload-gb", "2.5"]).cpu_offload_gb == 2.5
    from ferrox import LLM

    from tests.helpers.tiny_models import make_tiny_llama

    with pytest.raises(ValueError, match="cpu_offload_gb: offloads GPU weights"):
        LLM(make_tiny_llama(tmp_path / "m"), device="cpu", cpu_offload_gb=1)
