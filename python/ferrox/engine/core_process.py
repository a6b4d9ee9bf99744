"""The engine core in its own process, and the wire format between it and the front-end.

Why a process: the front-end (HTTP, JSON, chat templates, tokenization) and the engine step
(scheduler + model forward) both want the GIL. In one process every HTTP request would
stall decoding; in two, they overlap.

Three ZMQ sockets over ipc:// files in a private temp dir, all bound by the front-end:

    handshake  core PUSH -> front PULL   once: READY(CoreInfo) or FAILED(message)
    input      front PUSH -> core PULL   ADD(EngineCoreRequest) / ABORT(ids) / UTILITY(call)
    output     core PUSH -> front PULL   OUTPUTS(EngineCoreOutputs) / UTILITY_RESULT / FAILED

Each message is two frames: [kind, msgpack payload] (msgspec). The core loop is:
drain the input socket -> step() -> push outputs; when nothing is left to do it blocks on
the input socket (with a timeout, to notice an orphaning parent).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Any

import msgspec

from ferrox.engine.defaults import GENERATION_DEFAULT_KEYS
from ferrox.engine.protocol import EngineCoreRequest
from ferrox.gc_tuning import freeze_startup_heap
from ferrox.logging_config import configure_logging
from ferrox.multimodal.shm_items import resolve_items
from ferrox.multimodal.shm_store import ShmStoreError
from ferrox.pooling.params import PoolerConfig
from ferrox.step_types import StepResult, StepRow

logger = logging.getLogger("ferrox.engine.core_process")

# Frame 0 of every message.
ADD = b"ADD"
ABORT = b"ABORT"
UTILITY = b"UTIL"
OUTPUTS = b"OUT"
UTILITY_RESULT = b"UTILRES"
READY = b"READY"
FAILED = b"FAILED"

# Scheduler stats ride along with outputs at most this often (and whenever the core goes idle),
# so /metrics is fresh without a round trip per scrape or a stats() call per step.
STATS_INTERVAL_S = 0.2
# While idle the core wakes this often to check that its parent is still alive.
IDLE_POLL_MS = 1000


class CoreInfo(msgspec.Struct):
    """What the front-end learns at the handshake (logged by `ferrox serve`, used for validation)."""

    model_name: str
    max_model_len: int
    kv_capacity_tokens: int
    device: str
    pid: int
    vocab_size: int = 0  # the logits width: token ids must be below it
    stats: dict[str, Any] = {}
    # generation_config.json sampling defaults (temperature, top_p, ...): the front-end applies
    # them to requests that leave those fields unset, as the offline LLM does.
    generation_defaults: dict[str, Any] = {}
    # Runner "pooling" (an embedding model): how it pools, so the front-end checks requests without torch.
    pooler_config: PoolerConfig | None = None
    # The model's end-of-sequence ids (beam search ends a beam at one: ferrox.beam_search).
    eos_token_ids: list[int] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One loop turn's results: the step's StepResult (columns) plus those of the input messages
    handled before it (refused adds, aborts). step_start lets the front-end compute queue time
    (arrival -> the step that produced a request's first output; exact when the prompt fits one
    chunk)."""

    results: list[StepResult]
    step_start: float = 0.0
    stats: dict[str, Any] | None = None


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str  # one of UTILITY_METHODS
    args: list[Any] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


# The generation_config.json keys that become sampling defaults (one list: engine/defaults.py).
SAMPLING_DEFAULT_KEYS = GENERATION_DEFAULT_KEYS

# Engine core methods the front-end may call by name (anything else is refused).
UTILITY_METHODS = ("stats", "reset_prefix_cache", "ping", "add_lora", "remove_lora", "list_loras", "start_profile",
                   "stop_profile", "sleep", "wake_up", "is_sleeping", "collective_rpc")

_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


