"""vLLM's cpu_offload_gb: up to that many GiB of a GPU's weights live in host memory, which the GPU reads
through unified virtual addressing at every forward. A model larger than the GPU then runs -- each step
streams the offloaded bytes over the host link (PCIe or NVLink-C2C), so it runs slower -- and a model that
fits leaves more of the GPU to the KV cache.

How. The model is built under `offloading(budget)`: a torch hook on parameter registration replaces each
CUDA parameter a module registers, while the budget lasts, by one whose memory is ordinary host memory
page-locked and mapped for the device (cudaHostRegister; with unified addressing the device reads it at the
host address), its values copied over; the device copy is freed at once, so the device never holds more
than one offloaded parameter. Every kernel -- cuBLAS, Triton, the NVRTC products, CUDA graphs -- takes such
a tensor like any other, and loading the checkpoint copies into it as into device memory. Parameters are
offloaded in the order the model registers them (the embedding, then layer by layer), as vLLM offloads
module by module; buffers (rotary tables, workspaces) stay on the device.

What is not offloaded: tensors a model makes after loading (quantization's finalize_weights repacks some
formats into new device tensors; `--quantization fp8` converts every weight, so it is refused with this);
`offloaded_bytes` reports what stayed in host memory. Sleep mode moves weights into its own device region,
so the two are refused together (config.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

GIB = 1 << 30
_REGISTER_PORTABLE_MAPPED = 0x03  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _HostMapped:
    """Host memory registered with CUDA for as long as the device view made from it lives (torch keeps this
    object, the view's owner, alive with the view)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8)  # pageable memory, page-locked just below
        self.ptr = self.host.data_ptr()
        with torch.cuda.device(device):
            status = torch.cuda.cudart().cudaHostRegister(self.ptr, nbytes, _REGISTER_PORTABLE_MAPPED)
        if int(status) != 0:
            raise RuntimeError(f"cpu_offload_gb: cudaHostRegister of {nbytes} bytes failed ({int(status)}): the "
                               "host may not have that much memory to lock")
        self.registered = True
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (self.ptr, False),
                                         "version": 3, "strides": None}

    def __del__(self) -> None:
        _MAPPED.pop(getattr(self, "ptr", 0), None)
        if getattr(self, "registered", False):
            with contextlib.suppress(Exception):  # at interpreter exit the runtime may be gone first
                torch.cuda.cudart().cudaHostUnregister(self.ptr)


def host_mapped_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised CUDA tensor of `shape` whose memory is host memory the device reads in place."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    owner = _HostMapped(max(nbytes, 1), device)
    view = torch.as_tensor(owner, device=device)  # uint8 [nbytes] at the host address, owning `owner`
    _MAPPED[owner.ptr] = nbytes
    return view[:nbytes].view(dtype).view(shape)


# data_ptr -> bytes of the host-mapped allocations made here (is_host_mapped / offloaded_bytes).
_MAPPED: dict[int, int] = {}


def is_host_mapped(t: torch.Tensor) -> bool:
    return t.is_cuda and t.untyped_storage().data_ptr() in _MAPPED


def offloaded_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers that live in host memory."""
    seen: set[int] = set()
    total = 0
    for t in (*model.parameters(), *model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr in _MAPPED and ptr not in seen:
            seen.add(ptr)
            total += _MAPPED[ptr]
    return total


class _Offloading:
    """The registration hook and what it has offloaded so far."""

    def __init__(self, budget: int) -> None:
        self.left = budget
        self.offloaded = 0

    def __call__(self, module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> Any:
        if param is None or not param.is_cuda or is_host_mapped(param):
            return None
        nbytes = param.numel() * param.element_size()
        if not 0 < nbytes <= self.left:
            return None
        data = host_mapped_empty(tuple(param.shape), param.dtype, param.device)
        data.copy_(param.detach())
        self.left -= nbytes
        self.offloaded += nbytes
        return torch.nn.Parameter(data, requires_grad=param.requires_grad)


@contextlib.contextmanager
def offloading(budget_bytes: int, device: torch.device) -> Iterator[_Offloading | None]:
    """Build a model inside this: its first `budget_bytes` of parameters go to host-mapped memory (module doc).
    No-op (yields None) for a zero budget or a non-CUDA device."""
    if budget_bytes <= 0 or torch.device(device).type != "cuda":
        yield None
        return
    hook = _Offloading(budget_bytes)
    handle = register_module_parameter_registration_hook(hook)
    try:
        yield hook
    finally:
        handle.remove()
