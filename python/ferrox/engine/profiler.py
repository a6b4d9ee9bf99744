"""The torch profiler around engine steps, as vLLM offers it: on only when the environment has
VLLM_TORCH_PROFILER_DIR (vLLM's variable, so a vLLM deployment's settings carry over); then
`LLM.start_profile()` / `stop_profile()` (and the server's POST /start_profile, /stop_profile) record
everything the engine core process runs between them -- CPU ops, and CUDA kernels on a GPU -- into
a Chrome / TensorBoard trace in that folder (`*.pt.trace.json.gz`, one per stop).

vLLM's VLLM_TORCH_PROFILER_RECORD_SHAPES / _WITH_PROFILE_MEMORY / _WITH_STACK / _WITH_FLOPS are read
the same way (1/true on; stacks are on by default, as vLLM's). Only the engine core's process is traced:
tensor-parallel ranks beyond the first run their own processes, which this does not reach.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ferrox.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DIR_VAR = "VLLM_TORCH_PROFILER_DIR"


def profiler_dir() -> str | None:
    """The trace folder, None when profiling is off."""
    value = os.environ.get(DIR_VAR, "").strip()
    return os.path.abspath(os.path.expanduser(value)) if value else None


def _flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


class EngineProfiler:
    def __init__(self) -> None:
        self._profile: Any = None

    def start(self) -> None:
        folder = profiler_dir()
        if folder is None:
            raise InvalidArgumentError(f"profiling is off: start the engine with {DIR_VAR}=<folder> (vLLM's "
                                       "variable) to record torch profiler traces there", param=DIR_VAR)
        if self._profile is not None:
            raise InvalidArgumentError("the profiler is already running (call stop_profile first)")
        import torch
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        os.makedirs(folder, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._profile = profile(
            activities=activities,
            record_shapes=_flag("VLLM_TORCH_PROFILER_RECORD_SHAPES", False),
            profile_memory=_flag("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", False),
            with_stack=_flag("VLLM_TORCH_PROFILER_WITH_STACK", True),
            with_flops=_flag("VLLM_TORCH_PROFILER_WITH_FLOPS", False),
            on_trace_ready=tensorboard_trace_handler(folder, worker_name=f"ferrox-core-{os.getpid()}",
                                                     use_gzip=True),
        )
        self._profile.start()
        logger.info("torch profiler started (traces to %s)", folder)

    def stop(self) -> None:
        if self._profile is None:
            raise InvalidArgumentError("the profiler is not running (call start_profile first)")
        profile, self._profile = self._profile, None
        profile.stop()  # writes the trace (on_trace_ready)
        logger.info("torch profiler stopped; trace written to %s", profiler_dir())