class CoreProcLoop:
    """Runs inside the child: owns the EngineCore and the two data sockets."""

    def __init__(self, engine_core: Any, input_addr: str, output_addr: str) -> None:
        import zmq

        self.core = engine_core
        self.ctx = zmq.Context(io_threads=1)
        self.input = self.ctx.socket(zmq.PULL)
        self.input.connect(input_addr)
        self.output = self.ctx.socket(zmq.PUSH)
        self.output.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs
        self.output.setsockopt(zmq.LINGER, 2000)
        self.output.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.input, zmq.POLLIN)
        self.decode_request = msgspec.msgpack.Decoder(EngineCoreRequest)
        self.decode_ids = msgspec.msgpack.Decoder(list[str])
        self.decode_call = msgspec.msgpack.Decoder(UtilityCall)
        self.last_stats_time = 0.0
        self.parent_pid = os.getppid()
        self.running = True
        # sleep(mode="wait") while requests run: the call, answered once they finish; requests that
        # arrive meanwhile are held here, not scheduled, and queued behind the sleep.
        self.pending_sleep: UtilityCall | None = None
        self.held: list[EngineCoreRequest] = []

    # ---- input -----------------------------------------------------------------------------
    def _handle(self, kind: bytes, payload: bytes) -> list[StepResult]:
        """Apply one input message; returns outputs it produced at once (errors, aborts)."""
        if kind == ADD:
            request = self.decode_request.decode(payload)
            if request.mm_inputs:
                # Shared-memory items (--mm-processor-cache-type shm) read back now, before the request may be held,
                # refused or aborted: each reference sent is acknowledged once, so the front-end can reuse its space.
                try:
                    request.mm_inputs = resolve_items(request.mm_inputs)
                except ShmStoreError as exc:
                    return [_error_result(request.request_id, exc)]
            if self.pending_sleep is not None:
                self.held.append(request)
                return []
            return self._add(request)
        if kind == ABORT:
            ids = self.decode_ids.decode(payload)
            if self.held:
                dropped = set(ids)
                self.held = [r for r in self.held if r.request_id not in dropped]
            return [self.core.abort_requests(ids)]
        if kind == UTILITY:
            return self._utility(self.decode_call.decode(payload))
        if kind == b"STOP":
            self.running = False
            return []
        logger.error("engine core: unknown message kind %r ignored", kind)
        return []

    def _add(self, request: EngineCoreRequest) -> list[StepResult]:
        try:
            self.core.add_request(request)
        except Exception as exc:  # a bad request fails alone; the loop goes on
            return [_error_result(request.request_id, exc)]
        return []

    def _utility(self, call: UtilityCall) -> list[StepResult]:
        """Run one utility call and answer it; returns outputs it produced (sleep's aborted requests)."""
        result = UtilityResult(call.call_id)
        outputs: list[StepResult] = []
        try:
            if call.method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {call.method!r}")
            if call.method == "ping":
                result.result = "pong"
            elif call.method == "sleep":
                if self.pending_sleep is not None:
                    raise ValueError("sleep: a sleep(mode='wait') is already waiting for its requests to finish")
                mode = call.args[1] if len(call.args) > 1 else "abort"
                if mode == "wait" and self.core.paused:
                    # Already asleep: the requests it would wait for cannot finish; they are kept.
                    call.args = [call.args[0], "keep", *call.args[2:]]
                elif mode == "wait" and self.core.has_unfinished_requests():
                    self.core.sleep_plan(*call.args)  # refuse bad arguments now, not once the requests finished
                    self.pending_sleep = call  # answered by _sleep_when_drained
                    return []
                outputs.append(self.core.sleep(*call.args))
            elif call.method == "wake_up":
                self.core.wake_up(*call.args)
                outputs.extend(self._cancel_pending_sleep())
            else:
                result.result = getattr(self.core, call.method)(*call.args)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        # Before the answer (a caller sees its effects first); a sleep state change with fresh stats (/metrics).
        self._send(outputs, time.time(), idle=call.method in ("sleep", "wake_up"))
        self.output.send_multipart([UTILITY_RESULT, encode(result)], copy=False)
        return []

    def _sleep_when_drained(self) -> list[StepResult]:
        """sleep(mode="wait"): sleep once the requests it waited for are done, then queue the held ones."""
        call = self.pending_sleep
        if call is None or self.core.has_unfinished_requests():
            return []
        self.pending_sleep = None
        result = UtilityResult(call.call_id)
        outputs: list[StepResult] = []
        try:
            outputs.append(self.core.sleep(*call.args))
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        outputs.extend(self._queue_held())
        self._send(outputs, time.time(), idle=True)
        self.output.send_multipart([UTILITY_RESULT, encode(result)], copy=False)
        return []

    def _queue_held(self) -> list[StepResult]:
        """The requests held back while a sleep waited go to the engine (asleep, they wait there)."""
        held, self.held = self.held, []
        return [out for request in held for out in self._add(request)]

    def _cancel_pending_sleep(self) -> list[StepResult]:
        """wake_up while a sleep(mode="wait") waits: that sleep is called off (answered with an error)."""
        call, self.pending_sleep = self.pending_sleep, None
        if call is None:
            return []
        self.output.send_multipart([UTILITY_RESULT, encode(UtilityResult(
            call.call_id, error="InvalidArgumentError: sleep: called off by a wake_up before its requests finished"))],
            copy=False)
        return self._queue_held()

    def _drain(self, timeout_ms: int | None) -> list[StepResult]:
        """Read every pending input message; wait up to timeout_ms for the first one."""
        import zmq

        outputs: list[StepResult] = []
        wait = timeout_ms
        while self.running:
            if not self.poller.poll(wait):
                break
            wait = 0
            kind, payload = self.input.recv_multipart(flags=zmq.NOBLOCK)
            outputs.extend(self._handle(kind, payload))
        return outputs

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        while self.running:
            busy = self._runnable()
            outputs = self._drain(0 if busy else IDLE_POLL_MS)
            if not self.running:
                break
            step_start = time.time()
            if self.pending_sleep is not None:
                outputs.extend(self._sleep_when_drained())
            if self._runnable():
                step_result = self.core.step()
                if len(step_result):
                    outputs.append(step_result)
                else:
                    # Nothing ran (e.g. every request waits for a grammar to compile): block
                    # briefly instead of spinning. Returns at once when nothing is pending.
                    self.core.wait_for_work(0.005)
            elif not outputs and not busy:
                # Idle wake-up with nothing to do: make sure we are not an orphan.
                if os.getppid() != self.parent_pid:
                    logger.error("engine core: parent process is gone, exiting")
                    return
                continue
            self._send(outputs, step_start, idle=not self._runnable())

    def _runnable(self) -> bool:
        """Requests to step, and the engine awake (asleep, they wait for wake_up)."""
        return self.core.has_unfinished_requests() and not self.core.paused

    def _send(self, outputs: list[StepResult], step_start: float, idle: bool) -> None:
        now = time.time()
        stats = None
        if idle or now - self.last_stats_time >= STATS_INTERVAL_S:
            stats = self.core.stats()
            self.last_stats_time = now
        outputs = [r for r in outputs if len(r)]
        if outputs or stats is not None:
            msg = EngineCoreOutputs(outputs, step_start, stats)
            self.output.send_multipart([OUTPUTS, encode(msg)], copy=False)

    def close(self) -> None:
        self.input.close(linger=0)
        self.output.close()
        self.ctx.term()


