"""The front-end's side of the engine-core process: start it, talk to it, notice its death.

`CoreClient` spawns `core_process.run_engine_core` in a child (multiprocessing "spawn": a
fresh interpreter, no forked torch / event-loop state), waits for its handshake, then:

- `add_request` / `abort` push msgpack messages on a sync PUSH socket (non-blocking sends,
  so they can be issued from a `finally:` of a cancelled task);
- one asyncio task reads the output socket and calls `on_outputs(batch)` (AsyncLLM routes
  them to per-request queues); utility calls (`stats`, `reset_prefix_cache`) are matched to
  futures by call id;
- if the child dies, every pending utility future fails and `on_dead(reason)` runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from ferrox.engine import core_process as cp
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.errors import EngineDeadError, EngineStartupError

__all__ = ["CoreClient", "EngineDeadError", "EngineStartupError"]

logger = logging.getLogger("ferrox.engine.core_client")

# How often the output reader wakes when no output arrives, to check the child is alive.
LIVENESS_POLL_MS = 200


class CoreClient:
    def __init__(
        self,
        config: Any,
        *,
        log_level: str = "INFO",
        startup_timeout_s: float = 600.0,
        engine_index: int | None = None,
        env: dict[str, str] | None = None,
        cpus: list[int] | None = None,
    ) -> None:
        """engine_index, env and cpus place one data-parallel core (ferrox.engine.dp_placement)."""
        self._tmpdir = tempfile.mkdtemp(prefix="ferrox-ipc-")
        handshake_addr = f"ipc://{self._tmpdir}/handshake"
        input_addr = f"ipc://{self._tmpdir}/input"
        output_addr = f"ipc://{self._tmpdir}/output"

        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        # A PUSH socket blocks while it has no peer (child not yet attached, or dead); never
        # wait on that for long from the event loop.
        self._input.setsockopt(zmq.SNDTIMEO, 2000)
        self._input.bind(input_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(output_addr)

        self.dead: str | None = None  # why the core is gone, once it is
        self.on_outputs: Callable[[cp.EngineCoreOutputs], None] | None = None
        self.on_dead: Callable[[str], None] | None = None
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

        ctx = multiprocessing.get_context("spawn")
        self.proc = ctx.Process(
            target=cp.run_engine_core,
            args=(config, handshake_addr, input_addr, output_addr, log_level, engine_index, env, cpus),
            name="ferrox-engine-core" if engine_index is None else f"ferrox-engine-core-{engine_index}",
            daemon=True,
        )
        self._startup_timeout_s = startup_timeout_s
        self._handshake = self._sync_ctx.socket(zmq.PULL)
        self._handshake.setsockopt(zmq.LINGER, 0)
        self._handshake.bind(handshake_addr)
        self._info: cp.CoreInfo | None = None
        try:
            with _main_module_hidden():
                self.proc.start()
        except BaseException:
            self.shutdown()
            raise

    # ---- startup ------------------------------------------------------------------------------
    @property
    def info(self) -> cp.CoreInfo:
        """The core's handshake (waits for it on first access)."""
        if self._info is None:
            self.wait_ready()
        assert self._info is not None
        return self._info

    def wait_ready(self) -> cp.CoreInfo:
        """Block until the core reports READY; EngineStartupError (and the child reaped) otherwise.
        Separate from __init__ so the caller can load its tokenizer while the model loads."""
        if self._info is not None:
            return self._info
        try:
            self._info = self._wait_handshake(self._startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        return self._info

    def _wait_handshake(self, timeout_s: float) -> cp.CoreInfo:
        handshake = self._handshake
        try:
            deadline = time.monotonic() + timeout_s
            while not handshake.poll(200):
                if not self.proc.is_alive():
                    raise EngineStartupError(
                        f"engine core process exited during startup (exit code {self.proc.exitcode})"
                    )
                if time.monotonic() > deadline:
                    raise EngineStartupError(f"engine core did not start within {timeout_s:.0f} s")
            kind, payload = handshake.recv_multipart()
        finally:
            handshake.close()
        if kind == cp.FAILED:
            raise EngineStartupError(msgspec.msgpack.decode(payload, type=str))
        return msgspec.msgpack.decode(payload, type=cp.CoreInfo)

    # ---- requests -----------------------------------------------------------------------------
    def _send(self, kind: bytes, payload: Any) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        try:
            self._input.send_multipart([kind, cp.encode(payload)], copy=False)
        except zmq.ZMQError as exc:
            raise EngineDeadError(f"cannot reach the engine core: {exc}") from exc

    def add_request(self, request: EngineCoreRequest) -> None:
        self.ensure_reader()
        self._send(cp.ADD, request)

    def abort(self, request_ids: list[str]) -> None:
        """Fire-and-forget; safe from a cancelled task's cleanup. No-op once the core is dead."""
        if request_ids and self.dead is None and not self._closed:
            with contextlib.suppress(EngineDeadError):
                self._send(cp.ABORT, list(request_ids))

    async def call_utility(self, method: str, *args: Any, timeout_s: float | None = 30.0) -> Any:
        self.ensure_reader()
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            self._send(cp.UTILITY, cp.UtilityCall(call_id, method, list(args)))
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)

    # ---- the output reader ----------------------------------------------------------------------
    def ensure_reader(self) -> None:
        """Start the output-reading task on the running loop (first use from async code)."""
        if self._reader is None or self._reader.done():
            if self.dead is not None or self._closed:
                return
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs(), name="ferrox-core-output")

    async def _read_outputs(self) -> None:
        decode_outputs = msgspec.msgpack.Decoder(cp.EngineCoreOutputs)
        decode_result = msgspec.msgpack.Decoder(cp.UtilityResult)
        try:
            while True:
                if not await self._output.poll(LIVENESS_POLL_MS):
                    if not self.proc.is_alive():
                        self._mark_dead(f"engine core process died (exit code {self.proc.exitcode})")
                        return
                    continue
                kind, payload = await self._output.recv_multipart()
                if kind == cp.OUTPUTS:
                    if self.on_outputs is not None:
                        self.on_outputs(decode_outputs.decode(payload))
                elif kind == cp.UTILITY_RESULT:
                    self._resolve(decode_result.decode(payload))
                elif kind == cp.FAILED:
                    self._mark_dead(f"engine core failed: {msgspec.msgpack.decode(payload)}")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a front-end bug here must not leave requests hanging
            logger.exception("output reader failed")
            self._mark_dead(f"engine output reader failed: {exc}")

    def _resolve(self, result: cp.UtilityResult) -> None:
        future = self._utility_futures.get(result.call_id)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.result)

    def _mark_dead(self, reason: str) -> None:
        if self.dead is not None or self._closed:
            return
        self.dead = reason
        logger.error("%s", reason)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)

    # ---- shutdown ---------------------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the child (politely, then by force) and release sockets and the ipc dir. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None and not self._reader.done():
            with contextlib.suppress(RuntimeError):  # loop already closed
                self._reader.cancel()
        if self.proc.pid is not None and self.proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._input.send_multipart([b"STOP", b""], flags=zmq.NOBLOCK)
            self.proc.join(timeout_s / 2)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout_s / 2)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(1.0)
        self._handshake.close(linger=0)
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.dead is None and not self._closed and self.proc.is_alive()

    def __repr__(self) -> str:
        return f"CoreClient(pid={self.pid}, alive={self.is_alive()}, ipc={os.path.basename(self._tmpdir)})"


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start the child without re-running the parent's __main__ script in it.

    A "spawn" child normally imports the parent's main script (as __mp_main__) so that pickled
    objects defined there resolve. The core needs nothing from it (its target and config live in
    ferrox), and re-running a script that creates an AsyncLLM at top level, without an
    `if __name__ == "__main__"` guard, would spawn recursively. Hiding __file__/__spec__ while
    the child's preparation data is taken makes the child skip that step.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: getattr(main, name) for name in ("__file__", "__spec__") if hasattr(main, name)}
    try:
        if "__file__" in saved:
            del main.__file__
        if "__spec__" in saved:
            main.__spec__ = None
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)
