"""Top-k / top-p sampling from probabilities: a hand-written CUDA kernel with a torch fallback.

`top_k_top_p_sample(probs, top_k, top_p, uniforms)` keeps, per row, the top-k tokens, then the
smallest set of those whose mass reaches top_p of the top-k mass (ties at either cut are kept),
and draws one token by inverse CDF with the row's uniform in [0, 1). Passing the uniforms in
keeps per-request seeds in the caller's hands (one torch.Generator per seeded request).

On CUDA with a compiler present, cuda/top_k_top_p_sampling.cu (packaged as ferrox/csrc/, so an
installed wheel has it too) is JIT-built once with torch.utils.cpp_extension (cached under
~/.cache/ferrox/cuda_ext) and used: it finds both cuts by radix select over the float bits instead
of sorting the vocabulary. An engine asks `prepare_extension()` once at start (see there for why a
first start builds for the next one). Anywhere else (CPU, no nvcc, no sources, or a build error,
which is logged once) the sort-based torch path below runs; both draw from the same distribution
but not the same token for a given uniform (they walk the kept tokens in a different order).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CUDA_SOURCES = ("top_k_top_p_sampling.cu", "top_k_top_p_sampling.cpp")
_EXT_NAME = "ferrox_top_k_top_p_sampling"
# Set FERROX_DISABLE_CUDA_SAMPLING=1 to force the torch path (debugging, A/B timing).
_DISABLE_ENV = "FERROX_DISABLE_CUDA_SAMPLING"


# The sources live in the repository's top-level cuda/; ferrox/csrc is a symlink to it, which
# pyproject's maturin `include` copies into every sdist and wheel, so an installed package carries
# them too (a top-level cuda/ in a wheel would land in site-packages/cuda/, cuda-python's package).
PACKAGED_SOURCE_DIR = Path(__file__).resolve().parents[1] / "csrc"


def _cuda_source_dir() -> Path | None:
    override = os.environ.get("FERROX_CUDA_SRC")
    candidates = [Path(override)] if override else []
    candidates.append(PACKAGED_SOURCE_DIR)
    for path in candidates:
        if all((path / name).is_file() for name in _CUDA_SOURCES):
            return path
    return None


@lru_cache(maxsize=1)
def load_extension() -> Any | None:
    """The compiled extension module, or None when it cannot be had here (reason logged)."""
    if os.environ.get(_DISABLE_ENV) == "1" or not torch.cuda.is_available():
        return None
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None and shutil.which("nvcc") is None:
        logger.info("no CUDA compiler found: top-k/top-p sampling uses the torch path")
        return None
    src = _cuda_source_dir()
    if src is None:
        logger.info("cuda/ sources not found: top-k/top-p sampling uses the torch path")
        return None
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        major, minor = torch.cuda.get_device_capability()
        os.environ["TORCH_CUDA_ARCH_LIST"] = f"{major}.{minor}"  # build for this GPU only: faster JIT
    build_dir = _build_dir(src)
    build_dir.mkdir(parents=True, exist_ok=True)
    with exclusive_build(build_dir) as ours:
        if not ours:
            logger.warning("another process has held the CUDA sampling kernel's build folder %s for over %.0f s; "
                           "using the torch path", build_dir, BUILD_WAIT_S)
            return None
        try:
            return cpp_extension.load(
                name=_EXT_NAME,
                sources=[str(path) for path in stage_sources(src, build_dir)],
                extra_cuda_cflags=list(_CUDA_CFLAGS),
                extra_cflags=["-O3"],
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as exc:  # a broken toolchain must not take sampling down
            logger.warning("building the CUDA sampling kernel failed (%s); using the torch path", exc)
            return None


# How long a start waits for another process's build of the kernel (one takes ~30 s on the H200).
BUILD_WAIT_S = 300.0


@contextmanager
def exclusive_build(build_dir: Path, wait_s: float | None = None) -> Iterator[bool]:
    """Hold the build folder against other ferrox processes (an flock, which the OS drops when its
    holder dies); yields False if another process kept it for wait_s (BUILD_WAIT_S).

    Why: torch's JIT build marks its folder with a plain `lock` file, removed when the build ends
    and waited on, forever, by every other build. The kernel is built on a daemon thread, so an
    engine that exits (or is killed) mid-build -- a short offline run, a server stopped during its
    first start -- leaves that file behind, and every later start hung in `cpp_extension.load`.
    While the flock is ours no live ferrox build is under way there, so a `lock` file is such a
    leftover and is removed."""
    deadline = time.monotonic() + (BUILD_WAIT_S if wait_s is None else wait_s)
    with open(build_dir / "ferrox-build.flock", "a") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.2)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by an interrupted build of the CUDA sampling kernel", stale)
                stale.unlink(missing_ok=True)
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_CUDA_CFLAGS = ("-O3", "--use_fast_math")


def sources_digest(src: Path) -> str:
    """A short hash of the kernel's source texts and compiler flags: part of the build folder's name."""
    digest = hashlib.sha256(" ".join(_CUDA_CFLAGS).encode())
    for name in _CUDA_SOURCES:
        digest.update(name.encode() + b"\0" + (src / name).read_bytes())
    return digest.hexdigest()[:12]


def _build_dir(src: Path) -> Path:
    """Where the JIT build lives: one folder per torch / CUDA / Python / GPU architecture and per
    source text (`sources_digest`), under TORCH_EXTENSIONS_DIR or ~/.cache/ferrox, so a later start
    finds the built module, and an upgrade that changes the kernel gets a folder of its own -- no
    build on disk, so it builds in the background (`prepare_extension`), not on the start-up thread."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ferrox")
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    tag = (f"torch{torch.__version__}_cu{torch.version.cuda}_py{sys.version_info.major}{sys.version_info.minor}"
           f"_sm{major}{minor}_src{sources_digest(src)}")
    return Path(root) / "cuda_ext" / tag.replace("+", "-")


