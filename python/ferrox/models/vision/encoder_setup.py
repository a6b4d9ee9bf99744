"""What two of vLLM's flags make of a vision-language model's encoder, applied by the loader
(loader/model_loader.py) around each family's own code.

--language-model-only (or --limit-mm-per-prompt giving 0 to every modality the model takes, as vLLM's): the
model serves text only, so its vision side is never built. A family builds its tower, projector and other
image-only tensors on `vision_device(device)`, which is the meta device while the loader builds a text-only
model (`building_text_only`): they take no memory, their shapes still check the checkpoint's as it loads (a
copy into a meta tensor does nothing), and `drop_vision_encoder` then swaps each such module for a
`SkippedEncoder` (no parameters) and marks the model as taking no images, so nothing downstream (the runner's
image state, sleep mode, dummy weights) meets a meta tensor.

--mm-encoder-tp-mode under tensor parallelism (`place_vision_encoder`, once the weights are loaded):
'weights' shards each tower's transformer blocks over the ranks (tower_tp.py) and every rank runs every
image; 'data' keeps the towers whole and gives the model its TP group as `mm_encoder_data_group`, by which
worker/multimodal.py splits each step's new images among the ranks and gathers their embeddings. A tower
whose heads (or MLP width) do not split N ways runs as 'data' (some of vLLM's encoders do the same), with a
warning naming the numbers.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ferrox.distributed.parallel_state import TPGroup
from ferrox.models.vision.tower_tp import shard_tower, tower_tp_problem

logger = logging.getLogger(__name__)

_TEXT_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("ferrox_text_only", default=False)
_META = torch.device("meta")


@contextlib.contextmanager
def building_text_only(on: bool = True) -> Iterator[None]:
    """Build a model inside this block to leave its vision side unbuilt (module docstring)."""
    token = _TEXT_ONLY.set(on)
    try:
        yield
    finally:
        _TEXT_ONLY.reset(token)


# Modalities whose own encoder a family leaves unbuilt (--limit-mm-per-prompt gives them 0 while others stay open:
# vLLM's rule), set around the model's construction by the loader (`building_without`).
_SKIPPED: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("ferrox_skipped_modalities",
                                                                         default=frozenset())


@contextlib.contextmanager
def building_without(limits: Mapping[str, int] | None) -> Iterator[None]:
    """Build a model inside this block to leave out the encoder of each modality of its own (audio) that `limits`
    gives 0; a family asks `modality_skipped` before building one."""
    token = _SKIPPED.set(frozenset(m for m in ("audio",) if (limits or {}).get(m) == 0))
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def modality_skipped(modality: str) -> bool:
    """Whether the model being built leaves this modality's encoder out (`building_without`)."""
    return modality in _SKIPPED.get()


def vision_device(device: torch.device | str) -> torch.device | str:
    """Where a family builds its vision tower, projector and image-only tensors: `device`, or the meta
    device while a text-only model is built."""
    return _META if _TEXT_ONLY.get() else device


def text_only_model(cls: type, limits: Mapping[str, int] | None, hf_config: Mapping[str, Any] | None = None) -> bool:
    """Whether a model class serves text only under these per-prompt limits: it takes images, and every
    modality it takes (images, and videos where it takes them, and audio where its config has an audio tower:
    the class's `takes_audio_of(hf_config)`) has a limit of 0 (vLLM's rule: the encoder is not loaded when no
    prompt may use it)."""
    if not getattr(cls, "takes_images", False):
        return False
    limits = limits or {}
    only = getattr(cls, "media_modalities", None)  # (a family that names its own: Qwen2-Audio's audio alone)
    if only is not None:
        return all(limits.get(modality) == 0 for modality in only)
    taken: tuple[str, ...] = ("image", "video") if getattr(cls, "takes_videos", False) else ("image",)
    audio = getattr(cls, "takes_audio_of", None)
    if audio is not None and audio(hf_config or {}):  # (Gemma 4: its audio tower is built with the vision side)
        taken += ("audio",)
    return all(limits.get(modality) == 0 for modality in taken)


class SkippedEncoder(nn.Module):
    """What stands for a vision module that a text-only model did not build."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def load_weights(self, weights: Any) -> None:
        """A family's loader hands it the checkpoint's tensors: none is read."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.name}: the vision encoder was not built (--language-model-only, or every "
                           "--limit-mm-per-prompt is 0): this model takes no images")


def drop_vision_encoder(model: nn.Module) -> list[str]:
    """Swap each module whose tensors are all on the meta device for a SkippedEncoder, drop such tensors held
    directly (a buffer), and mark the model as taking no images. Returns what was dropped. A module holding
    both meta and real tensors is a family's mistake: RuntimeError naming it."""
    dropped = _drop(model, "")
    if dropped:
        model.takes_images = False  # type: ignore[assignment]  # (the class says True: this instance, no)
        model.takes_videos = False  # type: ignore[assignment]
        model.takes_audio = False  # type: ignore[assignment]
        model.vision_encoder_skipped = True  # type: ignore[assignment]
        logger.info("language model only: the vision side (%s) was not built", ", ".join(dropped))
    return dropped


def _drop(module: nn.Module, prefix: str) -> list[str]:
    dropped: list[str] = []
    for name, child in list(module.named_children()):
        tensors = list(child.parameters()) + list(child.buffers())
        metas = sum(t.is_meta for t in tensors)
        if tensors and metas == len(tensors):
            setattr(module, name, SkippedEncoder(prefix + name))
            dropped.append(prefix + name)
        elif metas:
            dropped += _drop(child, f"{prefix}{name}.")
    for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        if tensor.is_meta:
            if name in module._parameters:
                module._parameters[name] = None
            else:
                module._buffers[name] = None
            dropped.append(prefix + name)
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{type(module).__name__}: {', '.join(left[:4])} left on the meta device (a module "
                           "mixes vision and language tensors)")
    return dropped


def place_vision_encoder(model: nn.Module, tp: TPGroup, mode: str) -> str | None:
    """--mm-encoder-tp-mode for a loaded model on `tp`'s ranks (module docstring). Returns the mode the encoder
    runs in ('weights' or 'data'), or None where there is nothing to place (one rank, no vision tower)."""
    model.mm_encoder_data_group = None  # type: ignore[assignment]
    if tp.size == 1 or not getattr(model, "takes_images", False):
        return None
    towers: list[Any] = [m for m in model.modules() if hasattr(m, "tp_blocks")]
    if not towers:
        return None
    if mode == "weights":
        problem = next((p for t in towers if (p := tower_tp_problem(t.tp_blocks(), tp.size, type(t).__name__))),
                       None)
        if problem is None:
            for tower in towers:
                shard_tower(tower.tp_blocks(), tp)
            return "weights"
        if tp.is_driver:
            logger.warning("mm_encoder_tp_mode 'weights': %s; the encoder stays whole on every rank and each rank "
                           "encodes its share of the images ('data')", problem)
    model.mm_encoder_data_group = tp  # type: ignore[assignment]
    return "data"
