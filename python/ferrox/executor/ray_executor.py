"""Tensor-parallel ranks 1..N-1 as Ray actors (`distributed_executor_backend="ray"`).

Ray places the ranks; torch.distributed (NCCL on GPUs, gloo on CPU) carries their traffic, as
with the mp executor. A placement group reserves one bundle per rank (a GPU each on CUDA, a CPU
each otherwise; strategy PACK: on as few nodes as possible, spilling over to other nodes of the
cluster when one does not hold them all). Bundle 0 is the driver's own: the engine process runs
rank 0 itself, so the bundle only keeps Ray from giving that GPU to another rank on its node.

The cluster: the one `ray.init` finds (RAY_ADDRESS, or a cluster started with `ray start --head`
on this machine), else a local one started here. Ray is optional: `pip install ferrox[ray]`.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from ferrox.config import EngineConfig
from ferrox.executor.mp_executor import free_port

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend: 'ray' needs Ray, which is not installed "
                         "(pip install 'ferrox[ray]')") from e
    return ray


class _RankActor:
    """One rank; `run` returns only when the driver sends SHUTDOWN (or raises when it dies)."""

    def run(self, config: EngineConfig, rank: int, size: int, init_method: str) -> None:
        import logging as _logging

        from ferrox.executor.worker_main import run_worker

        _logging.basicConfig(level=os.environ.get("FERROX_WORKER_LOG_LEVEL", "WARNING"))
        # On GPUs Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: its device 0.
        run_worker(config, rank, size, init_method, device_index=0)

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_pg = remove_placement_group
        self.size = config.tensor_parallel_size
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address, include_dashboard=False, log_to_driver=True,
                     **({} if address else {"num_cpus": max(self.size, os.cpu_count() or 1)}))
        gpu = config.resolved_device() == "cuda"
        bundle = {"GPU": 1.0, "CPU": 1.0} if gpu else {"CPU": 1.0}
        self.pg = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        driver_ip = ray.util.get_node_ip_address()
        self.init_method = f"tcp://{driver_ip}:{free_port('0.0.0.0')}"
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(_RankActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank)).remote()
            for rank in range(1, self.size)
        ]
        self.runs = [actor.run.remote(config, rank, self.size, self.init_method)
                     for rank, actor in enumerate(self.actors, start=1)]
        self._closing = False
        self._watcher = threading.Thread(target=self._watch, name="ferrox-ray-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        from ferrox.executor.mp_executor import DEATH_GRACE_S

        ready, _ = self._ray.wait(self.runs, num_returns=1, timeout=None)
        if self._closing:
            return
        rank = self.runs.index(ready[0]) + 1
        try:
            self._ray.get(ready[0])
            why = "returned"
        except Exception as e:  # noqa: BLE001 - reported, then the engine goes down
            why = f"failed: {e}"
        logger.critical("tensor-parallel rank %d (Ray actor) %s while the engine was running", rank, why)
        import time

        time.sleep(DEATH_GRACE_S)
        if not self._closing:
            logger.critical("exiting: a tensor-parallel rank is gone")
            os._exit(1)

    def alive(self) -> bool:
        ready, _ = self._ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return not ready

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        try:
            self._ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)
        finally:
            for actor in self.actors:
                self._ray.kill(actor)
            self._remove_pg(self.pg)
