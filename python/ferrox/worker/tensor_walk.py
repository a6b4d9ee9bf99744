"""Every tensor a model holds, and moving their storages somewhere else in place.

Sleep mode (worker/sleep_memory.py) needs the weights in memory it can release. Loading them
straight into that memory would also trap there whatever the load frees on the way (an FP8 model
quantized at load time frees its bf16 originals: measured 7.7 of 16.1 GiB of the pool on an
8B model), because that pool's cached blocks serve no other allocation. So the model loads as
usual and its storages move afterwards, one at a time (peak: the model plus its largest tensor).

A storage moves with `Tensor.set_`, so every tensor object that uses it, views and tied weights
included, follows without being replaced: the layers, the quantization runners and any other
holder of those objects see the new memory. What the walk cannot reach (a tensor object held
only outside the module tree's attributes) keeps the old storage, which stays valid: it is then
not released by a sleep, and `adopt` reports its bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Containers and plain objects are followed this many levels below a module's attributes (a
# quantized layer's runner holding its tensors is one level).
_MAX_DEPTH = 4
_LEAF_TYPES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


def module_tensors(model: nn.Module, device_type: str) -> list[torch.Tensor]:
    """The distinct tensor objects on `device_type` reachable from the model's modules: parameters,
    buffers, and tensors in their other attributes (lists, tuples, dicts, plain objects)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device_type:
                found.setdefault(id(obj), obj)
            return
        if depth > _MAX_DEPTH or isinstance(obj, (*_LEAF_TYPES, nn.Module)) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for value in obj.values():
                visit(value, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for value in obj:
                visit(value, depth + 1)
        elif hasattr(obj, "__dict__") and not callable(obj):
            for value in vars(obj).values():
                visit(value, depth + 1)
        elif hasattr(obj, "__slots__") and not callable(obj):
            for name in _slot_names(type(obj)):
                visit(getattr(obj, name, None), depth + 1)

    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            visit(tensor, 0)
        for name, value in vars(module).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                visit(value, 0)
    return list(found.values())


def _slot_names(cls: type) -> Iterator[str]:
    for klass in cls.__mro__:
        slots = getattr(klass, "__slots__", ())
        yield from ([slots] if isinstance(slots, str) else slots)


def move_storages(tensors: list[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Give each distinct storage of `tensors` a copy allocated now (under the caller's allocator
    context) and point every tensor that used it there; returns the new storages."""
    moved: dict[int, torch.UntypedStorage] = {}
    with torch.no_grad():
        for tensor in tensors:
            old = tensor.untyped_storage()
            new = moved.get(old.data_ptr())
            if new is None:
                new = torch.empty(old.nbytes(), dtype=torch.uint8, device=tensor.device).untyped_storage()
                new.copy_(old)
                moved[old.data_ptr()] = new
            # (An inference tensor may change in place only in inference mode.)
            with torch.inference_mode() if tensor.is_inference() else contextlib.nullcontext():
                tensor.set_(new, tensor.storage_offset(), tensor.size(), tensor.stride())
            del old
    return list(moved.values())