def stage_sources(src: Path, build_dir: Path) -> list[Path]:
    """The sources as copies inside build_dir, written only where absent or different, so their
    modification times are the first build's. Why: torch's build (ninja) rebuilds when a source is
    newer than the module, and reinstalling the same package gives its files new times; a folder
    named for the source texts then always holds a module that is current for them."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    paths = []
    for name in _CUDA_SOURCES:
        text, copy = (src / name).read_bytes(), staged / name
        if not copy.is_file() or copy.read_bytes() != text:
            tmp = copy.with_suffix(copy.suffix + ".tmp")
            tmp.write_bytes(text)
            tmp.replace(copy)
        paths.append(copy)
    return paths


def prepare_extension() -> Any | None:
    """Engine start on CUDA. With a finished build on disk, load it now (~1 s) and sample top-k /
    top-p with it; otherwise build it on a daemon thread for the NEXT start, and keep the torch
    path for this whole run -- switching mid-run would change what a seeded request draws (the
    two paths map a uniform to different tokens), so a repeated seeded request must see one
    path per engine. Returns the module to use, or None for the torch path."""
    global _build_thread
    if os.environ.get(_DISABLE_ENV) == "1" or not torch.cuda.is_available():
        return None
    src = _cuda_source_dir()
    build_dir = _build_dir(src) if src is not None else None
    with _build_lock:
        if build_dir is not None and any(build_dir.glob(f"{_EXT_NAME}*.so")):
            module = load_extension()
            if module is not None:
                logger.info("top-k/top-p sampling: the CUDA kernel (built in %s)", build_dir)
            return module
        if _build_thread is None:
            logger.info("building the CUDA top-k/top-p sampling kernel in the background for the next start")
            _build_thread = threading.Thread(target=load_extension, name="ferrox-cuda-sampling-build", daemon=True)
            _build_thread.start()
        return None


_build_lock = threading.Lock()
_build_thread: threading.Thread | None = None


def _check(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor) -> None:
    if probs.dim() != 2:
        raise ValueError(f"probs must be [batch, vocab], got {tuple(probs.shape)}")
    batch = probs.shape[0]
    for name, t in (("top_k", top_k), ("top_p", top_p), ("uniforms", uniforms)):
        if t.shape != (batch,):
            raise ValueError(f"{name} must be [batch={batch}], got {tuple(t.shape)}")


def top_k_top_p_sample_torch(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """Sort-based reference path. top_k <= 0 or >= vocab and top_p >= 1 disable the cut."""
    _check(probs, top_k, top_p, uniforms)
    vocab = probs.shape[1]
    sorted_p, order = probs.float().sort(dim=-1, descending=True)
    k = top_k.to(device=probs.device, dtype=torch.long)
    k = torch.where((k <= 0) | (k >= vocab), torch.full_like(k, vocab), k)
    kth = sorted_p.gather(1, (k - 1)[:, None])
    keep = sorted_p >= kth  # ties with the k-th token stay, as in the CUDA kernel
    csum = (sorted_p * keep).cumsum(-1)
    top_p = top_p.to(device=probs.device, dtype=torch.float32)[:, None]
    cut = torch.searchsorted(csum, top_p * csum[:, -1:]).clamp(max=vocab - 1)
    keep &= (sorted_p >= sorted_p.gather(1, cut)) | (top_p >= 1.0)
    csum = (sorted_p * keep).cumsum(-1)
    target = uniforms.to(device=probs.device, dtype=torch.float32)[:, None] * csum[:, -1:]
    pos = torch.searchsorted(csum, target, right=True)
    pos = torch.minimum(pos, keep.sum(-1, keepdim=True) - 1)  # rounding at the top end: last kept token
    return order.gather(1, pos).squeeze(1)


def top_k_top_p_sample(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor, ext: Any | None = None
) -> torch.Tensor:
    """int64 [batch] token ids sampled from probs [batch, vocab] (rows need not be normalized).
    `ext`: the loaded extension to use; by default it is loaded (built if need be) here."""
    _check(probs, top_k, top_p, uniforms)
    if probs.is_cuda and ext is None:
        ext = load_extension()
    if not probs.is_cuda:
        ext = None
    if ext is None:
        return top_k_top_p_sample_torch(probs, top_k, top_p, uniforms)
    return ext.top_k_top_p_sample(
        probs.float() if probs.stride(-1) == 1 else probs.float().contiguous(),
        top_k.to(device=probs.device, dtype=torch.int32),
        top_p.to(device=probs.device, dtype=torch.float32),
        uniforms.to(device=probs.device, dtype=torch.float32),
    )
