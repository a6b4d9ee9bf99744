"""N engine-core processes behind one front-end: data parallelism (`data_parallel_size`).

`DPCoreClient` is what AsyncLLM talks to, for one core as for several: each core is a
`CoreClient` (its own process, sockets and output reader), placed by `dp_placement` (its GPUs or
CPUs) and fed by `DPRouter` (least loaded, then prefix affinity). The rules across cores:

- a request goes to one core; the n samples of one request follow the first to the same core, so
  they share the prompt's KV blocks;
- an abort goes to the core that owns the request;
- under `--mm-processor-cache-type shm` one shared-memory store serves every core: a request's image goes as a
  reference read (and acknowledged in its own slot) by the core it was sent to (multimodal/shm_items.py);
- a utility call (stats, reset_prefix_cache) goes to every core and returns every answer;
- the death of any core is the death of the engine: the front-end fails every waiting client (a
  client cannot tell which core held its request, and a server missing a replica silently serves
  at a fraction of its capacity), and the surviving cores drop the requests whose clients were
  just told so. The server then exits non-zero, as it does when its only core dies.

Each core's outputs reach `on_outputs(engine_index, batch)`; its stats snapshots are kept per
core and merged (`aggregate_stats`) for callers that want the engine as a whole.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import msgspec

from ferrox.config import EngineConfig
from ferrox.engine.core_client import CoreClient
from ferrox.engine.core_process import CoreInfo, EngineCoreOutputs
from ferrox.engine.dp_placement import place_cores
from ferrox.engine.dp_router import DPRouter
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import EngineDeadError, EngineStartupError
from ferrox.multimodal.shm_items import ShmItemSender
from ferrox.multimodal.shm_store import ShmRef

logger = logging.getLogger("ferrox.engine.dp_client")

# Stats keys that describe the engine's shape, the same on every core: not summed.
_SHAPE_KEYS = ("block_size", "max_model_len", "num_speculative_tokens")  # the same on every core: not summed


class DPCoreClient:
    def __init__(self, config: EngineConfig, *, log_level: str = "INFO") -> None:
        self.placements = place_cores(config)
        self.size = len(self.placements)
        self.cores: list[CoreClient] = []
        self._dead: str | None = None
        self._closed = False
        # --mm-processor-cache-type shm (multimodal/shm_items.py): the store items cross to the cores through, one
        # reader slot per core; set by the front-end once it knows the model takes images. None: items inline.
        self.mm_store: ShmItemSender | None = None
        try:
            for placement in self.placements:
                self.cores.append(CoreClient(
                    placement.config, log_level=log_level,
                    engine_index=placement.index if self.size > 1 else None,
                    env=placement.env or None, cpus=placement.cpus,
                ))
        except BaseException:
            self.shutdown()
            raise
        self.router = DPRouter(self.size, config.block_size)
        self.stats: list[dict[str, Any]] = [{} for _ in self.cores]
        self.on_outputs: Callable[[int, EngineCoreOutputs], None] | None = None
        self.on_dead: Callable[[str], None] | None = None
        for index, core in enumerate(self.cores):
            core.on_outputs = functools.partial(self._on_core_outputs, index)
            core.on_dead = functools.partial(self._on_core_dead, index)

    # ---- startup ------------------------------------------------------------------------------
    def wait_ready(self) -> CoreInfo:
        """Wait for every core's handshake (they load in parallel); one core's failure stops all.
        Returns the engine's CoreInfo: the first core's, with the capacity every core can hold."""
        infos: list[CoreInfo] = []
        try:
            for index, core in enumerate(self.cores):
                try:
                    infos.append(core.wait_ready())
                except EngineStartupError as exc:
                    if self.size == 1:
                        raise
                    raise EngineStartupError(f"engine core {index} of {self.size}: {exc}") from exc
        except BaseException:
            self.shutdown()
            raise
        self.stats = [dict(info.stats) for info in infos]
        if self.size > 1:
            for placement, info in zip(self.placements, infos, strict=True):
                logger.info("%s: pid %d, KV cache capacity %d tokens", placement.describe(), info.pid,
                            info.kv_capacity_tokens)
        return msgspec.structs.replace(
            infos[0],
            kv_capacity_tokens=min(info.kv_capacity_tokens for info in infos),
            stats=self.aggregate_stats(),
        )

    # ---- requests -----------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, engine: int | None = None, cache_key: str | None = None) -> int:
        """Send a request to the core `engine`, or to the one the router picks (by the request's
        cache_key when it has one: dp_router.py); returns the core."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if engine is None:
            engine = self.router.route(request.request_id, request.prompt_token_ids, cache_key)
        else:
            self.router.assign(request.request_id, engine)
        refs: list[ShmRef] = []
        try:
            if self.mm_store is not None and request.mm_inputs:
                items, refs = self.mm_store.send(request.mm_inputs, engine)
                if refs:  # (the caller's request keeps its pixels: siblings and retries send their own)
                    request = msgspec.structs.replace(request, mm_inputs=items)
            self.cores[engine].add_request(request)
        except BaseException:
            if self.mm_store is not None:
                self.mm_store.cancel(refs)  # never sent, never read
            self.router.release(request.request_id)
            raise
        return engine

    def abort(self, request_ids: list[str]) -> None:
        """Fire-and-forget, each id to its own core; ids no core holds any more are skipped."""
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.router.release(request_id)
            if engine is not None:
                by_core.setdefault(engine, []).append(request_id)
        for engine, ids in by_core.items():
            self.cores[engine].abort(ids)

    def engine_of(self, request_id: str) -> int | None:
        return self.router.owner(request_id)

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> list[Any]:
        """Call `method` on every core; their answers in core order."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        calls = (core.call_utility(method, *args, timeout_s=timeout_s) for core in self.cores)
        results = list(await asyncio.gather(*calls))
        # An emptied prefix cache (a sleep discards the KV cache too): the router's prefix map is stale.
        if method == "sleep" or method == "reset_prefix_cache" and all(results):
            self.router.forget_prefixes()
        return results

    # ---- outputs, stats, death --------------------------------------------------------------------
    def ensure_reader(self) -> None:
        """Start every core's output reader on the running loop (first use from async code)."""
        for core in self.cores:
            core.ensure_reader()

    def _on_core_outputs(self, engine: int, batch: EngineCoreOutputs) -> None:
        if batch.stats is not None:
            self.update_stats(engine, batch.stats)
        for result in batch.results:
            for request_id in result.finished_req_ids():
                self.router.release(request_id)
        if self.on_outputs is not None:
            self.on_outputs(engine, batch)

    def _on_core_dead(self, engine: int, reason: str) -> None:
        if self._dead is not None or self._closed:
            return
        self._dead = reason if self.size == 1 else f"engine core {engine} of {self.size}: {reason}"
        for other, core in enumerate(self.cores):
            if other != engine:
                core.abort(self.router.owned_by(other))
        if self.on_dead is not None:
            self.on_dead(self._dead)

    def update_stats(self, engine: int, stats: dict[str, Any]) -> None:
        self.stats[engine] = stats
        self.router.update_stats(engine, stats)

    def aggregate_stats(self) -> dict[str, Any]:
        """The cores' latest stats as one engine's (counts summed, KV usage over all blocks), with
        each core's own snapshot under "engines"."""
        return aggregate_stats(self.stats)

    # ---- state and shutdown ------------------------------------------------------------------------
    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def pid(self) -> int | None:
        """The first core's pid (the one `ferrox serve` logs); `pids` has every core's."""
        return self.cores[0].pid if self.cores else None

    @property
    def pids(self) -> list[int | None]:
        return [core.pid for core in self.cores]

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed and all(core.is_alive() for core in self.cores)

    def shutdown(self) -> None:
        """Stop every core, then remove the multimodal shared memory (idempotent)."""
        self._closed = True
        for core in self.cores:
            core.shutdown()
        if self.mm_store is not None:
            self.mm_store.close()

    def __repr__(self) -> str:
        return f"DPCoreClient(size={self.size}, pids={self.pids}, alive={self.is_alive()})"


def aggregate_stats(per_engine: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for stats in per_engine:
        for key, value in stats.items():
            if key == "spec_num_accepted_tokens_per_pos" and isinstance(value, list):
                # Accepted tokens per draft position: summed position by position across cores.
                total = merged.setdefault(key, [])
                total.extend([0] * (len(value) - len(total)))
                for i, v in enumerate(value):
                    total[i] += v
            elif key in _SHAPE_KEYS or not isinstance(value, (int, float)) or isinstance(value, bool):
                merged.setdefault(key, value)
            else:
                merged[key] = merged.get(key, 0) + value
    total_blocks = sum(float(s.get("num_total_blocks", 0) or 0) for s in per_engine)
    if total_blocks:
        used = sum(float(s.get("kv_cache_usage", 0) or 0) * float(s.get("num_total_blocks", 0) or 0)
                   for s in per_engine)
        merged["kv_cache_usage"] = used / total_blocks
    merged["engines"] = [dict(s) for s in per_engine]
    return merged
