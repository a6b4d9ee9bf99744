"""The end of every model's load_weights: each checkpoint tensor used, each parameter set."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ferrox.distributed.sharding import materialize
from ferrox.model_spec import ModelLoadError


def check_all_loaded(architecture: str, unexpected: list[str], expected: Iterable[str], loaded: set[str]) -> None:
    """ModelLoadError naming (up to 8 of) the checkpoint tensors the model has no place for, then the
    pieces it expected and never got (merged-layer shards written `name#shard`)."""
    if unexpected:
        raise ModelLoadError(f"checkpoint has {len(unexpected)} tensor(s) this {architecture} does not "
                             f"use: {', '.join(sorted(unexpected)[:8])}")
    missing = set(expected) - loaded
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): "
                             f"{', '.join(sorted(m.replace('#', ' shard ') for m in missing)[:8])}")


def load_into(owner: nn.Module, param: torch.Tensor | None, leaf: str, tensor: Any) -> None:
    """One checkpoint tensor into the module that holds it: a parallel or quantized layer's own load_weight
    (this rank's part, its method's tensors), else the whole parameter (norms, routers, sinks: replicated),
    cast to its dtype. ValueError on a shape the model does not have (the caller names the tensor)."""
    load = getattr(owner, "load_weight", None)
    if load is not None:
        load(leaf, tensor, None)
        return
    assert param is not None  # (the caller checked that the owner takes `leaf`)
    value = materialize(tensor)
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"checkpoint shape {tuple(value.shape)}, model expects {tuple(param.shape)}")
    param.data.copy_(value)


def load_whole(module: nn.Module, tensors: Mapping[str, torch.Tensor], prefix: str, architecture: str) -> None:
    """Copy each parameter of a small unsharded module (a multimodal projector) from the tensor of its name:
    every parameter exactly once, every tensor used, shapes equal (ModelLoadError naming `prefix.name`)."""
    params = dict(module.named_parameters())
    if set(tensors) != set(params):
        raise ModelLoadError(f"{architecture}: the {prefix} tensors are {sorted(tensors)}, the model has "
                             f"{sorted(params)}")
    with torch.no_grad():
        for name, param in params.items():
            if tuple(tensors[name].shape) != tuple(param.shape):
                raise ModelLoadError(f"tensor '{prefix}.{name}': shape {tuple(tensors[name].shape)}, the model has "
                                     f"{tuple(param.shape)} (config.json does not match?)")
            param.copy_(tensors[name])


def check_tower_loaded(tower: str, unknown: Iterable[str], expected: Iterable[str], loaded: set[str]) -> None:
    """The end of a vision tower's load_weights: UnsupportedModelError (a ValueError: the checkpoint and config do
    not go together) naming up to 8 tensors the tower does not know, then the pieces it never got."""
    from ferrox.model_spec import UnsupportedModelError

    unknown = sorted(unknown)
    if unknown:
        raise UnsupportedModelError(f"checkpoint has {len(unknown)} tensor(s) the {tower} does not know: "
                                    f"{', '.join(unknown[:8])}")
    missing = sorted(m.replace("#", " shard ") for m in set(expected) - loaded)
    if missing:
        raise UnsupportedModelError(f"checkpoint is missing {len(missing)} tensor(s) of the {tower}: "
                                    f"{', '.join(missing[:8])}")


def load_tower_tensors(module: nn.Module, weights: Iterable[tuple[str, Any]], tower: str, *,
                       rename: Callable[[str], str] = lambda name: name, skip: tuple[str, ...] = (),
                       conv: tuple[str, tuple[int, ...]] | None = None) -> None:
    """A vision tower's load_weights when its parameters carry the checkpoint's names: each tensor (named
    `rename(name)`; names ending in `skip` left out) copied into its parameter, `conv` = (name, the checkpoint's
    shape) for the patch convolution a tower keeps as a matmul; then check_tower_loaded."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    unknown: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name.endswith(skip):
            continue
        param = params.get(name)
        if param is None:
            unknown.append(ckpt_name)
            continue
        tensor = materialize(tensor)
        shape = conv[1] if conv is not None and name == conv[0] else tuple(param.shape)
        if tuple(tensor.shape) not in (shape, tuple(param.shape)):
            from ferrox.model_spec import UnsupportedModelError

            raise UnsupportedModelError(f"vision tensor {ckpt_name!r}: checkpoint shape {tuple(tensor.shape)}, the "
                                        f"{tower} expects {shape} (vision_config does not match the weights?)")
        param.data.copy_(tensor.reshape(param.shape))
        loaded.add(name)
    check_tower_loaded(tower, unknown, params, loaded)
