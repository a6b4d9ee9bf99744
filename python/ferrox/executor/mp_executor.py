"""Tensor-parallel ranks 1..N-1 as processes on this machine (`distributed_executor_backend="mp"`).

Each rank is a fresh interpreter (`python -m ferrox.executor.worker_main`), so nothing of the
parent (CUDA context, threads, the user's __main__) is forked or re-imported. A watcher thread
waits on the processes: a rank that exits while the engine runs takes the engine down. On CPU
the next gloo collective raises at once ("connection closed by peer"), so the step fails like
any other engine error (LLM raises; under `ferrox serve` the core process reports it and exits,
the front-end fails every waiting request and the server exits non-zero). On GPUs an NCCL
collective would wait for the dead rank forever, so after a short grace period this process
exits with status 1 itself, with the same effect under `ferrox serve`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from ferrox.config import EngineConfig

logger = logging.getLogger(__name__)

# Seconds between a rank's death and this process's exit (a gloo collective notices at once and
# raises; an NCCL one would wait forever).
DEATH_GRACE_S = 3.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.size = config.tensor_parallel_size
        self.device_type = config.resolved_device()
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self._closing = False
        config_json = json.dumps(dataclasses.asdict(config))
        env = dict(os.environ)
        self.procs = [
            subprocess.Popen([sys.executable, "-m", "ferrox.executor.worker_main", config_json, str(rank),
                              str(self.size), self.init_method], env=env)
            for rank in range(1, self.size)
        ]
        self._watcher = threading.Thread(target=self._watch, name="ferrox-tp-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self._rank_died(rank, proc.pid, code)
                    return
            time.sleep(0.2)

    def _rank_died(self, rank: int, pid: int, code: int) -> None:
        logger.critical("tensor-parallel rank %d (pid %d) exited with status %s while the engine was running; "
                        "the engine cannot continue without it", rank, pid, code)
        if self.device_type != "cuda":
            return  # gloo collectives fail by themselves (module docstring)
        time.sleep(DEATH_GRACE_S)
        if not self._closing:
            logger.critical("exiting: a tensor-parallel rank is gone")
            sys.stderr.flush()
            os._exit(1)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                if timeout_s <= 0:
                    raise subprocess.TimeoutExpired(proc.args, 0)
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
