"""Choosing and starting the executor for `tensor_parallel_size` (see the package docstring)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from ferrox.config import EngineConfig
from ferrox.distributed.parallel_state import TPGroup, check_no_tp_group, get_tp_group, init_tp_group


class Executor(Protocol):
    size: int
    init_method: str

    def alive(self) -> bool: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...


def rank_config(config: EngineConfig) -> EngineConfig:
    """The configuration every rank runs: on CPU the cores are split between the ranks (each
    rank's intra-op threads), unless num_threads says otherwise."""
    size = config.tensor_parallel_size
    if size == 1 or config.num_threads is not None or config.resolved_device() != "cpu":
        return config
    from ferrox.worker.cpu_threads import available_cores

    return dataclasses.replace(config, num_threads=max(1, available_cores() // size))


def start_tensor_parallel(config: EngineConfig) -> tuple[TPGroup, Executor | None]:
    """Check the shapes, start ranks 1..N-1 and join the group as rank 0. One rank: nothing."""
    size = config.tensor_parallel_size
    if size == 1:
        return get_tp_group(), None
    device = config.resolved_device()
    if device == "cuda" and config.resolved_executor_backend() == "mp":
        import torch

        visible = torch.cuda.device_count()
        if size > visible:
            raise ValueError(f"tensor_parallel_size: {size} exceeds the {visible} visible CUDA device(s)")
    _check_model_shapes(config)
    check_no_tp_group()
    executor: Executor
    if config.resolved_executor_backend() == "ray":
        from ferrox.executor.ray_executor import RayExecutor

        executor = RayExecutor(config)
    else:
        from ferrox.executor.mp_executor import MultiprocExecutor

        executor = MultiprocExecutor(config)
    try:
        tp = init_tp_group(0, size, executor.init_method, device, config.enable_expert_parallel)
    except BaseException:
        executor.shutdown(timeout_s=0)
        raise
    return tp, executor


def _check_model_shapes(config: EngineConfig) -> None:
    """Fail before any rank starts when the model cannot be split that many ways."""
    from ferrox.distributed.sharding import check_tp_shapes
    from ferrox.loader.model_loader import load_model_spec
    from ferrox.loader.source import resolve_model

    spec = load_model_spec(resolve_model(config.model, config.revision), config.hf_overrides, config.config_format)
    check_tp_shapes(spec, config.tensor_parallel_size, expert_parallel=config.enable_expert_parallel)
