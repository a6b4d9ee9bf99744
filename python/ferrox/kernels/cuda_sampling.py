"""Top-k / top-p sampling from probabilities: a hand-written CUDA kernel with a torch fallback.

`top_k_top_p_sample(probs, top_k, top_p, uniforms)` keeps, per row, the top-k tokens, then the
smallest set of those whose mass reaches top_p of the top-k mass (ties at either cut are kept),
and draws one token by inverse CDF with the row's uniform in [0, 1). Passing the uniforms in
keeps per-request seeds in the caller's hands (one torch.Generator per seeded request).

On CUDA with a compiler present, cuda/top_k_top_p_sampling.cu is JIT-built once with
torch.utils.cpp_extension (cached under ~/.cache/torch_extensions) and used: it finds both cuts
by radix select over the float bits instead of sorting the vocabulary. Anywhere else (CPU, no
nvcc, a source tree without cuda/, or a build error, which is logged once) the sort-based torch
path below runs; both draw from the same distribution but not the same token for a given uniform
(they walk the kept tokens in a different order).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CUDA_SOURCES = ("top_k_top_p_sampling.cu", "top_k_top_p_sampling.cpp")
# Set FERROX_DISABLE_CUDA_SAMPLING=1 to force the torch path (debugging, A/B timing).
_DISABLE_ENV = "FERROX_DISABLE_CUDA_SAMPLING"


def _cuda_source_dir() -> Path | None:
    override = os.environ.get("FERROX_CUDA_SRC")
    candidates = [Path(override)] if override else []
    candidates.append(Path(__file__).resolve().parents[3] / "cuda")  # repo checkout: <root>/cuda
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
    try:
        return cpp_extension.load(
            name="ferrox_top_k_top_p_sampling",
            sources=[str(src / name) for name in _CUDA_SOURCES],
            extra_cuda_cflags=["-O3", "--use_fast_math"],
            extra_cflags=["-O3"],
            verbose=False,
        )
    except Exception as exc:  # a broken toolchain must not take sampling down
        logger.warning("building the CUDA sampling kernel failed (%s); using the torch path", exc)
        return None


def start_background_build() -> None:
    """Build (or load from the cache) the extension on a daemon thread, so an engine's start-up does
    not wait for nvcc; the sampler uses the torch path until `extension_if_ready` returns it."""
    if os.environ.get(_DISABLE_ENV) == "1" or not torch.cuda.is_available():
        return
    global _build_thread
    with _build_lock:
        if _build_thread is None:
            _build_thread = threading.Thread(target=load_extension, name="ferrox-cuda-sampling-build", daemon=True)
            _build_thread.start()


def extension_if_ready() -> Any | None:
    """The extension when a build has finished (never starts or waits for one)."""
    if load_extension.cache_info().currsize == 0:
        return None
    return load_extension()


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
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    """int64 [batch] token ids sampled from probs [batch, vocab] (rows need not be normalized)."""
    _check(probs, top_k, top_p, uniforms)
    ext = load_extension() if probs.is_cuda else None
    if ext is None:
        return top_k_top_p_sample_torch(probs, top_k, top_p, uniforms)
    return ext.top_k_top_p_sample(
        probs.float() if probs.stride(-1) == 1 else probs.float().contiguous(),
        top_k.to(device=probs.device, dtype=torch.int32),
        top_p.to(device=probs.device, dtype=torch.float32),
        uniforms.to(device=probs.device, dtype=torch.float32),
    )
