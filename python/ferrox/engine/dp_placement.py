"""Where each data-parallel engine core runs: its GPUs, or its share of the CPU.

Decided in the API-server process, which never imports torch, so GPUs are counted from
CUDA_VISIBLE_DEVICES or the NVIDIA driver's /proc entries rather than from torch.cuda.

- GPU: core i sees devices [i*tp, (i+1)*tp) of the visible ones through its own
  CUDA_VISIBLE_DEVICES (tp = tensor_parallel_size), so inside the core, and in any tensor-parallel
  workers it starts, the devices are simply cuda:0..tp-1.
- CPU: core i is pinned to its own slice of this process's CPUs. The engine's thread governor
  sizes torch's thread pool from the CPUs a process may run on, so pinning alone splits the
  threads, and the cores do not preempt each other's OpenMP regions (which costs far more than
  the threads gain: see ferrox/worker/cpu_threads.py). The default KV-cache memory, a share of
  available RAM, is split between the cores too.

With data_parallel_size 1 nothing is changed: the one core runs exactly as it always has.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from dataclasses import dataclass

from ferrox.config import CPU_DEFAULT_KV_CACHE_MEMORY, EngineConfig, _available_memory
from ferrox.errors import EngineStartupError


@dataclass(slots=True)
class CorePlacement:
    index: int
    config: EngineConfig  # the core's own config: data_parallel_size 1 (it is one replica)
    env: dict[str, str]  # environment overrides for the core process
    cpus: list[int] | None  # CPU affinity for the core process (None: inherit)
    where: str  # for the start-up log line

    def describe(self) -> str:
        return f"engine core {self.index} on {self.where}"


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may use, as CUDA_VISIBLE_DEVICES entries, without torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        devices = []
        for entry in (e.strip() for e in env.split(",")):
            if not entry or entry.startswith("-"):
                break  # CUDA stops at the first invalid entry
            devices.append(entry)
        return devices
    count = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    if count == 0:
        count = sum(1 for path in glob.glob("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", path))
    return [str(i) for i in range(count)]


def place_cores(config: EngineConfig) -> list[CorePlacement]:
    size = config.data_parallel_size
    if size == 1:
        return [CorePlacement(0, config, {}, None, "its default devices")]
    core_config = dataclasses.replace(config, data_parallel_size=1)
    gpus = visible_cuda_devices()
    on_gpu = config.device == "cuda" or (config.device == "auto" and bool(gpus))
    if on_gpu:
        return _place_on_gpus(core_config, size, gpus)
    return _place_on_cpus(core_config, size)


def _place_on_gpus(config: EngineConfig, size: int, gpus: list[str]) -> list[CorePlacement]:
    tp = config.tensor_parallel_size
    if size * tp > len(gpus):
        raise EngineStartupError(
            f"data_parallel_size {size} x tensor_parallel_size {tp} needs {size * tp} GPUs, but {len(gpus)} "
            f"{'is' if len(gpus) == 1 else 'are'} visible (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
            param="data_parallel_size",
        )
    placements = []
    for i in range(size):
        devices = ",".join(gpus[i * tp : (i + 1) * tp])
        placements.append(CorePlacement(i, config, {"CUDA_VISIBLE_DEVICES": devices}, None,
                                        f"CUDA_VISIBLE_DEVICES={devices}"))
    return placements


def _place_on_cpus(config: EngineConfig, size: int) -> list[CorePlacement]:
    if config.kv_cache_memory is None:
        # The single-core default takes a share of available RAM; N cores split that share.
        config = dataclasses.replace(
            config, kv_cache_memory=max(1 << 20, min(CPU_DEFAULT_KV_CACHE_MEMORY, _available_memory() // 2 // size)))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    per_core = len(cpus) // size
    placements = []
    for i in range(size):
        if per_core >= 1 and config.num_threads is None:
            mine = cpus[i * per_core : (i + 1) * per_core]
            placements.append(CorePlacement(i, config, {}, mine, f"cpu (CPUs {_ranges(mine)})"))
        else:
            # Fewer CPUs than cores (or threads fixed by the user): no pinning; one thread each
            # unless the user chose otherwise, so the cores do not oversubscribe the machine.
            own = config if config.num_threads is not None else dataclasses.replace(config, num_threads=1)
            placements.append(CorePlacement(i, own, {}, None, f"cpu ({own.num_threads} thread(s))"))
    return placements


def _ranges(cpus: list[int]) -> str:
    return f"{cpus[0]}-{cpus[-1]}" if len(cpus) > 1 and cpus[-1] - cpus[0] == len(cpus) - 1 else ",".join(map(str, cpus))
