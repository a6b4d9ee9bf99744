"""CUDA C++ kernels compiled at run time with NVRTC and launched through the driver API.

Why not torch's cpp_extension (cuda_sampling.py uses it): that needs nvcc and a host compiler,
takes ~30 s per build, and its output is tied to the torch C++ ABI. A kernel here is one .cu file
without headers, compiled by NVRTC (a library torch's CUDA wheels already bring, as does the
`cuda-bindings` package torch depends on) to a cubin for the GPU at hand in about a second, then
loaded with `cuModuleLoadData` and launched with `cuLaunchKernel` on torch's current stream (so a
CUDA-graph capture records it like any other kernel). Compiled cubins are kept on disk
(~/.cache/ferrox/nvrtc, or $FERROX_CACHE_DIR/nvrtc), keyed by the source, the options, the GPU
architecture and NVRTC's version, so a restart loads them instead of compiling.

Every build of a module (a compile or a disk-cache load, like a Triton JIT miss) is reported to
the listeners registered with `add_build_listener`: worker/warmup.py's CompileWatch counts them,
so "nothing compiles after ready" covers these kernels too.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

BuildListener = Callable[[str, float], None]  # (module name, seconds)
_listeners: list[BuildListener] = []
_lock = threading.Lock()


def add_build_listener(fn: BuildListener) -> None:
    _listeners.append(fn)


def remove_build_listener(fn: BuildListener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


class NvrtcError(RuntimeError):
    pass


@lru_cache(maxsize=1)
def bindings() -> tuple[Any, Any] | None:
    """(cuda.bindings.driver, cuda.bindings.nvrtc), or None where cuda-bindings is missing."""
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        return None
    return driver, nvrtc


def _check(result: Any, what: str) -> Any:
    """cuda-bindings calls return (status, *values): raise on a failed status, return the values."""
    if not isinstance(result, tuple):
        result = (result,)
    status, values = result[0], result[1:]
    if int(status) != 0:
        raise NvrtcError(f"{what} failed: {status!r}")
    return values[0] if len(values) == 1 else values


def _cache_dir() -> Path:
    root = os.environ.get("FERROX_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "ferrox") / "nvrtc"


def compile_cubin(source: str, arch: str, options: Sequence[str] = (), name: str = "kernel.cu") -> bytes:
    """The cubin of `source` for `arch` ("sm_90"), from the disk cache or compiled now."""
    libs = bindings()
    if libs is None:
        raise NvrtcError("cuda-bindings is not installed")
    _, nvrtc = libs
    version = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    opts = [f"--gpu-architecture={arch}", "--std=c++17", *options]
    key = hashlib.sha256("\0".join([source, *opts, repr(version)]).encode()).hexdigest()[:32]
    path = _cache_dir() / f"{Path(name).stem}-{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in opts]
        status = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)[0]
        if int(status) != 0:
            size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise NvrtcError(f"NVRTC could not compile {name} for {arch}:\n{log.decode(errors='replace')}")
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    try:  # write-then-rename: a concurrent reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not cache %s: %s", path, exc)
    return cubin


@cache
def packaged_source(name: str) -> str | None:
    """The text of the repository's cuda/<name> as the package ships it (ferrox/csrc), or None without it."""
    from ferrox.kernels.cuda_sampling import PACKAGED_SOURCE_DIR

    path = PACKAGED_SOURCE_DIR / name
    return path.read_text() if path.is_file() else None


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