def _error_result(request_id: str, exc: BaseException) -> StepResult:
    return StepResult.from_rows([StepRow(request_id, finish_reason="error", error=str(exc) or type(exc).__name__)])


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL us if the front-end dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def run_engine_core(
    config: Any,
    handshake_addr: str,
    input_addr: str,
    output_addr: str,
    log_level: str,
    engine_index: int | None = None,
    env: dict[str, str] | None = None,
    cpus: list[int] | None = None,
) -> None:
    """Entry point of the child process (multiprocessing spawn target).

    A data-parallel core gets its index (for its log lines), its environment (CUDA_VISIBLE_DEVICES)
    and its CPUs here, applied before torch is first imported: CUDA and OpenMP read them once."""
    import zmq

    _die_with_parent()
    # Ctrl-C goes to the whole process group; the front-end decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if env:
        os.environ.update(env)
    if cpus:
        os.sched_setaffinity(0, cpus)
    tag = "core" if engine_index is None else f"core {engine_index}"
    configure_logging(log_level, f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s")

    ctx = zmq.Context()
    handshake = ctx.socket(zmq.PUSH)
    handshake.setsockopt(zmq.LINGER, 5000)
    handshake.connect(handshake_addr)
    try:
        from ferrox.engine.engine_core import EngineCore

        core = EngineCore(config, engine_index=engine_index or 0)
        info = CoreInfo(
            model_name=str(core.model_name),
            max_model_len=int(core.max_model_len),
            kv_capacity_tokens=int(core.kv_capacity_tokens),
            vocab_size=int(core.vocab_size),
            device=str(getattr(core, "device", getattr(config, "device", "cpu"))),
            pid=os.getpid(),
            stats=core.stats(),
            generation_defaults={
                k: v for k, v in dict(getattr(core, "generation_defaults", {}) or {}).items()
                if k in SAMPLING_DEFAULT_KEYS and isinstance(v, (int, float))
            },
            pooler_config=getattr(core, "pooler_config", None),
            eos_token_ids=[int(t) for t in getattr(core, "eos_token_ids", ())],
        )
        loop = CoreProcLoop(core, input_addr, output_addr)
        freeze_startup_heap()
    except BaseException as exc:
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        logger.debug("engine core startup failed:\n%s", traceback.format_exc())
        handshake.send_multipart([FAILED, encode(detail)])
        handshake.close()
        ctx.term()
        sys.exit(1)
    handshake.send_multipart([READY, encode(info)])
    handshake.close()

    exit_code = 0
    try:
        loop.run()
    except SystemExit:
        pass
    except BaseException:
        # A bug in the step: tell the front-end why before dying, so it can fail every request.
        detail = traceback.format_exc()
        logger.error("engine core crashed:\n%s", detail)
        try:
            loop.output.send_multipart([FAILED, encode(detail.strip().splitlines()[-1])])
        except Exception:
            pass
        exit_code = 1
    finally:
        loop.close()
        ctx.term()
    sys.exit(exit_code)