@dataclass
class CudaModule:
    """A .cu source and the kernels it defines, loaded once per CUDA device on first use."""

    name: str
    source: str
    options: tuple[str, ...] = ()
    _functions: dict[tuple[int, str], Any] = field(default_factory=dict)
    _modules: dict[int, Any] = field(default_factory=dict)

    def function(self, device: torch.device, kernel: str) -> Any:
        """The kernel's handle on `device` (the module compiled or loaded on first use)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        fn = self._functions.get((index, kernel))
        if fn is None:
            fn = self._load(index, kernel)
        return fn

    def _load(self, index: int, kernel: str) -> Any:
        libs = bindings()
        if libs is None:
            raise NvrtcError("cuda-bindings is not installed")
        driver = libs[0]
        with _lock, torch.cuda.device(index):
            module = self._modules.get(index)
            if module is None:
                start = time.perf_counter()
                cubin = compile_cubin(self.source, device_arch(torch.device("cuda", index)), self.options, self.name)
                _make_context_current(driver, index)
                module = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({self.name})")
                self._modules[index] = module
                seconds = time.perf_counter() - start
                for listener in list(_listeners):
                    listener(self.name, seconds)
            fn = _check(driver.cuModuleGetFunction(module, kernel.encode()), f"cuModuleGetFunction({kernel})")
            self._functions[(index, kernel)] = fn
            return fn


def _make_context_current(driver: Any, index: int) -> None:
    """Make torch's context of device `index` (the primary one) current on this thread: a module loads
    into the current context, and torch's kernels and streams live in the primary one."""
    torch.empty(1, device=torch.device("cuda", index))  # the runtime makes the primary context current
    if not int(_check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")):
        primary = _check(driver.cuDevicePrimaryCtxRetain(_check(driver.cuDeviceGet(index), "cuDeviceGet")),
                         "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(primary), "cuCtxSetCurrent")


_DEFAULT_SHARED = 48 * 1024  # what a launch may ask for without the kernel's opt-in, static included
_STATIC_SHARED_MAX = 8 * 1024  # more static shared memory than any kernel here declares
_shared_allowed: dict[int, int] = {}


def allow_shared(fn: Any, nbytes: int) -> None:
    """Let kernel `fn` launch with `nbytes` of dynamic shared memory: past 48 KB with its static shared
    memory a kernel must opt in (CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES), once per kernel and size."""
    if nbytes <= _DEFAULT_SHARED - _STATIC_SHARED_MAX:
        return
    key = int(fn)
    if _shared_allowed.get(key, 0) >= nbytes:
        return
    driver = bindings()[0]  # type: ignore[index]
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    _check(driver.cuFuncSetAttribute(fn, attr, nbytes), "cuFuncSetAttribute")
    _shared_allowed[key] = nbytes


def blocks_per_sm(fn: Any, threads: int, shared: int) -> int:
    """How many blocks of `threads` threads with `shared` bytes of dynamic shared memory fit on one SM
    at once (registers, shared memory, threads: the driver's occupancy calculator)."""
    driver = bindings()[0]  # type: ignore[index]
    return int(_check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, shared),
                      "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


# Kernel argument types, for `launch`'s (value, type) pairs.
PTR, I32, I64, U32, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_float


def launch(fn: Any, grid: int | tuple[int, int, int], block: int, args: Sequence[Any], types: Sequence[Any],
           stream: int, *, pdl: bool = False, shared: int = 0) -> None:
    """fn<<<grid, block, shared, stream>>>(*args) (a handle from `CudaModule.function`, so cuda-bindings is
    there); grid: blocks, or (x, y, z); `types` are the ctypes of the kernel's parameters; shared: dynamic
    shared memory in bytes (past 48 KB after `allow_shared`). pdl: launched with programmatic dependent
    launch (kernels/pdl.py: the kernel must follow its rules)."""
    driver = bindings()[0]  # type: ignore[index]
    params = (tuple(args), tuple(types))
    gx, gy, gz = (grid, 1, 1) if isinstance(grid, int) else grid
    if not pdl:
        _check(driver.cuLaunchKernel(fn, gx, gy, gz, block, 1, 1, shared, stream, params, 0), "cuLaunchKernel")
        return
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes, config.hStream = shared, stream
    config.attrs, config.numAttrs = [attr], 1
    _check(driver.cuLaunchKernelEx(config, fn, params, 0), "cuLaunchKernelEx")
